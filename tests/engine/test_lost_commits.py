"""A checkpoint commit that the database took but whose reply never came back, and commits
the database acknowledged and then lost (a server crash with pure-step commits not yet
flushed): neither doubles a step nor leaves the run building on state that is gone."""
from collections import Counter

import pytest
from django.db import OperationalError, connection

from orchestrator.engine import checkpoint, services
from orchestrator.engine.worker import drive_inline
from orchestrator.models import Snapshot, Step, Task, TaskEvent

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.task_types("tests.support.testtypes")]


@pytest.fixture
def commits(monkeypatch):
    """Calls of the commit, by step, with a hook that runs around the n-th one."""
    real = checkpoint._commit_step
    calls = Counter()
    hooks = {}

    def commit(lease, plan, step_commit, *rest):
        calls[step_commit.step_id] += 1
        n = sum(calls.values())
        if n in hooks:
            return hooks[n](real, lease, plan, step_commit)
        return real(lease, plan, step_commit, *rest)

    monkeypatch.setattr(checkpoint, "_commit_step", commit)
    return calls, hooks


def step_done_counts(task_id: int) -> Counter:
    return Counter(TaskEvent.objects.filter(task_id=task_id, kind="step_done").values_list("payload__step", flat=True))


def test_a_commit_whose_reply_was_lost_is_not_committed_again(commits):
    calls, hooks = commits

    def commit_then_lose_the_reply(real, lease, plan, step_commit):
        real(lease, plan, step_commit)
        raise OperationalError("server closed the connection unexpectedly")

    hooks[2] = commit_then_lose_the_reply
    task = services.task_create(type="test.diamond", params={"x": 3, "y": 2, "z": 5})
    assert drive_inline(task.pk) == "completed"
    task = Task.objects.get(pk=task.pk)
    # The retry found its own commit: one step_done per step, no version skipped.
    assert step_done_counts(task.pk) == {"a": 1, "b": 1, "c": 1, "d": 1}
    assert task.checkpoint_version == 1 + 4 and task.steps_done == 4
    assert sum(calls.values()) == 5  # four commits and the one retried
    assert dict(Step.objects.filter(task=task).values_list("step_id", "attempts")) == {"a": 1, "b": 1, "c": 1, "d": 1}
    assert Step.objects.get(task=task, step_id="c").result == (3 + 5) * 2 + 1


def lose_the_last_commit(task_id: int) -> str:
    """What a server crash does to an acknowledged, unflushed commit: it never happened."""
    task = Task.objects.get(pk=task_id)
    event = TaskEvent.objects.get(task_id=task_id, seq=task.event_seq)
    assert event.kind == "step_done"
    lost = event.payload["step"]
    Step.objects.filter(task_id=task_id, step_id=lost).update(status="pending", result=None, attempts=0,
                                                              finished_at=None)
    Snapshot.objects.filter(task_id=task_id, version=task.checkpoint_version).delete()
    event.delete()
    with connection.cursor() as cursor:
        cursor.execute("UPDATE orchestrator_task SET checkpoint_version = checkpoint_version - 1, "
                       "event_seq = event_seq - 1, steps_done = steps_done - 1 WHERE id = %s", [task_id])
    return lost


def test_commits_the_database_lost_make_the_run_start_again_from_what_it_holds(commits):
    calls, hooks = commits
    lost = []

    def lose_the_previous_commit_first(real, lease, plan, step_commit):
        lost.append(lose_the_last_commit(lease.task_id))
        return real(lease, plan, step_commit)

    hooks[3] = lose_the_previous_commit_first
    task = services.task_create(type="test.diamond", params={"x": 3, "y": 2, "z": 5})
    # The third commit finds the database a version behind this run: the run stops without
    # writing its memory and queues the task again.
    assert drive_inline(task.pk) == "restarted from the database"
    task = Task.objects.get(pk=task.pk)
    assert task.status == "running" and task.lease_owner == ""
    assert drive_inline(task.pk) == "completed"
    task = Task.objects.get(pk=task.pk)
    # The lost step ran again; every step is in the database exactly once.
    assert step_done_counts(task.pk) == {"a": 1, "b": 1, "c": 1, "d": 1}
    assert calls[lost[0]] == 2
    assert task.steps_done == 4 and task.checkpoint_version == 1 + 4
    assert Step.objects.get(task=task, step_id="c").result == (3 + 5) * 2 + 1
