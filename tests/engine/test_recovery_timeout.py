"""Recovery bounded: a recovery that does not get its task running again within
ORCH_RECOVERY_TIMEOUT_SECONDS hands the task to a human, with the reason, and tells the
operators."""
import os
import signal
from datetime import timedelta

import pytest
from django.db.models import F
from django.utils import timezone

from orchestrator.engine import recovery, services
from orchestrator.engine.lease import claim
from orchestrator.engine.worker import drive_inline
from orchestrator.models import Task
from tests.conftest import wait_for

pytestmark = pytest.mark.django_db(transaction=True)


def stale(task: Task) -> None:
    Task.objects.filter(pk=task.pk).update(status="running", heartbeat_at=F("heartbeat_at") - timedelta(seconds=60))


def test_a_recovery_nobody_picks_up_in_time_needs_a_human_and_operators_are_told(settings, make_user, mailoutbox):
    settings.ORCH_STALE_AFTER_SECONDS, settings.ORCH_RECOVERY_TIMEOUT_SECONDS = 1, 30
    otto = make_user("otto", "operator")
    task = services.task_create(type="demo.pipeline", params={"stages": 2, "seconds_per_stage": 0.1})
    assert claim(task.pk) is not None
    stale(task)  # its worker died; no worker is left to take it over
    assert recovery.sweep() == [task.pk]
    task = Task.objects.get(pk=task.pk)
    assert task.status == "running" and task.lease_owner == "" and task.recovering_since is not None

    assert recovery.give_up_slow_recoveries() == []  # within the timeout: keep waiting
    Task.objects.filter(pk=task.pk).update(recovering_since=timezone.now() - timedelta(seconds=31))
    recovery.sweep()
    task = Task.objects.get(pk=task.pk)
    assert task.status == "needs_human" and task.recovering_since is None
    assert "recovery timed out" in task.status_reason and "ORCH_RECOVERY_TIMEOUT_SECONDS=30" in task.status_reason
    assert "heartbeat of" in task.status_reason  # the last recovery's cause
    assert [m.to for m in mailoutbox] == [[otto.email]] and "recovery timed out" in mailoutbox[0].body

    services.task_resume(task_id=task.pk)  # the operator fixed the cause
    assert drive_inline(task.pk) == "completed"


def test_a_recovery_that_got_the_task_running_is_not_timed_out(settings):
    settings.ORCH_STALE_AFTER_SECONDS, settings.ORCH_RECOVERY_TIMEOUT_SECONDS = 1, 30
    task = services.task_create(type="demo.pipeline", params={"stages": 1, "seconds_per_stage": 0.1})
    assert claim(task.pk) is not None
    stale(task)
    recovery.sweep()
    assert drive_inline(task.pk) == "completed"
    assert Task.objects.get(pk=task.pk).recovering_since is None  # cleared by the runner that got it going
    assert recovery.give_up_slow_recoveries() == []


@pytest.mark.workers
def test_a_recovery_that_keeps_failing_is_handed_to_a_human_by_the_timeout(start_workers, start_sweeper, smtp,
                                                                           make_user, settings):
    settings.ORCH_EXTRA_TASK_TYPES = ["tests.support.testtypes"]
    make_user("otto", "operator")
    env = {"ORCH_MAX_RECOVERY_ATTEMPTS": 100000, "ORCH_RECOVERY_TIMEOUT_SECONDS": 3, "EMAIL_PORT": smtp.port,
           "ORCH_EXTRA_TASK_TYPES": "tests.support.testtypes"}
    start_workers(2, **env)
    start_sweeper(**env)
    task = services.task_create(type="test.interruptible", params={"mode": "sleep", "steps": 4, "seconds": 1})
    wait_for(lambda: Task.objects.get(pk=task.pk).steps_done >= 1, timeout=60, message="a step done")
    # Its state becomes unreadable (think: a snapshot written by a newer release), then its
    # executor dies: every recovery now crashes before the task runs again.
    Task.objects.filter(pk=task.pk).update(params={"mode": "no-such-mode"})
    os.kill(Task.objects.get(pk=task.pk).worker_pid, signal.SIGKILL)
    wait_for(lambda: Task.objects.get(pk=task.pk).status == "needs_human", timeout=60, message="needs_human")
    task = Task.objects.get(pk=task.pk)
    assert "recovery timed out" in task.status_reason and task.recovery_attempts >= 2
    wait_for(lambda: any("needs a human" in m["Subject"] for m in smtp.received), timeout=10,
             message="the operators' email")
