"""Agents that run for hours (issue 22, items 1-2): the dialog stays within the model's context
window. A compact-NNN step has the model summarise the earlier turns once the next request would
pass ORCH_AGENT_COMPACT_AT of the window; later requests carry the summary and the harness's
ledger of effects (from the WAL), so a finished action never looks unfinished. Against the
stand-in with an 8,192-token window that answers 400 context_length_exceeded past it."""
import pytest

from orchestrator.agent import compaction, history
from orchestrator.engine import services
from orchestrator.engine.worker import drive_inline
from orchestrator.llm.standin import _estimate_prompt_tokens
from orchestrator.models import AgentMessage, Step, Task, WalEntry
from tests.agent import long_run_tools
from tests.support.helpers import standin_for_this_process

pytestmark = pytest.mark.django_db(transaction=True)

WINDOW = 8192
ITEMS = 200
GOAL = (f"Read items 1 to {ITEMS} with item_read, one per turn, keeping a running total; after item 40 email the "
        f"running total to ops@example.org; then answer with the total.")


@pytest.fixture
def model(settings, smtp):
    with standin_for_this_process(settings, model=f"standin-planner+context_window={WINDOW}", token_seconds=0,
                                  LLM_CONTEXT_WINDOW=WINDOW, ORCH_EXTENSIONS=["tests.agent.long_run_tools"],
                                  ORCH_AGENT_EMAIL_ALLOW=["*@example.org"],
                                  # One drive_inline runs the 200 turns whole, on a loaded machine too
                                  # (a 60 s slice ended it 'sliced' once).
                                  ORCH_SLICE_SECONDS=900) as server:
        yield server


def long_agent(**params) -> Task:
    return services.task_create(type="agent.plan_execute", params={
        "goal": GOAL, "tools": ["item_read", "email_send"], "approval_waived": ["email_send"],
        "max_turns": ITEMS + 10, "max_tokens_per_call": 300, **params})


def emails_of(smtp, task) -> list:
    keys = set(WalEntry.objects.filter(task=task, tool="email.send").values_list("idempotency_key", flat=True))
    return [m for m in smtp.received if m["X-Idempotency-Key"] in keys]


def summary_in(request) -> str | None:
    texts = [m.get("content") or "" for m in request.body["messages"] if m["role"] == "user"]
    return next((t for t in texts if t.startswith("[Summary of turns")), None)


def test_a_200_turn_agent_stays_within_an_8192_token_window_and_never_sends_its_email_twice(model, smtp):
    task = long_agent()
    assert drive_inline(task.pk) == "completed", Task.objects.get(pk=task.pk).status_reason
    total = sum(long_run_tools.value_of(i) for i in range(1, ITEMS + 1))
    final = AgentMessage.objects.filter(task=task, role="assistant").order_by("-turn").first()
    assert final.content == f"Read items 1 to {ITEMS}. The total is {total}."

    # No request over the window: the server refused none, and none was larger than it.
    asked = [r for r in model.requests if r.path.endswith("/chat/completions")]
    assert {r.status for r in asked} == {200}
    assert max(_estimate_prompt_tokens(r.body) for r in asked) <= WINDOW
    # At least three compactions, each a done compact step with its range and digest.
    compacted = [s.result for s in Step.objects.filter(task=task, step_id__startswith="compact-", status="done")
                 if s.result.get("compacted")]
    assert len(compacted) >= 3, [s.result for s in Step.objects.filter(task=task, step_id__startswith="compact-")]
    assert all(c["digest"] and c["last_turn"] >= c["first_turn"] >= 1 for c in compacted)
    summaries = AgentMessage.objects.filter(task=task, role="summary", interrupted=False)
    assert summaries.count() == len(compacted)
    # One summary request per compaction.
    assert sum(1 for r in asked if r.body["messages"][0]["content"] == compaction.SUMMARY_PROMPT) == len(compacted)
    print(f"{len(asked)} requests, {len(compacted)} compactions, largest request "
          f"{max(_estimate_prompt_tokens(r.body) for r in asked)} tokens")

    # The email went once, at item 40 (turn 41), before the first compaction hid that turn.
    [mail] = emails_of(smtp, task)
    assert mail["Subject"] == "Running total after item 40"
    [sent] = WalEntry.objects.filter(task=task, tool="email.send")
    assert sent.step_id == "tool-041-1" and sent.status == "done"
    # Every request after a compaction that hid the email's turn carries the ledger line saying it
    # was done: the model cannot take it for a thing still to do.
    hiding = [r for r in asked if summary_in(r) and "turns 1-" in summary_in(r)
              and int(summary_in(r).split("turns 1-")[1].split("]")[0].split(",")[0]) >= 41]
    assert len(hiding) > 50
    assert all(f"(key {sent.idempotency_key}): done" in summary_in(r) for r in hiding)

    # The raw dialog is kept whole: every call and result, for the audit, the export and rollback.
    assert AgentMessage.objects.filter(task=task, role="tool").count() == ITEMS + 1
    # The request the model reads now: system, goal, the latest summary, then the turns after it.
    last_turn = final.turn
    messages = history.messages_for_turn(task.pk, last_turn)
    assert [m["role"] for m in messages[:3]] == ["system", "user", "user"]
    assert messages[2]["content"].startswith("[Summary of turns 1-")


def test_a_server_that_refuses_the_context_gets_a_compacted_dialog_and_the_task_goes_on(model, smtp, settings):
    # The harness's threshold is high, and it thinks the window is large: only the server's 400
    # context_length_exceeded tells it. The turn compacts in its own step and asks again.
    settings.ORCH_AGENT_COMPACT_AT = 1.0
    settings.LLM_CONTEXT_WINDOW = 10 * WINDOW
    task = long_agent(goal=GOAL.replace(f"1 to {ITEMS}", "1 to 60"))
    assert drive_inline(task.pk) == "completed", Task.objects.get(pk=task.pk).status_reason
    refused = [r for r in model.requests if r.status == 400]
    assert refused
    turns_compacted = [s for s in Step.objects.filter(task=task, step_id__startswith="turn-", status="done")
                       if (s.result or {}).get("compacted", {}).get("compacted")]
    assert len(turns_compacted) >= 1
    assert len(refused) == len(turns_compacted)  # each refusal was followed by a compaction, then a fit
    final = AgentMessage.objects.filter(task=task, role="assistant").order_by("-turn").first()
    assert final.content.endswith(f"The total is {sum(long_run_tools.value_of(i) for i in range(1, 61))}.")
    assert len(emails_of(smtp, task)) == 1


def test_a_server_refusal_with_nothing_to_summarise_pauses_the_task_with_the_servers_words(model, settings):
    # The server's window (300 tokens) is smaller than the system prompt and the goal; the harness
    # believes the profile's 81,920. Refused at the first turn, with no earlier turn to summarise,
    # the task pauses with the server's words and what to do: it neither fails nor asks again.
    settings.LLM_MODEL = "standin-planner+context_window=300"
    settings.ORCH_AGENT_COMPACT_AT = 1.0
    settings.LLM_CONTEXT_WINDOW = 10 * WINDOW
    task = long_agent()
    assert drive_inline(task.pk) == "paused"
    task = Task.objects.get(pk=task.pk)
    assert task.paused_by_limit == "context_window", task.status_reason
    assert "maximum context length is 300 tokens" in task.status_reason
    assert "no earlier turns to summarise: shorten the goal or pick a model with a larger window" in task.status_reason
    asked = [r for r in model.requests if r.path.endswith("/chat/completions")]
    assert [r.status for r in asked] == [400]



def test_a_dialog_the_server_still_refuses_once_compacted_pauses_the_task_and_asks_no_third_time(model, settings):
    # The harness believes a window ten times the server's and never compacts on its own; the
    # server's window is exactly the size of the first request. Turn 1 fits; turn 2 (turn 1 and its
    # call's result) is refused; the turn compacts turn 1 and asks again, and that request (turn 1's
    # plus the summary) is refused too: the task pauses with the server's words and what to do. It
    # neither fails, nor compacts again, nor asks a third time.
    settings.ORCH_AGENT_COMPACT_AT = 1.0
    settings.LLM_CONTEXT_WINDOW = 10 * WINDOW
    probe = long_agent(max_turns=1)  # the same first request, against the fixture's 8,192-token window
    assert drive_inline(probe.pk) == "paused"
    [first] = [r for r in model.requests if r.path.endswith("/chat/completions")]
    window = _estimate_prompt_tokens(first.body)
    settings.LLM_MODEL = f"standin-planner+context_window={window}"
    seen = len(model.requests)

    task = long_agent()
    assert drive_inline(task.pk) == "paused"
    task = Task.objects.get(pk=task.pk)
    assert task.paused_by_limit == "context_window", task.status_reason
    assert f"maximum context length is {window} tokens" in task.status_reason
    assert "The dialog was compacted and still does not fit; pick a model with a larger window" in task.status_reason
    asked = [r for r in model.requests[seen:] if r.path.endswith("/chat/completions")]
    summary_asked = [r.body["messages"][0]["content"] == compaction.SUMMARY_PROMPT for r in asked]
    assert [(r.status, summary) for r, summary in zip(asked, summary_asked)] == [
        (200, False), (400, False), (200, True), (400, False)]
    assert _estimate_prompt_tokens(asked[0].body) == window  # the first turn did fit, exactly
    # The request refused the second time was the compacted one: turn 1 summarised, its messages gone.
    assert summary_in(asked[3]).startswith("[Summary of turns 1-1,")
    assert not [m for m in asked[3].body["messages"] if m["role"] == "tool"]
    [summary] = AgentMessage.objects.filter(task=task, role="summary", interrupted=False)
    assert summary.summary_of["last_turn"] == 1
    # Each attempt is in the ledger: the refusals spent nothing.
    from orchestrator.models import ModelCallAttempt
    assert list(ModelCallAttempt.objects.filter(task=task).order_by("id").values_list("purpose", "outcome")) == [
        ("turn", "completed"), ("turn", "refused"), ("summary", "completed"), ("turn", "refused")]

def test_a_goal_too_long_for_the_window_pauses_with_a_reason_and_sends_nothing(model, settings):
    settings.LLM_CONTEXT_WINDOW = 1024
    task = long_agent(goal=GOAL + " " + "context " * 1200)
    assert drive_inline(task.pk) == "paused"
    task = Task.objects.get(pk=task.pk)
    assert "window" in task.status_reason and "shorten the goal" in task.status_reason, task.status_reason
    assert not [r for r in model.requests if r.path.endswith("/chat/completions")]


def test_a_rollback_to_before_a_compaction_restores_the_uncompacted_dialog_and_the_page_shows_it(
        model, smtp, client, viewer, settings):
    settings.ORCH_SNAPSHOT_KEEP = 500  # a version before the compaction is still there to roll back to
    from django.urls import reverse

    from orchestrator.engine import revisions
    from orchestrator.models import TaskEvent

    # No email in this run: a rollback over a sent email would ask to confirm sending it again.
    task = long_agent(goal=GOAL.replace("after item 40", "after item 55").replace(f"1 to {ITEMS}", "1 to 60"),
                      max_turns=45)
    assert drive_inline(task.pk) == "paused"
    done = [s for s in Step.objects.filter(task=task, step_id__startswith="compact-", status="done")
            if s.result.get("compacted")]
    assert done, "no compaction before the pause"
    compact = done[0]

    # The page shows the compaction, and the summarised messages folded (each can be opened).
    client.force_login(viewer)
    page = client.get(reverse("task_detail", args=[task.pk])).content.decode()
    assert 'data-testid="compaction"' in page and f"summary of turns 1-{compact.result['last_turn']}" in page
    assert 'data-folded="true"' in page and 'data-testid="folded-message"' in page

    # Roll back to the version before the compact step ran: its summary stops counting, and the
    # dialog the next turn reads is the uncompacted one (the summary row is kept for the audit).
    before = max(e.payload["version"] for e in TaskEvent.objects.filter(task=task, kind="step_done")
                 if e.payload.get("step", "").startswith("tool-")
                 and int(e.payload["step"].split("-")[1]) == int(compact.step_id.split("-")[1]))
    task = Task.objects.get(pk=task.pk)
    revisions.apply_rollback(task_id=task.pk, version=before, expected_version=task.event_seq)
    next_turn = int(compact.step_id.split("-")[1]) + 1
    messages = history.messages_for_turn(task.pk, next_turn)
    assert not any((m.get("content") or "").startswith("[Summary of turns") for m in messages)
    assert sum(1 for m in messages if m["role"] == "tool") == next_turn - 1
    assert AgentMessage.objects.filter(task=task, role="summary", key__startswith=f"summary:{compact.step_id}:").exists()


def test_the_estimate_is_calibrated_by_the_servers_usage_so_a_server_that_counts_double_never_refuses(
        model, smtp, settings):
    # This server's tokenizer counts twice characters / 4, in its usage and against its window.
    settings.LLM_MODEL = f"standin-planner+usage-scale=2+context_window={WINDOW}"
    task = long_agent(goal=GOAL.replace(f"1 to {ITEMS}", "1 to 60"))
    assert drive_inline(task.pk) == "completed", Task.objects.get(pk=task.pk).status_reason
    asked = [r for r in model.requests if r.path.endswith("/chat/completions")]
    # Calibrated by each turn's usage, the harness compacted before the server's count passed the
    # window: not one request was refused (uncalibrated, the dialog grows past 8,192 of its tokens).
    assert {r.status for r in asked} == {200}
    assert max(_estimate_prompt_tokens(r.body) for r in asked) <= WINDOW
    assert any(s.result.get("compacted") for s in Step.objects.filter(task=task, step_id__startswith="compact-"))
    turn = Step.objects.get(task=task, step_id="turn-010").result["usage"]
    assert turn["prompt"] == pytest.approx(2 * turn["prompt_estimate"], rel=0.01)
