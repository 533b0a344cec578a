"""The runner in-process: plan, checkpoints, WAL, fencing (real database, no mocks)."""
from datetime import timedelta

import pytest
from django.db.models import F
from django.utils import timezone

from orchestrator.engine import checkpoint, lease as leases, services
from orchestrator.engine.lease import LeaseLost
from orchestrator.engine.worker import drive_inline
from orchestrator.models import Snapshot, Step, Task, TaskEvent, WalEntry
from demo.models import DemoDestination, DemoSource
from orchestrator.tasktypes import get_type
from tests.support.helpers import write_intent

pytestmark = pytest.mark.django_db(transaction=True)


def run_to_end(task_id: int) -> Task:
    outcome = drive_inline(task_id)
    assert outcome != "not claimed"
    return Task.objects.get(pk=task_id)


def test_migration_copies_every_row_scaled_by_rate():
    task = services.task_create(type="demo.migrate_rows", params={"rows": 1200, "batch_size": 250, "rate": 2.0})
    task = run_to_end(task.pk)
    assert task.status == "completed"
    assert (task.steps_done, task.steps_total) == (6, 6)  # prepare + 5 batches
    assert DemoDestination.objects.count() == 1200
    source = DemoSource.objects.filter(id__lte=1200)
    pairs = dict(source.values_list("id", "amount"))
    for row_id, amount in DemoDestination.objects.values_list("id", "amount"):
        assert amount == pairs[row_id] * 2
    assert sum(DemoDestination.objects.values_list("amount", flat=True)) == 2 * sum(pairs.values())


def test_each_step_commits_result_snapshot_and_event_with_consecutive_seq():
    task = services.task_create(type="demo.migrate_rows", params={"rows": 300, "batch_size": 100, "rate": 1.5})
    task = run_to_end(task.pk)
    steps = list(Step.objects.filter(task=task).order_by("position"))
    assert all(s.status == "done" and s.result is not None and s.finished_at for s in steps)
    # planned = v1, then one version per step
    assert task.checkpoint_version == 1 + len(steps)
    versions = sorted(Snapshot.objects.filter(task=task).values_list("version", flat=True))
    assert versions == list(range(1, task.checkpoint_version + 1))
    last = Snapshot.objects.get(task=task, version=task.checkpoint_version)
    assert set(last.state["steps"].values()) == {"done"}
    seqs = list(TaskEvent.objects.filter(task=task).values_list("seq", flat=True))
    assert seqs == list(range(1, task.event_seq + 1))
    assert TaskEvent.objects.filter(task=task, kind="step_done").count() == len(steps)
    # recorded reads: batches read rate, prepare-source does not
    assert "rate" in Step.objects.get(task=task, step_id="batch-0001").reads
    assert Step.objects.get(task=task, step_id="prepare-source").reads == ["rows"]


def test_side_effects_are_logged_done_with_deterministic_keys():
    task = services.task_create(type="demo.migrate_rows", params={"rows": 200, "batch_size": 100, "rate": 1.0})
    run_to_end(task.pk)
    keys = list(WalEntry.objects.filter(task=task, step_id__startswith="batch").order_by("step_id")
                .values_list("idempotency_key", "status", "idempotent"))
    assert keys == [(f"t{task.pk}:batch-0001:0", "done", True), (f"t{task.pk}:batch-0002:0", "done", True)]


def test_snapshots_are_pruned_to_the_configured_count(settings):
    settings.ORCH_SNAPSHOT_KEEP = 3
    task = services.task_create(type="demo.migrate_rows", params={"rows": 500, "batch_size": 50, "rate": 1.0})
    task = run_to_end(task.pk)
    versions = sorted(Snapshot.objects.filter(task=task).values_list("version", flat=True))
    assert versions == [task.checkpoint_version - 2, task.checkpoint_version - 1, task.checkpoint_version]


def test_a_stale_lease_epoch_cannot_commit_a_step():
    task = services.task_create(type="demo.migrate_rows", params={"rows": 100, "batch_size": 50, "rate": 1.0})
    old = leases.claim(task.pk)
    task_type = get_type("demo.migrate_rows")
    params = task_type.Params.model_validate(task.params)
    plan = checkpoint.ensure_plan(lease=old, task_type=task_type, params=params)
    # The old holder goes quiet; another worker takes the task over (epoch + 1).
    Task.objects.filter(pk=task.pk).update(heartbeat_at=F("heartbeat_at") - timedelta(hours=1))
    new = leases.claim(task.pk)
    assert new is not None and new.epoch == old.epoch + 1
    before = Task.objects.values("checkpoint_version", "event_seq").get(pk=task.pk)
    with pytest.raises(LeaseLost):
        checkpoint.commit_step(lease=old, plan=plan, step_id="prepare-source", result={"x": 1}, reads=[],
                               effects=[], started_at=timezone.now())
    assert Task.objects.values("checkpoint_version", "event_seq").get(pk=task.pk) == before
    assert Step.objects.get(task=task, step_id="prepare-source").status == "pending"
    assert plan.status["prepare-source"] == "pending"
    # and the old holder cannot even write a WAL intent
    with pytest.raises(LeaseLost):
        write_intent(lease=old, step_id="batch-0001", call_index=0, tool_name="db.upsert", args={},
                     key="k-stale", idempotent=True)
    assert not WalEntry.objects.filter(idempotency_key="k-stale").exists()


def test_a_second_claim_of_a_live_lease_is_refused():
    task = services.task_create(type="demo.migrate_rows", params={"rows": 10, "batch_size": 5, "rate": 1.0})
    assert leases.claim(task.pk) is not None
    assert leases.claim(task.pk) is None
    assert drive_inline(task.pk) == "not claimed"


@pytest.mark.parametrize("watched", [False, True])
def test_a_run_as_an_isolated_executor_runs_lone_steps_on_its_thread(watched, settings, monkeypatch):
    """watched=True (an isolated executor): a step that runs alone runs on the runner's
    thread, a fan-out still runs in the pool; both give the same results."""
    import threading

    from tests.support.testtypes import Growing

    settings.ORCH_EXTRA_TASK_TYPES = ["tests.support.testtypes"]
    threads = {}
    original = Growing.run_step

    def recording(self, ctx, step_id):
        threads[step_id] = threading.current_thread().name
        return original(self, ctx, step_id)

    monkeypatch.setattr(Growing, "run_step", recording)
    task = services.task_create(type="test.growing", params={"items": 3}, limits={"max_subtasks": 4})
    assert drive_inline(task.pk, watched=watched) == "completed"
    runner_thread = threading.current_thread().name
    assert (threads["discover"] == runner_thread) is watched  # alone: nothing else was ready
    assert all(threads[f"item-{i}"] != runner_thread for i in range(3))  # three at once: the pool
    assert Step.objects.get(task=task, step_id="collect").result == 0 + 1 + 2


def test_the_heartbeat_tells_which_steps_run_and_the_end_of_the_run_clears_it(settings):
    """Running steps reach the task page through the heartbeat (no commit per step)."""
    import threading

    from tests.conftest import wait_for

    settings.ORCH_EXTRA_TASK_TYPES = ["tests.support.testtypes"]
    settings.ORCH_HEARTBEAT_SECONDS = 0.1
    task = services.task_create(type="test.interruptible", params={"mode": "sleep", "steps": 1, "seconds": 1.5})
    runner = threading.Thread(target=drive_inline, args=(task.pk,))
    runner.start()
    try:
        wait_for(lambda: any(a["kind"] == "step" and a["label"] == "step-1"
                             for a in Task.objects.get(pk=task.pk).activities), timeout=10,
                 message="the heartbeat to report step-1 running")
    finally:
        runner.join(timeout=30)
    task = Task.objects.get(pk=task.pk)
    assert task.status == "completed" and task.activities == []
