"""The agent's own holes (issue 20, item 7), in-process against the stand-in model: a history
repaired from the durable record exactly as AGENT.md's table says, dialog rows fenced by the
lease, Skip step on a tool call, and a token budget that counts the prompt and every attempt."""
import json
from datetime import timedelta

import pytest

from django.utils import timezone

from orchestrator.agent import history
from orchestrator.engine import lease as leases, reviews, services, wal
from orchestrator.engine.context import StepContext
from orchestrator.engine.worker import drive_inline
from orchestrator.llm.client import estimate_prompt_tokens
from orchestrator.models import AgentMessage, Step, Task, WalEntry
from orchestrator.primitives.cancellation import CancellationToken
from orchestrator.tasktypes.agent import AgentParams, PlanExecuteAgent
from review.models import ReviewItem
from review.services import review_decide

from .test_agent import EMAILS, GOAL, agent, assert_every_tool_call_answered

pytestmark = pytest.mark.django_db(transaction=True)

EMAIL_ARGS = {"to": ["ops@example.org"], "subject": "Summary of 5 contracts", "body": "totals"}


def dialog_with_one_call(task: Task, name: str, arguments: str = "{}") -> None:
    """Turn 1 answered with one call (step tool-001-1) that has no tool message yet."""
    AgentMessage.objects.create(task=task, key="system:g0", turn=0, order=0, role="system", content="s")
    AgentMessage.objects.create(task=task, key="goal:g0", turn=0, order=1, role="user", content="g")
    AgentMessage.objects.create(task=task, key="turn-001:g0", turn=1, order=0, role="assistant", content="",
                                tool_calls=[{"id": "call_a", "name": name, "arguments": arguments,
                                             "step": "tool-001-1"}])


def step_context(task: Task, step_id: str, lease, deps=None) -> StepContext:
    params = AgentParams.model_validate(task.params)
    return StepContext(task_id=task.pk, step_id=step_id, params=params, deps=deps or {}, lease=lease,
                       token=CancellationToken())


def run_tool_step_and_commit_its_rows(ctx: StepContext) -> None:
    """A tool call's step, then what its checkpoint writes of the rows it kept for it
    (ctx.write_at_commit), fenced on its lease as the checkpoint is (engine/checkpoint.py)."""
    from django.db import transaction

    from orchestrator.engine import rows_at_commit

    PlanExecuteAgent().run_step(ctx, ctx.step_id)
    with transaction.atomic():
        leases.hold_fenced(ctx.lease)
        rows_at_commit.write_in_transaction(ctx.rows_at_commit)


def pending_email_intent(task: Task) -> WalEntry:
    return WalEntry.objects.create(task=task, step_id="tool-001-1", call_index=0, tool="email.send", args=EMAIL_ARGS,
                                   idempotency_key=wal.idempotency_key(task.pk, "tool-001-1", 0), idempotent=False,
                                   lease_epoch=1, worker="dead-host:1:abc")


# --- history repair ----------------------------------------------------------------------

def test_a_read_only_call_that_ran_is_told_its_result_not_not_executed(model):
    task = agent()
    dialog_with_one_call(task, "contracts_list")
    # Reads have no WAL row: their step's recorded result is the durable record.
    Step.objects.create(task=task, step_id="tool-001-1", position=2, status="done",
                        result={"tool_call_id": "call_a", "name": "contracts_list", "ok": True,
                                "result": [{"contract": 1, "file": "c1.txt"}]})
    answer = history.messages_for_turn(task.pk, 2)[-1]
    assert (answer["role"], answer["tool_call_id"]) == ("tool", "call_a")
    assert json.loads(answer["content"]) == [{"contract": 1, "file": "c1.txt"}]  # (PostgreSQL reorders keys)


def test_a_call_with_no_trace_is_not_executed_and_one_superseded_says_so(model):
    task = agent()
    dialog_with_one_call(task, "contracts_list")
    assert history.messages_for_turn(task.pk, 2)[-1]["content"] == history.NOT_EXECUTED
    AgentMessage.objects.create(task=task, key="user:1", turn=1, order=history.USER_ORDER + 1, role="user",
                                content="stop reading")
    messages = history.messages_for_turn(task.pk, 2)
    assert [m["role"] for m in messages[-2:]] == ["tool", "user"]
    assert messages[-2]["content"] == "skipped: superseded by a new user message"


@pytest.mark.parametrize("decision, told", [("happened", "happened: "),
                                            ("skip", "skipped by reviewer: the customer was called instead")])
def test_an_ambiguous_intent_goes_to_review_first_and_the_model_is_told_the_decision(model, decision, told):
    task = agent()
    dialog_with_one_call(task, "email_send", '{"to": ["ops@example.org"]}')
    entry = pending_email_intent(task)
    # Never "not executed": whether the email went out is unknown.
    with pytest.raises(history.Unsettled):
        history.messages_for_turn(task.pk, 2)
    # The turn that would tell the model puts the intent before a reviewer instead (no model call).
    lease = leases.claim(task.pk)
    seen = len(model.requests)
    with pytest.raises(wal.AmbiguousEffect) as ambiguous:
        PlanExecuteAgent().run_step(step_context(task, "turn-002", lease), "turn-002")
    assert ambiguous.value.entry.pk == entry.pk and len(model.requests) == seen
    reviews.effect_open(entry=entry, reason=ambiguous.value.reason)
    [item] = ReviewItem.objects.filter(task=task)
    review_decide(item_id=item.pk, decision=decision, note="the customer was called instead")
    answer = history.messages_for_turn(task.pk, 2)[-1]
    assert answer["tool_call_id"] == "call_a" and answer["content"].startswith(told)
    if decision == "happened":
        entry.refresh_from_db()  # the result the decision recorded is what the model reads
        assert answer["content"] == "happened: " + json.dumps(entry.result) and entry.result["confirmed_by_reviewer"]


def test_an_intent_a_reviewer_found_not_happened_is_performed_again_with_its_key(model, smtp):
    task = agent()
    dialog_with_one_call(task, "email_send", '{"to": ["ops@example.org"], "subject": "Summary of 5 contracts", '
                                             '"body": "totals"}')
    entry = pending_email_intent(task)
    reviews.effect_open(entry=entry, reason="the worker died during the send")
    review_decide(item_id=ReviewItem.objects.get(task=task).pk, decision="not_happened", note="not in the mailbox")
    ctx = step_context(task, "turn-002", leases.claim(task.pk))
    messages = PlanExecuteAgent()._history(ctx, 2)
    [mail] = smtp.received
    assert mail["X-Idempotency-Key"] == entry.idempotency_key  # the same key: never a second, different email
    assert messages[-1]["content"].startswith("did not happen, re-executed: ")
    assert [e.entry_id for e in ctx.completed_effects] == [entry.pk]  # its `done` commits with the turn


# --- the dialog is fenced by the lease ---------------------------------------------------

def test_a_runner_whose_lease_was_taken_cannot_write_or_overwrite_a_dialog_row(model, monkeypatch):
    from orchestrator.agent import toolbox

    task = agent()
    old = leases.claim(task.pk)
    # The old holder went quiet; another worker takes the task with a new epoch.
    Task.objects.filter(pk=task.pk).update(heartbeat_at=timezone.now() - timedelta(days=1))
    new = leases.claim(task.pk)
    assert new is not None and new.epoch > old.epoch
    deps = {"turn-001": {"content": "", "tool_calls": [{"id": "call_a", "name": "contracts_list",
                                                        "arguments": "{}", "step": "tool-001-1"}]}}
    run_tool_step_and_commit_its_rows(step_context(task, "tool-001-1", new, deps))
    [row] = AgentMessage.objects.filter(task=task)
    written = (row.pk, row.content)
    # The zombie runs the same call (its own view of the result) and its turn 1 again: the tool
    # call's row is written with the step's checkpoint, whose fence refuses the zombie.
    monkeypatch.setattr(toolbox, "call", lambda ctx, name, arguments, allowed: (True, "the zombie's view"))
    with pytest.raises(leases.LeaseLost):
        run_tool_step_and_commit_its_rows(step_context(task, "tool-001-1", old, deps))
    seen = len(model.requests)
    with pytest.raises(leases.LeaseLost):
        PlanExecuteAgent().run_step(step_context(task, "turn-001", old), "turn-001")
    [row] = AgentMessage.objects.filter(task=task)
    assert (row.pk, row.content) == written and len(model.requests) == seen


# --- Skip step on a tool call --------------------------------------------------------------

def test_skip_step_on_a_tool_call_tells_the_model_the_operators_reason_and_the_agent_goes_on(model, smtp,
                                                                                         monkeypatch):
    from orchestrator.agent import toolbox

    real_call = toolbox.call

    def call(ctx, name, arguments, allowed):
        if name == "contracts_read" and json.loads(arguments).get("contract") == 2:
            raise RuntimeError("the contracts share is not mounted")
        return real_call(ctx, name, arguments, allowed)

    monkeypatch.setattr(toolbox, "call", call)
    task = agent()
    assert drive_inline(task.pk) == "needs_human"
    failed = Step.objects.get(task=task, status="failed")
    assert failed.step_id.startswith("tool-")
    services.task_skip_step(task_id=task.pk, step_id=failed.step_id, reason="contract 2 is archived")
    assert drive_inline(task.pk) == "completed"
    turn = Step.objects.get(task=task, step_id=f"turn-{failed.step_id.split('-')[1]}").result
    [call_id] = [c["id"] for c in turn["tool_calls"] if c["step"] == failed.step_id]
    told = [m for r in model.requests for m in r.body["messages"]
            if m["role"] == "tool" and m["tool_call_id"] == call_id]
    assert told and told[-1]["content"] == "skipped by an operator: contract 2 is archived"
    for request in model.requests:
        assert_every_tool_call_answered(request.body["messages"])
    final = AgentMessage.objects.filter(task=task, role="assistant", interrupted=False).order_by("-turn").first()
    assert not final.tool_calls and final.content  # the model went on to its answer
    assert len(smtp.received) == 1


# --- tokens --------------------------------------------------------------------------------

@pytest.mark.parametrize("max_tokens", [900, 1200, 1500])
def test_no_call_starts_without_room_for_its_prompt_and_the_budget_is_never_overrun(model, smtp, max_tokens):
    task = services.task_create(type="agent.plan_execute", params={"goal": GOAL, **EMAILS},
                                limits={"max_tokens": max_tokens})
    assert drive_inline(task.pk) == "paused"
    task = Task.objects.get(pk=task.pk)
    assert task.paused_by_limit == "max_tokens"
    assert 0 < task.tokens_used <= max_tokens
    # Each call asked for no more than what the budget had left after its prompt.
    for request in model.requests:
        prompt = estimate_prompt_tokens(request.body["messages"], request.body.get("tools"))
        assert prompt + request.body["max_completion_tokens"] <= max_tokens


def test_the_prompt_of_every_attempt_the_server_read_is_counted(model, smtp, settings):
    clean = agent()
    assert drive_inline(clean.pk) == "completed"
    settings.LLM_MODEL = "standin-planner+500@1"  # each request's first attempt fails with a 500, its retry works
    model.requests.clear()
    retried = agent()
    assert drive_inline(retried.pk) == "completed"
    failed = [r for r in model.requests if r.status == 500]
    assert failed
    extra = sum(estimate_prompt_tokens(r.body["messages"], r.body.get("tools")) for r in failed)
    assert (Task.objects.get(pk=retried.pk).tokens_used - Task.objects.get(pk=clean.pk).tokens_used) == extra
