"""The durable protocol with real django-q2 worker processes and real crashes."""
import subprocess

import pytest
from django.db.models import F
from django.utils import timezone

from orchestrator.engine import recovery, services
from orchestrator.models import DemoDestination, DemoSource, Snapshot, Step, Task, TaskEvent, WalEntry
from tests.conftest import wait_for

pytestmark = [pytest.mark.workers, pytest.mark.django_db(transaction=True)]


def status_of(task_id: int) -> str:
    return Task.objects.values_list("status", flat=True).get(pk=task_id)


def wait_status(task_id: int, *statuses: str, timeout: float = 60) -> Task:
    wait_for(lambda: status_of(task_id) in statuses, timeout=timeout,
             message=f"task {task_id} to reach {statuses} (now {status_of(task_id)})")
    return Task.objects.get(pk=task_id)


def test_a_migration_runs_to_completion_on_real_workers(start_workers):
    start_workers()
    task = services.task_create(type="demo.migrate_rows", params={"rows": 5000, "batch_size": 500, "rate": 2.0})
    task = wait_status(task.pk, "completed", "failed")
    assert task.status == "completed", task.error
    assert DemoDestination.objects.count() == 5000
    source_total = sum(DemoSource.objects.filter(id__lte=5000).values_list("amount", flat=True))
    assert sum(DemoDestination.objects.values_list("amount", flat=True)) == 2 * source_total
    assert task.worker_pid and task.worker_host


def test_a_crash_inside_the_checkpoint_commits_none_of_it(start_workers, settings):
    settings.ORCH_STALE_AFTER_SECONDS = 1.5
    crashing = start_workers(1, ORCH_FAULTS="mid_checkpoint@batch-0002:kill", ORCH_DEFAULT_MAX_SUBTASKS=1)
    task = services.task_create(type="demo.migrate_rows", params={"rows": 400, "batch_size": 100, "rate": 3.0},
                                limits={"max_subtasks": 1})
    # batch-0001 commits; the worker dies inside batch-0002's checkpoint transaction.
    wait_for(lambda: Step.objects.filter(task=task, step_id="batch-0001", status="done").exists(), timeout=60,
             message="batch-0001 to commit")
    wait_for(lambda: recovery.stale_tasks().filter(pk=task.pk).exists(), timeout=30,
             message="the worker to die and its heartbeat to go stale")
    # The step's result, state, snapshot and event were in one transaction: none is there.
    assert Step.objects.get(task=task, step_id="batch-0002").status == "pending"
    assert Step.objects.get(task=task, step_id="batch-0002").result is None
    assert not Snapshot.objects.filter(task=task, step_id="batch-0002").exists()
    assert not TaskEvent.objects.filter(task=task, kind="step_done", payload__step="batch-0002").exists()
    # The effect happened before the crash and its WAL entry is pending: it replays (idempotent).
    assert WalEntry.objects.get(task=task, step_id="batch-0002").status == "pending"
    crashing.stop()

    start_workers(1)
    assert recovery.sweep() == [task.pk]
    task = wait_status(task.pk, "completed", "failed", "needs_human")
    assert task.status == "completed", task.status_reason
    assert DemoDestination.objects.filter(id__lte=400).count() == 400
    assert TaskEvent.objects.filter(task=task, kind="step_done", payload__step="batch-0002").count() == 1
    assert list(TaskEvent.objects.filter(task=task).values_list("seq", flat=True)) == list(range(1, task.event_seq + 1))
    assert WalEntry.objects.get(task=task, step_id="batch-0002").status == "done"


def test_an_exception_between_effect_and_done_leaves_the_entry_pending(start_workers, smtp_server):
    start_workers(1, ORCH_FAULTS="after_effect@send-002:raise", EMAIL_PORT=smtp_server.port)
    recipients = ["ann@example.org", "bob@example.org", "cy@example.org"]
    task = services.task_create(type="demo.notify", params={"recipients": recipients, "subject": "Hello",
                                                            "body": "Quarterly report attached."})
    task = wait_status(task.pk, "awaiting_review", "completed", "failed")
    # The email went out, but the worker never learned it: the system must not guess.
    assert task.status == "awaiting_review"
    entries = {e.step_id: e for e in WalEntry.objects.filter(task=task)}
    assert entries["send-002"].status == "pending"
    assert entries["send-001"].status == "done" and entries["send-003"].status == "done"
    received = sorted(m["To"] for m in smtp_server.messages)
    assert received == recipients  # one each, send-002 not retried blindly
    assert entries["send-002"].idempotency_key in {m["X-Idempotency-Key"] for m in smtp_server.messages}


def stage_processes(task_id: int) -> list[str]:
    out = subprocess.run(["pgrep", "-af", f"task-{task_id}/stage-"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "pgrep" not in line]


def test_a_worker_whose_lease_was_taken_over_stops_and_commits_nothing(start_workers):
    cluster = start_workers(1)
    task = services.task_create(type="demo.pipeline", params={"stages": 2, "seconds_per_stage": 30})
    wait_for(lambda: WalEntry.objects.filter(task=task, step_id="stage-01").exists() and stage_processes(task.pk),
             timeout=60, message="stage 1 to start its subprocess")
    version = Task.objects.get(pk=task.pk).checkpoint_version
    # Another worker takes the task over (what the sweeper + a new claim do).
    Task.objects.filter(pk=task.pk).update(lease_epoch=F("lease_epoch") + 1, lease_owner="other-worker:1",
                                           heartbeat_at=timezone.now())
    wait_for(lambda: not stage_processes(task.pk), timeout=10, message="the stage subprocess to be killed")
    wait_for(lambda: "lease lost" in cluster.output(), timeout=10, message="the worker to notice")
    task.refresh_from_db()
    assert task.checkpoint_version == version
    assert task.lease_owner == "other-worker:1"
    assert Step.objects.get(task=task, step_id="stage-01").status == "pending"
    assert not TaskEvent.objects.filter(task=task, kind="step_done").exists()
