"""The durable protocol with real django-q2 worker processes and real crashes."""
import pytest
from django.db.models import F
from django.utils import timezone

from orchestrator.engine import processes, recovery, services
from orchestrator.models import Snapshot, Step, Task, TaskEvent, WalEntry
from demo.models import DemoDestination, DemoSource
from tests.conftest import wait_for
from tests.support.helpers import stage_processes

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


def test_a_crash_inside_the_checkpoint_commits_none_of_it(start_workers, tmp_path):
    # The executor is SIGKILLed inside batch-0002's checkpoint transaction (once); its
    # worker sees it die and hands the task to recovery, which continues from batch-0001.
    start_workers(1, ORCH_FAULTS="mid_checkpoint@batch-0002:kill-once", ORCH_VAR_DIR=tmp_path)
    task = services.task_create(type="demo.migrate_rows", params={"rows": 400, "batch_size": 100, "rate": 3.0},
                                limits={"max_subtasks": 1})
    task = wait_status(task.pk, "completed", "failed", "needs_human")
    assert task.status == "completed", task.status_reason
    assert (tmp_path / "faults" / "mid_checkpoint@batch-0002").exists()  # the crash happened
    events = list(TaskEvent.objects.filter(task=task).order_by("seq"))
    assert [e.seq for e in events] == list(range(1, task.event_seq + 1))
    recovery = [e for e in events if e.kind == "recovery"]
    assert len(recovery) == 1 and "died" in recovery[0].payload["cause"]
    batch2 = [e for e in events if e.kind == "step_done" and e.payload["step"] == "batch-0002"]
    # Nothing of the crashed checkpoint survived: one step_done, after the recovery,
    # one snapshot, and the step committed once.
    assert len(batch2) == 1 and batch2[0].seq > recovery[0].seq
    assert Snapshot.objects.filter(task=task, step_id="batch-0002").count() == 1
    assert Step.objects.get(task=task, step_id="batch-0002").attempts == 1
    assert task.recovery_attempts == 1
    # The upsert happened before the crash; its WAL entry was pending and is replayed.
    assert WalEntry.objects.get(task=task, step_id="batch-0002").status == "done"
    assert DemoDestination.objects.filter(id__lte=400).count() == 400
    source = dict(DemoSource.objects.filter(id__lte=400).values_list("id", "amount"))
    assert all(amount == source[i] * 3 for i, amount in DemoDestination.objects.values_list("id", "amount"))


def test_a_dead_worker_is_found_by_the_sweeper_and_another_worker_continues(start_workers, settings):
    settings.ORCH_STALE_AFTER_SECONDS = 1.5
    first = start_workers(1)
    task = services.task_create(type="demo.pipeline", params={"stages": 3, "seconds_per_stage": 1.0})
    wait_for(lambda: Step.objects.filter(task=task, step_id="stage-01", status="done").exists(), timeout=60,
             message="stage 1 to finish")
    first.stop()  # the whole worker host dies: cluster, worker, executor (kill -9)
    wait_for(lambda: not stage_processes(task.pk), timeout=10, message="no stage process left")
    wait_for(lambda: recovery.stale_tasks().filter(pk=task.pk).exists(), timeout=30, message="a stale heartbeat")
    start_workers(1)
    assert recovery.sweep() == [task.pk]
    task = wait_status(task.pk, "completed", "failed", "needs_human")
    assert task.status == "completed", task.status_reason
    assert Step.objects.get(task=task, step_id="stage-01").attempts == 1  # not re-run
    assert task.recovery_attempts == 1


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


def test_a_worker_whose_lease_was_taken_over_stops_and_commits_nothing(start_workers):
    start_workers(1)
    task = services.task_create(type="demo.pipeline", params={"stages": 2, "seconds_per_stage": 30})
    wait_for(lambda: WalEntry.objects.filter(task=task, step_id="stage-01").exists() and stage_processes(task.pk),
             timeout=60, message="stage 1 to start its subprocess")
    before = Task.objects.get(pk=task.pk)
    version, executor = before.checkpoint_version, before.worker_pid
    # Another worker takes the task over (what the sweeper + a new claim do).
    Task.objects.filter(pk=task.pk).update(lease_epoch=F("lease_epoch") + 1, lease_owner="other-worker:1",
                                           heartbeat_at=timezone.now())
    wait_for(lambda: not stage_processes(task.pk), timeout=10, message="the stage subprocess to be killed")
    wait_for(lambda: not processes.alive(executor), timeout=10, message="the fenced executor to be gone")
    task.refresh_from_db()
    assert task.checkpoint_version == version
    assert task.lease_owner == "other-worker:1"
    assert Step.objects.get(task=task, step_id="stage-01").status == "pending"
    assert not TaskEvent.objects.filter(task=task, kind="step_done").exists()
