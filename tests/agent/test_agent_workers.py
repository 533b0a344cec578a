"""The agent on real worker processes, talking to the stand-in model over HTTP: a pause
mid-stream, resume from the history, kill -9 during a tool call and during a stream."""
import os
import signal
import time

import pytest
from orchestrator.agent import history
from orchestrator.engine import services
from orchestrator.llm.results import estimate_tokens
from orchestrator.llm.standin import _content_pieces
from orchestrator.models import AgentMemory, AgentMessage, ModelCallAttempt, Task, TaskEvent, WalEntry
from review.models import ReviewItem
from review.services import review_decide
from tests.conftest import wait_for
from tests.support.helpers import settle

pytestmark = [pytest.mark.workers, pytest.mark.django_db(transaction=True)]

LONG_GOAL = ("Explain in plain words why a durable task harness checkpoints every step, what a write-ahead log "
             "intent is for, and why an idempotency key makes a replay safe")


# Words the stand-in may send (and bill) after the client hung up, before its next write fails:
# at 100 ms a word, the one in flight and one more; five is half a second of slack for a busy machine.
IN_FLIGHT_TOKENS = 5


def model_env(server, model: str = "standin-planner") -> dict:
    return {"LLM_BASE_URL": server.base_url, "LLM_API_KEY": "standin", "LLM_MODEL": model}


def finished_billing(server) -> list[dict]:
    """The stand-in's billing once it is done with every request (a stream the client left is
    billed until the server's next write fails)."""
    wait_for(lambda: all(r.finished for r in server.requests), timeout=10, message="the stand-in done streaming")
    return server.billing


def test_pause_mid_stream_keeps_the_partial_answer_and_resume_continues_from_the_exact_history(
        standin_server, start_workers):
    start_workers(1, **model_env(standin_server, "standin-planner+slow=0.1"))
    task = services.task_create(type="agent.plan_execute", params={"goal": LONG_GOAL, "tools": []})
    wait_for(lambda: TaskEvent.objects.filter(task=task, kind="progress", payload__message="agent.stream").exists(),
             timeout=60, message="the answer streaming")
    asked = time.monotonic()
    services.task_pause(task_id=task.pk)
    wait_for(lambda: Task.objects.get(pk=task.pk).status == "paused", timeout=30, message="paused")
    # The stream (60-odd tokens at 100 ms each) was cut, not waited out.
    assert time.monotonic() - asked < 2.5
    task = Task.objects.get(pk=task.pk)
    [partial] = AgentMessage.objects.filter(task=task, role="assistant", interrupted=True)
    # Its tokens were counted at the pause (a Stop instead would end the task with no other attempt).
    assert partial.content and partial.tokens_estimated and partial.accounted
    assert task.tokens_used == partial.prompt_tokens + partial.completion_tokens
    first = standin_server.requests[-1].body["messages"]
    services.task_resume(task_id=task.pk)
    task = settle(task.pk, timeout=60)
    assert task.status == "completed"
    resumed = standin_server.requests[-1].body["messages"]
    # The exact history, then the kept partial answer and the note that it was interrupted.
    assert resumed[:len(first)] == first
    assert resumed[len(first):] == [{"role": "assistant", "content": partial.content},
                                    {"role": "user", "content": history.INTERRUPTED_NOTE}]
    # Counted once: the attempt that completed the turn did not count it again.
    assert AgentMessage.objects.get(pk=partial.pk).accounted
    final = AgentMessage.objects.get(task=task, role="assistant", interrupted=False)
    assert len(partial.content) < len(final.content)
    assert task.tokens_used == (partial.prompt_tokens + partial.completion_tokens
                                + final.prompt_tokens + final.completion_tokens)
    # The ledger has both attempts: the one the Pause cut (estimated: no usage came), then the
    # completed one (the server's usage); together they are the task's tokens.
    ledger = list(ModelCallAttempt.objects.filter(task=task).order_by("id").values_list(
        "outcome", "estimated", "prompt_tokens", "completion_tokens"))
    assert ledger == [("cancelled", True, partial.prompt_tokens, partial.completion_tokens),
                      ("completed", False, final.prompt_tokens, final.completion_tokens)]
    assert task.tokens_used == sum(prompt + completion for _, _, prompt, completion in ledger)
    # Prompt tokens are what the stand-in billed, exactly (both count characters / 4 of the same
    # request); the completed attempt's completion is the server's own count.
    billed = finished_billing(standin_server)
    assert [b["prompt_tokens"] for b in billed] == [partial.prompt_tokens, final.prompt_tokens]
    assert billed[-1]["completion_tokens"] == final.completion_tokens


def test_kill_9_after_the_email_went_out_goes_to_review_and_exactly_one_email_is_sent(
        standin_server, start_workers, smtp_server, tmp_path, make_user):
    # The first side effect of this goal is the email (reading contracts is not one): the
    # executor is killed right after the SMTP server took it, before the WAL knew.
    start_workers(1, **model_env(standin_server), EMAIL_HOST="127.0.0.1", EMAIL_PORT=smtp_server.port,
                  ORCH_FAULTS="after_effect:kill-once", ORCH_VAR_DIR=tmp_path, ORCH_AGENT_EMAIL_ALLOW="*@example.org")
    task = services.task_create(type="agent.plan_execute",
                                params={"goal": "Parse the 3 contracts and email a summary to ops@example.org",
                                        "tools": ["contracts_list", "contracts_read", "email_send"],
                                        "approval_waived": ["email_send"]})
    task = settle(task.pk, timeout=90)
    assert (tmp_path / "faults" / "after_effect").exists(), "the crash did not happen"
    assert task.status == "awaiting_review", task.status_reason
    [item] = ReviewItem.objects.filter(task=task)
    assert item.wal_entry.tool == "email.send" and item.wal_entry.step_id.startswith("tool-")
    assert len(smtp_server.messages) == 1  # it did go out: the reviewer sees it in the mailbox
    review_decide(item_id=item.pk, decision="happened", actor=make_user("rita", "reviewer"),
                  note="found in the mailbox")
    task = settle(task.pk, timeout=60)
    assert task.status == "completed", task.status_reason
    assert len(smtp_server.effects()) == 1  # never sent again
    assert task.recovery_attempts == 1
    # The model was told the email's outcome (the reviewer's), and every call had its answer.
    email_answer = AgentMessage.objects.get(task=task, role="tool", name="email_send")
    assert "confirmed_by_reviewer" in email_answer.content
    for request in standin_server.requests:
        messages = request.body["messages"]
        calls = [c["id"] for m in messages for c in m.get("tool_calls") or []]
        assert sorted(calls) == sorted(m["tool_call_id"] for m in messages if m["role"] == "tool")


def test_kill_9_mid_stream_redoes_the_turn_from_what_had_streamed_and_counts_the_lost_tokens_once(
        standin_server, start_workers):
    start_workers(1, **model_env(standin_server, "standin-planner+slow=0.1"))
    task = services.task_create(type="agent.plan_execute", params={"goal": LONG_GOAL, "tools": []})
    wait_for(lambda: TaskEvent.objects.filter(task=task, kind="progress", payload__message="agent.stream").exists(),
             timeout=60, message="the answer streaming")
    executor = Task.objects.get(pk=task.pk).worker_pid
    os.kill(executor, signal.SIGKILL)
    task = settle(task.pk, timeout=90)
    assert task.status == "completed" and task.recovery_attempts == 1
    # What had streamed before the kill is kept as an interrupted attempt, continued by the redo.
    [lost] = AgentMessage.objects.filter(task=task, role="assistant", interrupted=True)
    assert lost.content and lost.tokens_estimated and lost.accounted
    final = AgentMessage.objects.get(task=task, role="assistant", interrupted=False)
    redo = standin_server.requests[-1].body["messages"]
    assert redo[-2:] == [{"role": "assistant", "content": lost.content},
                         {"role": "user", "content": history.INTERRUPTED_NOTE}]
    # Tokens: the completed call's usage plus the lost attempt's estimate, once.
    assert task.tokens_used == (final.prompt_tokens + final.completion_tokens
                                + lost.prompt_tokens + lost.completion_tokens)
    # The ledger has both attempts: the one lost with its process, estimated, and the completed one.
    ledger = list(ModelCallAttempt.objects.filter(task=task).values_list("outcome", "estimated", "prompt_tokens",
                                                                         "completion_tokens"))
    assert ledger == [("lost", True, lost.prompt_tokens, lost.completion_tokens),
                      ("completed", False, final.prompt_tokens, final.completion_tokens)]


def test_kill_9_during_an_idempotent_tool_call_replays_it_with_its_key(standin_server, start_workers, tmp_path):
    # memory_write (db.upsert) is the first side effect of this goal; its transaction dies with the process.
    start_workers(1, **model_env(standin_server), ORCH_FAULTS="after_intent:kill-once", ORCH_VAR_DIR=tmp_path)
    task = services.task_create(type="agent.plan_execute",
                                params={"goal": "Parse the 2 contracts and remember the summary",
                                        "tools": ["contracts_list", "contracts_read", "memory_write"]})
    task = settle(task.pk, timeout=90)
    assert (tmp_path / "faults" / "after_intent").exists(), "the crash did not happen"
    assert task.status == "completed", task.status_reason
    assert task.recovery_attempts == 1
    [entry] = WalEntry.objects.filter(task=task, tool="db.upsert")
    assert entry.status == "done" and entry.idempotency_key.startswith(f"t{task.pk}:tool-")
    memory = AgentMemory.objects.get(key="installation/contracts summary")  # the scope of tasks made by code
    assert memory.task_id == task.pk and "contract" in memory.value.lower()


def test_stop_mid_stream_ends_the_call_at_once_keeps_what_had_streamed_and_bills_it_in_the_ledger(
        standin_server, start_workers):
    start_workers(1, **model_env(standin_server, "standin-planner+slow=0.1"))
    task = services.task_create(type="agent.plan_execute", params={"goal": LONG_GOAL, "tools": []})
    wait_for(lambda: TaskEvent.objects.filter(task=task, kind="progress", payload__message="agent.stream").exists(),
             timeout=60, message="the answer streaming")
    asked = time.monotonic()
    services.task_stop(task_id=task.pk)
    wait_for(lambda: Task.objects.get(pk=task.pk).status == "stopped", timeout=30, message="stopped")
    assert time.monotonic() - asked < 2.5  # not the 6 s the answer would have taken
    [partial] = AgentMessage.objects.filter(task=task, role="assistant", interrupted=True)
    assert partial.content and not AgentMessage.objects.filter(task=task, role="assistant", interrupted=False)
    # The cancelled attempt is in the ledger (estimated: no usage came), and the budget counted it.
    [cancelled] = ModelCallAttempt.objects.filter(task=task)
    assert cancelled.outcome == "cancelled" and cancelled.estimated and cancelled.completion_tokens > 0
    assert Task.objects.get(pk=task.pk).tokens_used == cancelled.prompt_tokens + cancelled.completion_tokens
    # And it is what the stand-in billed for that request. The prompt exactly: the client and the
    # server count characters / 4 of the same messages and tools.
    [billed] = finished_billing(standin_server)
    assert cancelled.prompt_tokens == billed["prompt_tokens"] > 0
    # The completion cannot match exactly, and the test says by how much it may differ: the client,
    # with no usage and no tokenizer, estimates characters / 4 of the text it received; the server
    # bills one token per word it sent, the word in flight when the connection closed included.
    # Each side is exact to its own rule ...
    assert cancelled.completion_tokens == estimate_tokens(len(partial.content))
    received_words = len(_content_pieces(partial.content))
    assert received_words <= billed["completion_tokens"] <= received_words + IN_FLIGHT_TOKENS
    # ... so the ledger's estimate is the bill within the characters-per-word ratio of this answer
    # (1.3 to 3 estimated tokens a word for any prefix of it, 3 for its first word alone) and the
    # words in flight: the tolerance the test states for a cut row's completion tokens.
    assert (billed["completion_tokens"] - IN_FLIGHT_TOKENS <= cancelled.completion_tokens
            <= 3 * billed["completion_tokens"])


def test_kill_9_during_a_compaction_asks_for_the_summary_again_once_and_counts_the_lost_attempt(
        standin_server, start_workers, tmp_path, settings):
    from orchestrator.agent import compaction
    from orchestrator.models import Step

    settings.ORCH_EXTENSIONS = ["tests.agent.long_run_tools"]  # this process validates the params too

    # Killed after the model answered the summary request, before the summary row was written.
    start_workers(1, **model_env(standin_server, "standin-planner+context_window=8192"), LLM_CONTEXT_WINDOW="8192",
                  ORCH_EXTENSIONS="tests.agent.long_run_tools", ORCH_FAULTS="compaction_answered:kill-once",
                  ORCH_VAR_DIR=tmp_path)
    task = services.task_create(type="agent.plan_execute", params={
        "goal": "Read items 1 to 40 with item_read, one per turn, keeping a running total; then answer with the total.",
        "tools": ["item_read"], "max_turns": 50, "max_tokens_per_call": 300})
    task = settle(task.pk, timeout=180)
    assert (tmp_path / "faults" / "compaction_answered").exists(), "the crash did not happen"
    assert task.status == "completed", task.status_reason
    compacted = [s for s in Step.objects.filter(task=task, step_id__startswith="compact-", status="done")
                 if s.result.get("compacted")]
    assert len(compacted) == 1, [s.result for s in Step.objects.filter(task=task, step_id__startswith="compact-")]
    # Two requests for that summary: the one whose answer died with the process, and one after;
    # one summary row; the lost attempt kept as an interrupted row and counted once.
    asked = [r for r in standin_server.requests if r.body["messages"][0]["content"] == compaction.SUMMARY_PROMPT]
    assert len(asked) == 2
    [summary] = AgentMessage.objects.filter(task=task, role="summary", interrupted=False)
    [lost] = AgentMessage.objects.filter(task=task, role="summary", interrupted=True)
    assert lost.step_id == summary.step_id == compacted[0].step_id
    assert lost.accounted and lost.tokens_estimated and lost.prompt_tokens > 0
    from orchestrator.models import ModelCallAttempt
    assert list(ModelCallAttempt.objects.filter(task=task, purpose="summary").values_list("outcome", flat=True)) == [
        "lost", "completed"]
    final = AgentMessage.objects.filter(task=task, role="assistant").order_by("-turn").first()
    from tests.agent.long_run_tools import value_of
    assert final.content == f"Read items 1 to 40. The total is {sum(value_of(i) for i in range(1, 41))}."
