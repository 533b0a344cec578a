"""Limits bound what starts, and reach inside a running step (issue 20, item 4): max_steps
never lets more steps start than it allows; a step past its timeout is cancelled through its
token and its failure policy applies; max_seconds and max_tokens cut a running step (the task
pauses, the step runs again on resume)."""
import logging
import threading
import time

import pytest

from orchestrator.engine import services
from tests.support.helpers import drive_and_close
from orchestrator.models import Step, Task, WalEntry
from orchestrator.tasktypes.base import StepSpec
from review.models import ReviewItem
from tests.conftest import wait_for
from tests.support.streaming_server import StreamingServer
from tests.support.testtypes import starts

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.task_types("tests.support.testtypes")]


FINAL = ("paused", "completed", "failed", "needs_human", "awaiting_review", "stopped")


def run_bounded(task: Task, within: float) -> tuple[Task, float]:
    """Run the task inline on a thread; fail (and stop it) if the run takes longer than `within` s."""
    began = time.monotonic()
    runner = threading.Thread(target=drive_and_close, args=(task.pk,), daemon=True)
    runner.start()
    runner.join(timeout=within)
    took = time.monotonic() - began
    if runner.is_alive():
        services.task_stop(task_id=task.pk)
        runner.join(timeout=30)
        pytest.fail(f"the run was still going after {within} s (status {Task.objects.get(pk=task.pk).status})")
    return Task.objects.get(pk=task.pk), took


def test_a_step_timeout_must_be_positive():
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        StepSpec("x", timeout=0)
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        StepSpec("x", timeout=-1.5)


@pytest.mark.workers
def test_max_steps_bounds_what_starts_six_recipients_three_emails(start_workers, smtp):
    start_workers(1, EMAIL_PORT=smtp.port)
    recipients = [f"r{i}@example.org" for i in range(1, 7)]
    task = services.task_create(type="demo.notify", params={"recipients": recipients, "subject": "Hello"},
                                limits={"max_steps": 3, "max_subtasks": 6})  # six may run at once
    wait_for(lambda: Task.objects.get(pk=task.pk).status in FINAL, timeout=60, message="the task to pause")
    task = Task.objects.get(pk=task.pk)
    assert (task.status, task.status_reason, task.paused_by_limit) == ("paused", "limit: max_steps", "max_steps")
    assert len(smtp.received) == 3  # not six: a limit bounds what starts
    assert Step.objects.filter(task=task, status="done").count() == 3
    assert WalEntry.objects.filter(task=task).count() == 3  # the other three never started
    services.task_resume(task_id=task.pk, limits={"max_steps": 6})
    wait_for(lambda: Task.objects.get(pk=task.pk).status in ("completed", "failed", "awaiting_review"), timeout=60,
             message="the task to complete")
    assert Task.objects.get(pk=task.pk).status == "completed"
    assert sorted(m["To"] for m in smtp.received) == recipients  # one each, none twice


def test_a_step_past_its_timeout_is_cancelled_and_its_failure_policy_applies():
    task = services.task_create(type="test.timeboxed", params={"seconds": 3600, "timeout": 0.5, "on_failure": "fail"})
    task, took = run_bounded(task, within=15)
    assert task.status == "failed", task.status_reason
    assert "ran longer than its timeout of 0.5 s" in task.error
    step = Step.objects.get(task=task, step_id="step-1")
    assert step.status == "failed" and step.attempts == 2  # a failed attempt, retried, then the same way again
    assert "StepTimedOut" in step.error
    assert took < 10


def test_a_timeout_while_the_database_was_unreachable_is_not_the_same_failure_as_the_next(tmp_path):
    """A step's first attempt runs out of time while its process finds the database unreachable
    (the soak saw it: a PostgreSQL restart held a step's WAL write past its 3 s timeout, then a
    genuine timeout made it "failed twice the same way" and the task needed a human). That
    attempt is not compared with the next: the step gets all its attempts."""
    from django.db import OperationalError

    from orchestrator.outage import OutageWatch

    starts_log = tmp_path / "starts"
    task = services.task_create(type="test.timeboxed", params={"seconds": 3600, "timeout": 0.5, "on_failure": "fail",
                                                              "starts_log": str(starts_log)})

    def outage_during_the_first_attempt():
        # What the executor's supervisor does when its heartbeat finds the database gone.
        wait_for(lambda: starts_log.exists() and starts_log.read_text().count("step-1") == 1, timeout=15,
                 message="the first attempt to start")
        OutageWatch(logging.getLogger("test"), "supervisor of the test").failed(OperationalError("server closed"))

    watcher = threading.Thread(target=outage_during_the_first_attempt, daemon=True)
    watcher.start()
    task, _ = run_bounded(task, within=20)
    watcher.join(timeout=5)
    assert task.status == "failed", task.status_reason
    step = Step.objects.get(task=task, step_id="step-1")
    # Without the outage the second timeout ends it "twice the same way" (the test above); here
    # the second and the third are compared, so it gets its third attempt.
    assert step.attempts == 3, task.error


def test_the_type_timeout_and_the_installation_default_apply_when_the_step_sets_none(settings):
    task = services.task_create(type="test.timeboxed_by_type", params={"seconds": 3600, "on_failure": "skip",
                                                                       "steps": 2, "parallel": True})
    task, _ = run_bounded(task, within=15)
    assert task.status == "completed"  # both steps skipped by their policy after timing out
    assert set(Step.objects.filter(task=task).values_list("status", flat=True)) == {"skipped"}
    assert "timeout of 0.4 s" in Step.objects.get(task=task, step_id="step-1").error

    settings.ORCH_STEP_TIMEOUT_SECONDS = 0.3
    task = services.task_create(type="test.timeboxed", params={"seconds": 3600, "on_failure": "needs_human"})
    task, _ = run_bounded(task, within=15)
    assert task.status == "needs_human" and "timeout of 0.3 s" in task.error


def test_a_timeout_with_a_post_in_flight_makes_its_outcome_unknown_and_sends_it_to_review(settings, silent_http):
    settings.ORCH_STEP_TIMEOUT_SECONDS = 1.0
    task = services.task_create(type="test.effects", params={"kind": "post", "url": silent_http.url, "timeout": 60})
    task, took = run_bounded(task, within=20)
    assert task.status == "awaiting_review", task.status_reason
    assert len(silent_http.requests) == 1  # never repeated
    entry = WalEntry.objects.get(task=task)
    assert entry.status == "pending"
    assert ReviewItem.objects.filter(task=task, wal_entry=entry).exists()
    assert took < 10


def test_max_seconds_pauses_a_task_inside_a_long_step():
    task = services.task_create(type="test.timeboxed", params={"seconds": 30}, limits={"max_seconds": 1})
    task, took = run_bounded(task, within=20)
    assert (task.status, task.status_reason, task.paused_by_limit) == ("paused", "limit: max_seconds", "max_seconds")
    assert took < 2.5
    step = Step.objects.get(task=task, step_id="step-1")
    assert step.status == "pending" and step.attempts == 0  # cut, not failed: it runs again on resume


def test_a_trickling_llm_stream_trips_max_tokens_mid_stream():
    server = StreamingServer()
    try:
        task = services.task_create(type="test.interruptible", params={
            "mode": "llm_stream", "url": server.url + "/v1/chat/completions", "steps": 1}, limits={"max_tokens": 10})
        task, took = run_bounded(task, within=20)  # the stream itself never ends
        assert (task.status, task.status_reason, task.paused_by_limit) == ("paused", "limit: max_tokens",
                                                                           "max_tokens")
        assert 10 <= task.tokens_used < 20  # what streamed counts; cut soon after the budget ran out
        assert Step.objects.get(task=task, step_id="step-1").status == "pending"
        wait_for(lambda: server.open_streams == 0, timeout=3, message="the stream to be closed")
    finally:
        server.stop()
