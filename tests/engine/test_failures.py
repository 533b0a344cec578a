"""Failing steps: transient failures retry with backoff, the same failure twice needs a
human (who is told), recovery checks the task's external resources first."""
from datetime import timedelta

import pytest
from django.db.models import F

from orchestrator.engine import recovery, services
from orchestrator.engine.lease import claim
from orchestrator.engine.worker import drive_inline
from orchestrator.models import Step, Task

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def test_types(settings):
    settings.ORCH_EXTRA_TASK_TYPES = ["tests.support.testtypes"]


def run(params: dict) -> Task:
    task = services.task_create(type="test.flaky", params=params)
    drive_inline(task.pk)
    return Task.objects.get(pk=task.pk)


def test_a_transient_failure_is_retried_and_the_task_completes(tmp_path):
    task = run({"mode": "transient", "marker": str(tmp_path / "up")})
    assert task.status == "completed"
    step = Step.objects.get(task=task)
    assert step.attempts == 2 and step.result == "ok"


def test_the_same_failure_twice_needs_a_human_and_the_operators_are_emailed(make_user, mailoutbox):
    operator = make_user("otto", "operator")
    operator.email = "otto@example.org"
    operator.save()
    task = run({"mode": "same"})  # numbers and addresses differ; the fingerprint does not
    assert task.status == "needs_human"
    assert "failed twice the same way" in task.status_reason and "ValueError" in task.status_reason
    assert Step.objects.get(task=task).attempts == 2  # not retried a third time
    assert [m.to for m in mailoutbox] == [["otto@example.org"]]
    assert f"/api/tasks/{task.pk}/export" in mailoutbox[0].body


def test_different_failures_use_up_the_attempts_and_fail(tmp_path):
    task = run({"mode": "changing", "marker": str(tmp_path / "count")})
    assert task.status == "failed"
    assert "failed after 3 attempts" in task.status_reason and "RuntimeError" in task.status_reason
    assert Step.objects.get(task=task).attempts == 3


def test_a_needs_human_task_can_be_resumed_by_an_operator():
    task = run({"mode": "same"})
    services.task_resume(task_id=task.pk)
    assert Task.objects.get(pk=task.pk).status == "queued"


def test_recovery_checks_external_resources_before_continuing(tmp_path, settings):
    settings.ORCH_STALE_AFTER_SECONDS = 0.1
    resource = tmp_path / "input.csv"
    task = services.task_create(type="test.flaky", params={"mode": "transient", "marker": str(tmp_path / "m"),
                                                           "resource": str(resource)})
    assert claim(task.pk) is not None  # a worker took it, then died without a heartbeat
    Task.objects.filter(pk=task.pk).update(status="running", heartbeat_at=F("heartbeat_at") - timedelta(seconds=5))
    assert recovery.sweep() == [task.pk]
    task = Task.objects.get(pk=task.pk)
    assert task.status == "needs_human" and "input file" in task.status_reason
