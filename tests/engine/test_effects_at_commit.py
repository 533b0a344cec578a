"""Effects written with the step's checkpoint (`ctx.effect(..., at_commit=True)`, engine/at_commit.py),
on both databases: one transaction with the checkpoint (on PostgreSQL inside its one statement),
all or nothing; a refused write fails the step at its commit and the retry performs it in place;
a key an earlier execution recorded is reused, not written again."""
from datetime import timedelta

import pytest
from django.utils import timezone

from demo.models import DemoDestination
from orchestrator.engine import at_commit, checkpoint, lease as leases, services, wal
from orchestrator.engine.lease import LeaseLost
from orchestrator.engine.worker import drive_inline
from orchestrator.models import IdempotencyRecord, Step, Task, TaskEvent, WalEntry
from orchestrator.primitives.faults import InjectedFault
from orchestrator.tasktypes import get_type
from orchestrator.tools.catalog import get_tool

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.task_types("tests.support.testtypes")]
ROWS = (900_000, 900_001)


def run(**params) -> Task:
    task = services.task_create(type="test.at_commit", params=params, limits={"max_subtasks": 1})
    drive_inline(task.pk, watched=True)
    return Task.objects.get(pk=task.pk)


def test_the_effect_is_written_by_the_checkpoint_with_its_wal_entry_done_and_its_key():
    task = run()
    assert task.status == "completed"
    steps = {s.step_id: s for s in Step.objects.filter(task=task)}
    for step_id, row_id in zip(("s0", "s1"), ROWS):
        # The step got the tool's result at the call; the row was not there before the commit.
        assert steps[step_id].result == {"effect": {"table": "demo_destination", "rows": 1},
                                         "row_before_commit": False}
        assert str(DemoDestination.objects.get(pk=row_id).amount) == "2.5000"
        entry = WalEntry.objects.get(task=task, step_id=step_id)
        assert (entry.status, entry.result, entry.idempotency_key) == (
            "done", {"table": "demo_destination", "rows": 1}, f"t{task.pk}:{step_id}:0")
        assert IdempotencyRecord.objects.filter(key=entry.idempotency_key).exists()
    assert WalEntry.objects.filter(task=task).count() == 2


def test_a_step_that_raises_after_the_call_leaves_no_trace_of_the_effect():
    task = run(raise_after=True)
    assert Step.objects.get(task=task, step_id="s0").status == "failed"  # the task then waits for a human
    assert not DemoDestination.objects.filter(pk__in=ROWS).exists()
    assert not WalEntry.objects.filter(task=task).exists()


def test_a_refused_write_fails_the_step_at_its_commit_and_the_retry_performs_it_in_place():
    task = run(amount="not a number")
    assert Step.objects.get(task=task, step_id="s0").status == "failed"
    assert not DemoDestination.objects.filter(pk__in=ROWS).exists()
    failures = [e.payload["error"] for e in TaskEvent.objects.filter(task=task, kind="step_failed").order_by("seq")]
    assert len(failures) >= 2, failures
    assert "at commit was refused" in failures[0] and "nothing of it was written" in failures[0]
    # The retry called the tool in place (its own transaction, rolled back): the step saw the error.
    assert failures[0].startswith("FailedAtCommit:") and failures[1].startswith("EffectFailed:"), failures
    assert "not a number" in failures[1]
    assert not WalEntry.objects.filter(task=task, status="done").exists()


def test_a_batch_too_big_for_one_statement_is_performed_in_place():
    task = run(rows=2_501)  # 5,002 values: more than db.upsert lets ride in the commit statement
    assert task.status == "completed"
    result = Step.objects.get(task=task, step_id="s0").result
    assert result == {"effect": {"table": "demo_destination", "rows": 2_501}, "row_before_commit": True}
    assert DemoDestination.objects.filter(pk__gte=900_000, pk__lt=900_000 + 10 * 2_501).count() == 2 * 2_501
    assert list(WalEntry.objects.filter(task=task).values_list("status", flat=True)) == ["done", "done"]


def _claimed(task_type: str = "test.at_commit"):
    task = services.task_create(type=task_type, params={}, limits={"max_subtasks": 1})
    lease = leases.claim(task.pk)
    step_type = get_type(task.type)
    plan = checkpoint.ensure_plan(lease=lease, task_type=step_type, params=step_type.Params.model_validate(task.params))
    return task, lease, plan


def _pending(lease, amount="3.0000"):
    pending = []
    deferred, result = at_commit.defer(lease=lease, step_id="s0", call_index=0, tool_name="db.upsert",
                                       args={"table": "demo_destination", "columns": ["id", "amount"],
                                             "rows": [[ROWS[0], amount]]}, generation=0, pending=pending)
    assert deferred and result == {"table": "demo_destination", "rows": 1}
    return pending


def test_a_commit_whose_lease_went_writes_nothing_of_the_effect():
    task, lease, plan = _claimed()
    pending = _pending(lease)
    # Another worker took the task over: the epoch moved on.
    Task.objects.filter(pk=task.pk).update(lease_epoch=lease.epoch + 1)
    with pytest.raises(LeaseLost):
        checkpoint.commit_step(lease=lease, plan=plan, step_id="s0", result={}, reads=[], effects=[],
                               started_at=timezone.now() - timedelta(seconds=1), at_commit=pending)
    assert not DemoDestination.objects.filter(pk=ROWS[0]).exists()
    assert not WalEntry.objects.filter(task=task).exists()


def test_a_crash_inside_the_checkpoint_rolls_the_effect_back_and_the_next_commit_writes_it_once(monkeypatch):
    task, lease, plan = _claimed()
    pending = _pending(lease)
    started = timezone.now() - timedelta(seconds=1)
    monkeypatch.setenv("ORCH_FAULTS", "mid_checkpoint:raise")  # the checkpoint's transaction dies midway
    with pytest.raises(InjectedFault):
        checkpoint.commit_step(lease=lease, plan=plan, step_id="s0", result={}, reads=[], effects=[],
                               started_at=started, at_commit=pending)
    assert not DemoDestination.objects.filter(pk=ROWS[0]).exists()
    assert not WalEntry.objects.filter(task=task).exists()
    monkeypatch.delenv("ORCH_FAULTS")
    checkpoint.commit_step(lease=lease, plan=plan, step_id="s0", result={}, reads=[], effects=[],
                           started_at=started, at_commit=pending)
    assert str(DemoDestination.objects.get(pk=ROWS[0]).amount) == "3.0000"
    assert list(WalEntry.objects.filter(task=task).values_list("status", flat=True)) == ["done"]


def test_a_key_an_earlier_execution_recorded_is_reused_not_written_again():
    """An earlier execution performed the effect in place and died before its checkpoint: its
    record stands; the step runs again and gets the recorded result, writing nothing."""
    task = services.task_create(type="test.at_commit", params={}, limits={"max_subtasks": 1})
    lease = leases.claim(task.pk)
    tool = get_tool("db.upsert")
    earlier = {"table": "demo_destination", "rows": 1, "recorded": "by the earlier execution"}
    wal._record_done(lease, None, step_id="s0", call_index=0, tool=tool,
                     args={"table": "demo_destination", "columns": ["id", "amount"], "rows": [[ROWS[0], "1.0"]]},
                     key=f"t{task.pk}:s0:0", result=earlier)
    Task.objects.filter(pk=task.pk).update(lease_owner="")  # that worker is gone
    drive_inline(task.pk, watched=True)
    task.refresh_from_db()
    assert task.status == "completed"
    assert Step.objects.get(task=task, step_id="s0").result["effect"] == earlier
    assert not DemoDestination.objects.filter(pk=ROWS[0]).exists()  # the earlier one wrote none here
    assert str(DemoDestination.objects.get(pk=ROWS[1]).amount) == "2.5000"  # s1 at commit, as usual
    assert not TaskEvent.objects.filter(task=task, kind="step_failed").exists()  # not a failure


def test_a_tool_that_cannot_run_at_commit_is_refused_at_the_call():
    task, lease, plan = _claimed()
    with pytest.raises(Exception, match="cannot be performed at the step's commit"):
        at_commit.defer(lease=lease, step_id="s0", call_index=0, tool_name="email.send",
                        args={"to": ["a@example.org"], "subject": "s", "body": "b"}, generation=0, pending=[])
