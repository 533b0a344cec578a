"""Cold recovery with several real workers: a killed worker's task continues elsewhere,
and an email in doubt waits for a reviewer — each recipient gets exactly one."""
import os
import signal
import threading

import pytest

from orchestrator.engine import processes, recovery, services
from orchestrator.models import Step, Task, TaskEvent, WalEntry
from review.models import ReviewItem
from review.services import review_decide
from tests.conftest import wait_for
from tests.support.helpers import settle, stage_processes

pytestmark = [pytest.mark.workers, pytest.mark.django_db(transaction=True)]


def test_killing_the_worker_mid_email_sends_it_to_review_and_each_recipient_gets_one(
        start_workers, smtp_server, make_user):
    # The SMTP server holds its answer to the 2nd message: the worker is killed while that
    # email is being sent (the server has it; the worker never hears back).
    in_data = threading.Event()
    release = threading.Event()
    original = smtp_server.handle_DATA

    async def slow_data(server, session, envelope):
        result = await original(server, session, envelope)
        if len(smtp_server.messages) == 2:
            in_data.set()
            while not release.is_set():
                import asyncio

                await asyncio.sleep(0.05)
        return result

    smtp_server.handle_DATA = slow_data
    start_workers(2, EMAIL_PORT=smtp_server.port)
    recipients = ["ann@example.org", "bob@example.org", "cy@example.org", "dee@example.org"]
    task = services.task_create(type="demo.notify", params={"recipients": recipients, "subject": "Invoice",
                                                            "body": "Your invoice is ready."},
                                limits={"max_subtasks": 1})
    assert in_data.wait(60), "the second email never reached the server"
    executor = Task.objects.get(pk=task.pk).worker_pid
    os.kill(executor, signal.SIGKILL)  # worker.pid from the API: a worker crash
    release.set()

    task = settle(task.pk)
    assert task.status == "awaiting_review"
    items = list(ReviewItem.objects.filter(task=task, status="open"))
    assert len(items) == 1
    item = items[0]
    assert item.wal_entry.tool == "email.send" and item.wal_entry.args["to"] == "bob@example.org"
    assert str(executor) in item.dead_worker or "died" in item.reason
    arrived = any(m["X-Idempotency-Key"] == item.wal_entry.idempotency_key for m in smtp_server.messages)
    assert arrived  # the server had it when the worker died
    review_decide(item_id=item.pk, decision="happened", note="found it in the mailbox",
                  actor=make_user("rita", "reviewer"))
    task = settle(task.pk)
    assert task.status == "completed", task.status_reason
    # Exactly one each (the task's own emails carry their key; a reviewer's notification does not).
    assert sorted(m["To"] for m in smtp_server.messages if m["X-Idempotency-Key"]) == recipients


def test_two_workers_one_is_killed_the_other_takes_over(start_workers, settings):
    settings.ORCH_STALE_AFTER_SECONDS = 1.5
    clusters = [start_workers(1), start_workers(1)]
    task = services.task_create(type="demo.pipeline", params={"stages": 3, "seconds_per_stage": 1.0})
    wait_for(lambda: Step.objects.filter(task=task, step_id="stage-01", status="done").exists(), timeout=60,
             message="stage 1 done")
    executor = Task.objects.get(pk=task.pk).worker_pid
    parent = processes._stat(executor)[0]
    holder = next(c for c in clusters if parent in c.worker_pids())
    other = next(c for c in clusters if c is not holder)
    holder.stop()  # kill -9 the whole worker host (worker, watchdog, executor)
    wait_for(lambda: recovery.stale_tasks().filter(pk=task.pk).exists(), timeout=30, message="a stale heartbeat")
    assert recovery.sweep() == [task.pk]
    assert recovery.sweep() == []  # a second sweeper finds nothing left to do
    task = settle(task.pk)
    assert task.status == "completed", task.status_reason
    assert TaskEvent.objects.filter(task=task, kind="recovery").count() == 1
    assert not processes.alive(executor)  # the old executor is gone
    assert Step.objects.get(task=task, step_id="stage-01").attempts == 1  # not redone
    # The last stage ran on the surviving worker (stage 2's intent may predate the crash).
    host = WalEntry.objects.filter(task=task).first().worker.split(":")[0]
    assert WalEntry.objects.get(task=task, step_id="stage-03").worker in {f"{host}:{p}" for p in other.worker_pids()}


def test_recovery_gives_up_after_max_attempts(start_workers, settings, tmp_path):
    settings.ORCH_MAX_RECOVERY_ATTEMPTS = 2
    start_workers(1, ORCH_FAULTS="before_checkpoint@stage-01:kill", ORCH_MAX_RECOVERY_ATTEMPTS=2)
    task = services.task_create(type="demo.pipeline", params={"stages": 2, "seconds_per_stage": 0.1})
    task = settle(task.pk)
    assert task.status == "needs_human"
    assert "recovery attempts exhausted" in task.status_reason
    assert TaskEvent.objects.filter(task=task, kind="recovery").count() == 2


def test_a_worker_shut_down_kills_its_executor_and_hands_the_task_back(start_workers):
    first = start_workers(1)
    task = services.task_create(type="demo.pipeline", params={"stages": 2, "seconds_per_stage": 30})
    wait_for(lambda: stage_processes(task.pk), timeout=60, message="a stage subprocess")
    os.killpg(first.proc.pid, signal.SIGTERM)  # a deploy stops the worker host
    wait_for(lambda: TaskEvent.objects.filter(task=task, kind="recovery").exists(), timeout=10,
             message="the task to be handed back")
    wait_for(lambda: not stage_processes(task.pk), timeout=5, message="no stage process left")
    task = Task.objects.get(pk=task.pk)
    assert task.lease_owner == "" and task.recovery_attempts == 0  # an orderly shutdown is not a crash
    assert "shut down" in TaskEvent.objects.get(task=task, kind="recovery").payload["cause"]
