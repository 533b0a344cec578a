"""Preemption and the task stack, in-process (real database): an urgent subtask runs
first, the suspended work continues where it was, nothing done twice."""
import pytest

from orchestrator.engine import inbox, services, snapshots
from orchestrator.engine.inbox import InboxRefused
from orchestrator.engine.worker import drive_inline
from orchestrator.models import InboundEvent, Step, Task
from demo.models import DemoContractExtraction
from tests.support import helpers
from tests.support.helpers import done_order

pytestmark = pytest.mark.django_db(transaction=True)

REPARSE_5 = {"subtask": "reparse", "args": {"contract": 5, "extractor": "strict"},
             "reason": "re-parse contract #5 first with the strict extractor"}


@pytest.fixture
def preempt_during(monkeypatch):
    return helpers.preempt_during(monkeypatch, "demo.contracts")


def test_the_batch_preempted_after_8_reparses_5_first_then_continues_and_the_summary_uses_it(preempt_during,
                                                                                            settings):
    settings.ORCH_SNAPSHOT_KEEP = 100  # every version of the run stays readable
    sent = preempt_during("contract-09", REPARSE_5)  # 8 done, the 9th running
    task = services.task_create(type="demo.contracts", params={"count": 20, "pace_seconds": 0.2},
                                limits={"max_subtasks": 1})
    assert drive_inline(task.pk) == "completed"
    task = Task.objects.get(pk=task.pk)
    event = InboundEvent.objects.get(pk=sent[0].event.pk)
    reparse = f"reparse-05-strict-e{event.seq}"
    order = done_order(task.pk)
    contracts = [f"contract-{i:02d}" for i in range(1, 21)]
    # 1-8, then the re-parse (contract 9 was interrupted while it paced), then 9-20, then the summary.
    assert order == contracts[:8] + [reparse] + contracts[8:] + ["summary"]
    assert event.state == "consumed" and event.outcome.startswith("pushed frame 1: subtask reparse runs first")
    # The frame that was pushed, as the snapshot of its version holds it.
    pushed = snapshots.materialize(task.pk, event.consumed_in_version)
    [frame] = pushed["stack"]
    assert frame["steps"] == [reparse] and frame["cursor"] == "contract-09"
    assert frame["todo"][:2] == ["contract-09", "contract-10"] and frame["todo_count"] == 13  # 9-20 + summary
    assert frame["interrupted"] == ["contract-09"] and frame["finished_count"] == 8
    assert "table demo_contract_extraction" in " ".join(frame["references"]["resources"])
    # Popped, with an internal subtask.done event; the stack is empty at the end.
    done = InboundEvent.objects.get(task=task, type="subtask.done")
    assert (done.priority, done.source, done.state) == (3, "internal", "consumed")
    assert done.payload == {"subtask": "reparse", "event": event.seq, "steps": {reparse: "done"}}
    assert task.stack == [] and snapshots.materialize(task.pk, task.checkpoint_version)["stack"] == []
    # Nothing done twice; the summary uses the strict re-parse of contract 5.
    assert Step.objects.get(task=task, step_id="contract-09").attempts == 1
    summary = Step.objects.get(task=task, step_id="summary")
    assert reparse in summary.depends_on
    assert summary.result["reparsed"] == {"contract_05.txt": "strict"}
    assert summary.result["ambiguous"] == [{"contract": "contract_05.txt",
                                            "items": ["date 10/01/2024: day and month order unknown"]}]
    # The contract's row is the strict one (written last; "10/01/2024" was not read either way).
    strict = Step.objects.get(task=task, step_id=reparse).result
    assert strict["extractor"] == "strict" and strict["dates"] == ["2024-10-01", "2025-09-30"]  # month names
    assert DemoContractExtraction.objects.get(contract="contract_05.txt").dates == strict["dates"]


def test_a_preempt_is_refused_when_the_type_has_no_such_subtask_or_the_stack_is_full():
    task = services.task_create(type="demo.contracts", params={"count": 3})
    with pytest.raises(InboxRefused) as refused:
        inbox.send(task_id=task.pk, type="preempt", payload={"subtask": "rewrite"})
    assert refused.value.status == 422 and "has no subtask 'rewrite'; it has: reparse" in str(refused.value)
    other = services.task_create(type="demo.migrate_rows", params={"rows": 10, "batch_size": 10})
    with pytest.raises(InboxRefused) as refused:
        inbox.send(task_id=other.pk, type="preempt", payload={"subtask": "reparse"})
    assert refused.value.status == 422 and "does not take 'preempt'" in str(refused.value)
    Task.objects.filter(pk=task.pk).update(stack=[{"steps": []}] * 4)
    with pytest.raises(InboxRefused) as refused:
        inbox.send(task_id=task.pk, type="preempt", payload=REPARSE_5)
    assert refused.value.status == 409 and "stack is 4 deep" in str(refused.value)


def test_a_preempt_with_args_that_do_not_fit_is_rejected_with_its_reason_and_the_batch_runs_on():
    task = services.task_create(type="demo.contracts", params={"count": 3})
    sent = inbox.send(task_id=task.pk, type="preempt", payload={"subtask": "reparse", "args": {"contract": 9}})
    assert drive_inline(task.pk) == "completed"
    event = InboundEvent.objects.get(pk=sent.event.pk)
    assert event.state == "rejected"
    assert event.outcome == "rejected: args.contract must be a contract number from 1 to 3, got 9"
    assert Task.objects.get(pk=task.pk).stack == []


def test_a_preempt_sent_to_a_queued_task_runs_its_subtask_before_anything_else():
    task = services.task_create(type="demo.contracts", params={"count": 3})
    sent = inbox.send(task_id=task.pk, type="preempt", payload=REPARSE_5 | {"args": {"contract": 2}})
    assert drive_inline(task.pk) == "completed"
    reparse = f"reparse-02-strict-e{sent.event.seq}"
    assert done_order(task.pk)[0] == reparse and done_order(task.pk)[-1] == "summary"
    frame = snapshots.materialize(task.pk, InboundEvent.objects.get(pk=sent.event.pk).consumed_in_version)["stack"][0]
    assert frame["todo"] == ["contract-01", "contract-02", "contract-03", "summary"] and frame["interrupted"] == []
