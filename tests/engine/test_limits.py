"""Each limit pauses the task with its reason, keeps its work, and the task continues
once the limit is raised."""
import pytest

from orchestrator.engine import services
from orchestrator.engine.states import InvalidTransition
from orchestrator.engine.worker import drive_inline
from orchestrator.models import Step, Task

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.task_types("tests.support.testtypes")]


def create(limits: dict, **params) -> Task:
    return services.task_create(type="test.interruptible", params={"mode": "sleep", "seconds": 0.01, **params},
                                limits=limits)


def run(task: Task) -> Task:
    drive_inline(task.pk)
    return Task.objects.get(pk=task.pk)


def done_steps(task: Task) -> int:
    return Step.objects.filter(task=task, status="done").count()


def test_max_steps_pauses_then_resumes_after_raising():
    task = run(create({"max_steps": 2, "max_subtasks": 1}, steps=5))
    assert (task.status, task.status_reason) == ("paused", "limit: max_steps")
    assert task.paused_by_limit == "max_steps"  # the field says so, not only the reason text
    assert done_steps(task) == 2
    with pytest.raises(InvalidTransition, match="raise max_steps"):
        services.task_resume(task_id=task.pk)
    services.task_resume(task_id=task.pk, limits={"max_steps": 10})
    assert Task.objects.get(pk=task.pk).paused_by_limit == ""  # cleared on resume
    task = run(task)
    assert task.status == "completed" and done_steps(task) == 5
    assert all(s.attempts == 1 for s in Step.objects.filter(task=task))  # kept, not redone


def test_max_tokens_pauses_then_resumes_after_raising():
    task = run(create({"max_tokens": 25, "max_subtasks": 1}, steps=4, tokens_per_step=10))
    assert (task.status, task.status_reason, task.paused_by_limit) == ("paused", "limit: max_tokens", "max_tokens")
    assert task.tokens_used == 30 and done_steps(task) == 3
    services.task_resume(task_id=task.pk, limits={"max_tokens": 100})
    task = run(task)
    assert task.status == "completed" and task.tokens_used == 40


def test_max_seconds_pauses_and_paused_time_does_not_count():
    task = run(create({"max_seconds": 0.5, "max_subtasks": 1}, steps=6, seconds=0.2))
    assert (task.status, task.status_reason, task.paused_by_limit) == ("paused", "limit: max_seconds", "max_seconds")
    assert 1 <= done_steps(task) < 6
    active = task.active_seconds
    assert 0.5 <= active < 1.5
    services.task_resume(task_id=task.pk, limits={"max_seconds": 60})
    task = run(task)
    assert task.status == "completed"
    assert task.active_seconds < active + 6 * 0.2 + 1  # only running time was added


def test_max_subtasks_pauses_the_step_that_spawns_too_many_and_resumes_after_raising():
    task = run(create({"max_subtasks": 2}, steps=1, subtasks=3, url="spawn"))
    assert (task.status, task.status_reason, task.paused_by_limit) == ("paused", "limit: max_subtasks", "max_subtasks")
    assert done_steps(task) == 0
    services.task_resume(task_id=task.pk, limits={"max_subtasks": 3})
    task = run(task)
    assert task.status == "completed"


def test_invalid_limits_on_resume_are_refused_by_field():
    task = run(create({"max_steps": 1, "max_subtasks": 1}, steps=2))
    with pytest.raises(services.InvalidInput) as info:
        services.task_resume(task_id=task.pk, limits={"max_steps": 0})
    assert info.value.errors[0].field == "limits.max_steps"
    assert Task.objects.get(pk=task.pk).status == "paused"
