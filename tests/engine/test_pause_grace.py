"""Pause stops the scheduling at once and gets a grace like Stop (issue 20, item 5): once the
runner acknowledged a pause no step starts; after ORCH_PAUSE_GRACE_SECONDS a step that is safe
to cut is cancelled and runs again on resume, while a non-idempotent effect in flight is let
finish (with real worker processes)."""
import threading
from pathlib import Path

import pytest

from orchestrator.engine import services
from tests.support.helpers import drive_and_close
from orchestrator.models import Step, Task, WalEntry
from review.models import ReviewItem
from tests.conftest import wait_for
from tests.support.testtypes import starts

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.task_types("tests.support.testtypes")]


TEST_TYPES = {"ORCH_EXTRA_TASK_TYPES": "tests.support.testtypes"}


def status(task_id: int) -> str:
    return Task.objects.get(pk=task_id).status


def wait_status(task_id: int, *wanted: str, timeout: float = 30) -> Task:
    wait_for(lambda: status(task_id) in wanted, timeout=timeout, interval=0.02, message=f"status in {wanted}")
    return Task.objects.get(pk=task_id)


@pytest.mark.workers
def test_no_step_starts_after_the_runner_acknowledged_a_pause_of_a_migration(start_workers):
    start_workers(1)
    task = services.task_create(type="demo.migrate_rows", params={"rows": 20000, "batch_size": 50},
                                limits={"max_subtasks": 4})
    wait_for(lambda: Step.objects.filter(task_id=task.pk, status="done").count() >= 20, timeout=120,
             interval=0.01, message="batches to run")
    services.task_pause(task_id=task.pk)
    task = wait_status(task.pk, "paused", "completed", timeout=30)
    assert task.status == "paused"
    acknowledged = task.control_acknowledged_at
    assert acknowledged is not None
    started_after = Step.objects.filter(task=task, started_at__gt=acknowledged).count()
    assert started_after == 0
    assert Step.objects.filter(task=task, status="pending").exists()  # it did stop early
    services.task_resume(task_id=task.pk)
    assert wait_status(task.pk, "completed", "failed", "needs_human", timeout=120).status == "completed"


@pytest.mark.workers
def test_pause_grace_cuts_a_long_safe_step_and_it_runs_again_on_resume(start_workers, tmp_path):
    start_workers(1, ORCH_PAUSE_GRACE_SECONDS=0.5, **TEST_TYPES)
    log, release = tmp_path / "starts.log", tmp_path / "release"
    task = services.task_create(type="test.timeboxed", params={
        "steps": 2, "seconds": 120, "starts_log": str(log), "hold_until": str(release)})
    wait_for(lambda: starts(str(log)), timeout=30, message="step-1 to start")
    services.task_pause(task_id=task.pk)
    task = wait_status(task.pk, "paused", timeout=5)  # not 120 s: the step was cut after its grace
    step = Step.objects.get(task=task, step_id="step-1")
    assert step.status == "pending" and step.attempts == 0  # cut, not failed
    release.touch()
    services.task_resume(task_id=task.pk)
    assert wait_status(task.pk, "completed", "failed", "needs_human").status == "completed"
    assert [s for s, _ in starts(str(log))] == ["step-1", "step-1", "step-2"]  # it ran again on resume


@pytest.mark.workers
def test_pause_grace_lets_a_non_idempotent_effect_in_flight_finish(start_workers, smtp, tmp_path):
    smtp.mode, smtp.late_seconds = "reply_late", 2.0  # the send is in flight for 2 s
    start_workers(1, ORCH_PAUSE_GRACE_SECONDS=0.2, EMAIL_PORT=smtp.port, EMAIL_TIMEOUT=10, **TEST_TYPES)
    log, release = tmp_path / "starts.log", tmp_path / "release"
    task = services.task_create(type="test.timeboxed", params={
        "seconds": 120, "starts_log": str(log), "hold_until": str(release), "email_to": "ann@example.org"})
    wait_for(lambda: starts(str(log)), timeout=30, message="the step to start")
    services.task_pause(task_id=task.pk)
    task = wait_status(task.pk, "paused", "awaiting_review", timeout=10)
    assert task.status == "paused"  # the send finished (not cut into an unknown); then the step was cut
    entry = WalEntry.objects.get(task=task)
    assert entry.status == "done" and len(smtp.received) == 1
    assert not ReviewItem.objects.filter(task=task).exists()
    smtp.mode = "ok"
    release.touch()
    services.task_resume(task_id=task.pk)
    assert wait_status(task.pk, "completed", "failed", "needs_human", "awaiting_review").status == "completed"
    assert len(smtp.received) == 1  # replayed from the WAL on resume, not sent again


def test_a_step_not_safe_to_cancel_is_let_finish_after_the_grace(settings, tmp_path):
    settings.ORCH_PAUSE_GRACE_SECONDS = 0.1
    log = tmp_path / "starts.log"
    task = services.task_create(type="test.timeboxed", params={
        "steps": 2, "seconds": 1.0, "safe_to_cancel": False, "starts_log": str(log)})
    runner = threading.Thread(target=drive_and_close, args=(task.pk,), daemon=True)
    runner.start()
    wait_for(lambda: starts(str(log)), timeout=10, message="step-1 to start")
    services.task_pause(task_id=task.pk)
    runner.join(timeout=20)
    task = Task.objects.get(pk=task.pk)
    assert task.status == "paused"
    assert Step.objects.get(task=task, step_id="step-1").status == "done"  # let finish, not cut
    assert [s for s, _ in starts(str(log))] == ["step-1"]  # and nothing started after the pause


def test_a_pause_on_a_short_step_still_lets_it_finish(settings, tmp_path):
    """The grace is a grace: a step that ends within it is not cut."""
    settings.ORCH_PAUSE_GRACE_SECONDS = 5
    log = tmp_path / "starts.log"
    task = services.task_create(type="test.timeboxed", params={"steps": 2, "seconds": 0.5, "starts_log": str(log)})
    runner = threading.Thread(target=drive_and_close, args=(task.pk,), daemon=True)
    runner.start()
    wait_for(lambda: starts(str(log)), timeout=10, message="step-1 to start")
    services.task_pause(task_id=task.pk)
    runner.join(timeout=20)
    task = Task.objects.get(pk=task.pk)
    assert task.status == "paused"
    assert Step.objects.get(task=task, step_id="step-1").status == "done"
    assert Path(log).read_text().count("step-") == 1


def test_no_step_starts_while_the_acknowledgement_is_being_written(monkeypatch, tmp_path):
    """The window the migration above hits by chance, widened on purpose: a slow acknowledgement."""
    from orchestrator.engine import runner as runner_module

    acknowledge = runner_module.acknowledge

    def slow_acknowledge(lease, control):
        acknowledge(lease, control)
        threading.Event().wait(0.3)  # the runner keeps scheduling meanwhile, unless starts are held

    monkeypatch.setattr(runner_module, "acknowledge", slow_acknowledge)
    task = services.task_create(type="test.timeboxed", params={"steps": 400, "seconds": 0.01, "parallel": True},
                                limits={"max_subtasks": 4})
    runner = threading.Thread(target=drive_and_close, args=(task.pk,), daemon=True)
    runner.start()
    wait_for(lambda: Step.objects.filter(task_id=task.pk, status="done").count() >= 10, timeout=30,
             interval=0.01, message="steps to run")
    services.task_pause(task_id=task.pk)
    runner.join(timeout=30)
    task = Task.objects.get(pk=task.pk)
    assert task.status == "paused"
    assert Step.objects.filter(task=task, started_at__gt=task.control_acknowledged_at).count() == 0
