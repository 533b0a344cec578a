"""agent.plan_execute in-process against the stand-in model server over real HTTP (and a
real SMTP server): turns and tool calls as durable steps, the dialog as rows, a history
that is always valid, user messages, budgets that pause."""
import json

import pytest

from django.core.serializers.json import DjangoJSONEncoder

from orchestrator import selectors
from orchestrator.agent import history
from orchestrator.engine import inbox, services
from orchestrator.engine.worker import drive_inline
from orchestrator.models import AgentMessage, Step, Task, TaskEvent, WalEntry
from review.models import ReviewItem
from review.services import review_decide
from tests.support.helpers import CONTRACTS_GOAL, CONTRACTS_TOOLS

pytestmark = pytest.mark.django_db(transaction=True)

GOAL, EMAILS = CONTRACTS_GOAL, CONTRACTS_TOOLS  # tests/support/helpers.py; `model`: tests/conftest.py


def agent(goal: str = GOAL, **params) -> Task:
    return services.task_create(type="agent.plan_execute", params={"goal": goal, **EMAILS, **params})


def assert_every_tool_call_answered(messages: list[dict]) -> None:
    for i, message in enumerate(messages):
        for call in message.get("tool_calls") or []:
            answers = [m for m in messages[i + 1:] if m["role"] == "tool" and m["tool_call_id"] == call["id"]]
            assert len(answers) == 1, f"tool call {call['id']} has {len(answers)} answers"


def test_the_contracts_goal_runs_through_the_agent_reads_each_contract_and_sends_one_email(model, smtp):
    task = agent()
    assert drive_inline(task.pk) == "completed"
    task = Task.objects.get(pk=task.pk)
    steps = list(Step.objects.filter(task=task).order_by("position").values_list("step_id", "added_by", "status"))
    turns = [s for s in steps if s[0].startswith("turn-")]
    tools = [s for s in steps if s[0].startswith("tool-")]
    assert all(status == "done" for _, _, status in steps)
    # list, read x5 (in turns of several calls), email, answer: every step added by the turn before.
    assert len(turns) >= 4 and all(added == "" if sid == "turn-001" else added.startswith(("turn-", "tool-"))
                                   for sid, added, _ in turns)
    names = [Step.objects.get(task=task, step_id=sid).result["name"] for sid, _, _ in tools]
    assert names.count("contracts_list") == 1 and names.count("contracts_read") == 5
    assert names.count("email_send") == 1
    # One email, through the WAL, with the tool call's own idempotency key.
    [mail] = smtp.received
    assert mail["To"] == "ops@example.org" and "5 contracts" in mail["Subject"]
    [entry] = WalEntry.objects.filter(task=task, tool="email.send")
    assert entry.status == "done" and entry.step_id.startswith("tool-")
    assert mail["X-Idempotency-Key"] == entry.idempotency_key
    # The dialog is durable rows; every request the model got had each tool call answered.
    roles = list(AgentMessage.objects.filter(task=task).values_list("role", flat=True))
    assert roles[:2] == ["system", "user"] and roles.count("tool") == len(tools)
    for request in model.requests:
        assert_every_tool_call_answered(request.body["messages"])
    final = Step.objects.get(task=task, step_id=turns[-1][0]).result
    assert final["final"] and "ops@example.org" in final["content"]
    assert task.tokens_used > 0
    # The answer streamed to the page as progress events.
    assert TaskEvent.objects.filter(task=task, kind="progress", payload__message="agent.stream").exists()
    # The transcript and its events are in the export.
    exported = json.loads(json.dumps(selectors.task_export(task.pk), cls=DjangoJSONEncoder))
    assert [m["role"] for m in exported["transcript"]] == roles
    assert any(e["payload"].get("message") == "agent.stream" for e in exported["events"])


def test_a_bad_tool_call_goes_back_to_the_model_as_an_error_and_max_turns_pauses(model, smtp, settings):
    settings.LLM_MODEL = "standin-planner+unknown-tool"  # every answer calls a tool that was not offered
    task = agent(max_turns=3)
    assert drive_inline(task.pk) == "paused"
    task = Task.objects.get(pk=task.pk)
    assert task.paused_by_limit == "max_turns" and task.status_reason == "limit: max_turns"
    answers = list(AgentMessage.objects.filter(task=task, role="tool").values_list("content", flat=True))
    assert len(answers) >= 3 and all(a.startswith("error: there is no tool") for a in answers)
    assert not smtp.received
    # The model saw each error (the request of turn 3 carries the answers of turns 1 and 2).
    assert any(m["role"] == "tool" and m["content"].startswith("error: there is no tool")
               for m in model.requests[-1].body["messages"])


def test_a_user_message_sent_mid_run_reaches_the_next_request(model, smtp):
    task = agent()
    sent = inbox.send(task_id=task.pk, type="user.message", payload={"text": "also include the totals in EUR"})
    assert drive_inline(task.pk) == "completed"
    event = sent.event.__class__.objects.get(pk=sent.event.pk)
    assert event.state == "consumed" and event.outcome.startswith("appended to the dialog after turn")
    asked = [r for r in model.requests if any(m.get("content") == "also include the totals in EUR"
                                             for m in r.body["messages"])]
    assert asked, "no request carried the user's message"


def test_running_out_of_tokens_pauses_with_the_scene_kept_and_resumes_after_raising_it(model, smtp):
    task = services.task_create(type="agent.plan_execute", params={"goal": GOAL, **EMAILS}, limits={"max_tokens": 1200})
    assert drive_inline(task.pk) == "paused"
    task = Task.objects.get(pk=task.pk)
    assert task.paused_by_limit == "max_tokens" and task.status_reason == "limit: max_tokens"
    kept = AgentMessage.objects.filter(task=task).count()
    assert kept >= 3 and not smtp.received
    services.task_resume(task_id=task.pk, limits={"max_tokens": 1_000_000})
    assert drive_inline(task.pk) == "completed"
    assert len(smtp.received) == 1
    assert AgentMessage.objects.filter(task=task).count() > kept


def test_the_history_is_repaired_from_the_wal_never_guessed(model):
    task = agent()
    AgentMessage.objects.create(task=task, key="system:g0", turn=0, order=0, role="system", content="s")
    AgentMessage.objects.create(task=task, key="goal:g0", turn=0, order=1, role="user", content="g")
    AgentMessage.objects.create(task=task, key="turn-001:g0", turn=1, order=0, role="assistant", content="",
                                tool_calls=[{"id": "call_a", "name": "contracts_list", "arguments": "{}",
                                             "step": "tool-001-1"}])
    messages = history.messages_for_turn(task.pk, 2)
    assert messages[-1] == {"role": "tool", "tool_call_id": "call_a", "content": history.NOT_EXECUTED}
    assert json.loads(json.dumps(messages))  # wire-ready


@pytest.mark.parametrize("approved", [True, False])
def test_a_call_that_needs_approval_waits_without_a_worker_and_runs_or_returns_the_note(model, smtp, approved):
    task = agent(require_approval=["email_send"])
    assert drive_inline(task.pk) == "waiting"
    task = Task.objects.get(pk=task.pk)
    assert task.lease_owner == "" and task.waiting_for[0]["type"] == "approval.decided"
    assert not smtp.received
    [item] = ReviewItem.objects.filter(task=task)
    review_decide(item_id=item.pk, decision="approve" if approved else "reject", note="not this week")
    assert drive_inline(task.pk) == "completed"
    answer = AgentMessage.objects.get(task=task, role="tool", name="email_send").content
    if approved:
        assert len(smtp.received) == 1 and not answer.startswith("rejected")
    else:
        assert not smtp.received and answer == "rejected by the reviewer: not this week"


def test_the_20_contracts_goal_reads_all_20_totals_them_right_and_sends_one_email_after_approval(model, smtp):
    from decimal import Decimal

    from demo.tasktypes.contract_extraction import MalformedContract, list_samples, read_contract

    task = agent("Parse the 20 contracts and email a summary to ops@example.org", require_approval=["email_send"])
    assert drive_inline(task.pk) == "waiting"  # the email waits for its approval, holding no worker
    reads = Step.objects.filter(task=task, step_id__startswith="tool-", result__name="contracts_read")
    assert reads.count() == 20 and not smtp.received
    [item] = ReviewItem.objects.filter(task=task)
    review_decide(item_id=item.pk, decision="approve", note="looks right")
    assert drive_inline(task.pk) == "completed"
    [mail] = smtp.received
    # The totals the email states are the sums of every amount in the 20 contracts.
    expected: dict[str, Decimal] = {}
    for path in list_samples()[:20]:
        try:
            found = read_contract(path)
        except MalformedContract:
            continue
        for amount in found["amounts"]:
            expected[amount["currency"]] = expected.get(amount["currency"], Decimal(0)) + Decimal(amount["value"])
    body = mail.get_payload()
    stated = body.split("Total of the amounts: ", 1)[1].splitlines()[0]
    assert stated == "; ".join(f"{c} {v:,.2f}" for c, v in sorted(expected.items()))


def test_a_user_message_supersedes_the_calls_of_the_last_turn_that_had_not_started(model, smtp, monkeypatch):
    from orchestrator.agent import toolbox
    from tests.conftest import wait_for

    real_call = toolbox.call
    sent = []

    def call(ctx, name, arguments, allowed):
        if name == "contracts_read" and not sent:
            sent.append(inbox.send(task_id=ctx.task_id, type="user.message",
                                   payload={"text": "stop reading, just send what you have"}).event)
            # The runner's supervisor has seen it: it is consumed at the next resume point.
            wait_for(lambda: ctx._runner.inbox_signal >= sent[0].seq, timeout=10, message="the message seen")
        return real_call(ctx, name, arguments, allowed)

    monkeypatch.setattr(toolbox, "call", call)
    task = services.task_create(type="agent.plan_execute", params={"goal": GOAL, **EMAILS}, limits={"max_subtasks": 1})
    assert drive_inline(task.pk) == "completed"
    answers = list(AgentMessage.objects.filter(task=task, role="tool", name="contracts_read", turn=2)
                   .order_by("order").values_list("content", flat=True))
    # The first read ran; the four the model had asked for in the same turn had not started.
    assert not answers[0].startswith("skipped") and answers[1:] == ["skipped: superseded by a new user message"] * 4
    # The next request has the turn's answers, then the message.
    asked = next(r.body["messages"] for r in model.requests
                 if any(m.get("content") == "stop reading, just send what you have" for m in r.body["messages"]))
    at = [m.get("content") for m in asked].index("stop reading, just send what you have")
    assert [m["role"] for m in asked[at - 5:at]] == ["tool"] * 5
    assert_every_tool_call_answered(asked)


def test_editing_the_goal_of_a_paused_agent_previews_every_turn_again_and_the_next_request_has_the_new_goal(
        model, smtp):
    from orchestrator.engine import revisions

    task = services.task_create(type="agent.plan_execute", params={"goal": GOAL, **EMAILS}, limits={"max_tokens": 1200})
    assert drive_inline(task.pk) == "paused"
    task = Task.objects.get(pk=task.pk)
    new_goal = "Parse the 2 contracts and email a summary to ops@example.org"
    preview, _ = revisions.preview_edit(task, revisions.edited_params(task, {"goal": new_goal}))
    assert "turn-001" in preview.rerun  # every turn reads the goal
    assert all(sid.startswith(("turn-", "tool-")) for sid in preview.rerun + preview.removed)
    assert preview.kept == []
    revisions.apply_edit(task_id=task.pk, new_params=revisions.edited_params(task, {"goal": new_goal}),
                         expected_version=None, limits={"max_tokens": 1_000_000})
    seen = len(model.requests)
    assert drive_inline(task.pk) == "completed"
    first = model.requests[seen].body["messages"]
    assert first[1] == {"role": "user", "content": new_goal} and len(first) == 2  # the old dialog is history no more
    [mail] = smtp.received
    assert "2 contracts" in mail["Subject"]


def test_a_reviewer_edits_and_approves_the_email_in_the_review_queue_and_the_call_runs_with_the_correction(
        model, smtp, make_user):
    from review.models import ReviewItem
    from review.services import review_decide

    task = agent(require_approval=["email_send"])
    assert drive_inline(task.pk) == "waiting"
    [item] = ReviewItem.objects.filter(task=task)
    assert item.kind == "approval" and item.wal_entry is None and item.tool == "email_send"
    assert item.proposal["arguments"]["to"] == ["ops@example.org"] and item.proposal["call_id"]
    corrected = {**item.proposal["arguments"], "to": ["finance@example.org"]}
    review_decide(item_id=item.pk, decision="edit_approve", note="finance reads these", result=corrected,
                  actor=make_user("rita", "reviewer"))
    assert Task.objects.get(pk=task.pk).status == "queued"  # the decision woke it
    assert drive_inline(task.pk) == "completed"
    [mail] = smtp.received
    assert mail["To"] == "finance@example.org"
    item.refresh_from_db()
    assert (item.status, item.decision, item.decided_by.username) == ("decided", "edit_approve", "rita")
    [entry] = WalEntry.objects.filter(task=task, tool="email.send")
    assert entry.args["to"] == ["finance@example.org"] and entry.status == "done"


def test_a_decision_sent_by_another_system_is_refused_audited_and_the_call_keeps_waiting(model, smtp):
    from orchestrator.models import AuditEntry

    task = agent(require_approval=["email_send"])
    assert drive_inline(task.pk) == "waiting"
    [item] = ReviewItem.objects.filter(task=task)
    for source in ("system", "operator", "webhook:crm"):
        with pytest.raises(inbox.InboxRefused) as refused:
            inbox.send(task_id=task.pk, type="approval.decided", source=source,
                       payload={"approved": True, "approval_id": str(item.pk), "note": "forged"})
        assert refused.value.status == 403
    assert AuditEntry.objects.filter(task=task, action="approval.forged").count() == 3
    assert Task.objects.get(pk=task.pk).status == "waiting" and not smtp.received
    item.refresh_from_db()
    assert item.status == "open"
