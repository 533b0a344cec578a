"""Re-attach after a crash (issue 22, item 6): with a profile whose server keeps background
responses (the Responses API's `background` mode), a turn is asked that way and the response's
id is recorded before its first token; the step run after a kill -9 retrieves the finished
response instead of asking, and paying, again. Against the stand-in, which keeps what it
answered in background mode and bills it once, whatever happens to the connection."""
import json
import os
import signal

import pytest

from orchestrator.engine import services
from orchestrator.engine.worker import drive_inline
from orchestrator.llm.standin import STANDIN_MODEL, StandinServer
from orchestrator.models import AgentMessage, ModelCallAttempt, Task, TaskEvent
from tests.conftest import wait_for
from tests.support.helpers import settle

pytestmark = pytest.mark.django_db(transaction=True)

GOAL = ("Explain in plain words why a durable task harness checkpoints every step, what a write-ahead log "
        "intent is for, and why an idempotency key makes a replay safe")


@pytest.fixture
def model():
    with StandinServer(token_seconds=0) as server:
        yield server


def models_setting(server, model: str = STANDIN_MODEL) -> str:
    return json.dumps({"keeps": {"base_url": server.base_url, "api_key": "standin", "model": model,
                                 "background_responses": True,
                                 "price_input_per_million": 2, "price_output_per_million": 8}})


def asked(server) -> list:
    return [r for r in server.requests if r.path.rstrip("/").endswith("/responses")]


def retrieved(server) -> list:
    return [r for r in server.requests if "/responses/" in r.path]


def test_a_profile_that_keeps_background_responses_runs_a_whole_agent_over_the_responses_api(model, settings):
    settings.LLM_MODELS = models_setting(model)
    task = services.task_create(type="agent.plan_execute", params={
        "goal": "Parse the 3 contracts and remember the summary", "model": "keeps",
        "tools": ["contracts_list", "contracts_read", "memory_write"]})
    assert drive_inline(task.pk) == "completed", Task.objects.get(pk=task.pk).status_reason
    turns = list(AgentMessage.objects.filter(task=task, role="assistant").order_by("turn"))
    assert len(turns) >= 3 and turns[-1].content and not any(t.interrupted for t in turns)
    # Every turn went over the Responses API, in background mode, with the dialog translated:
    # the second request carries the first turn's function call and its output.
    requests = asked(model)
    assert len(requests) == len(turns) and not any(r.path.endswith("/chat/completions") for r in model.requests)
    assert all(r.body["background"] is True and r.body["stream"] is True for r in requests)
    kinds = [item.get("type", "message") for item in requests[1].body["input"]]
    assert "function_call" in kinds and "function_call_output" in kinds
    # The ledger is what the server billed.
    rows = list(ModelCallAttempt.objects.filter(task=task))
    assert [r.outcome for r in rows] == ["completed"] * len(turns)
    assert sum(r.prompt_tokens for r in rows) == sum(b["prompt_tokens"] for b in model.billing)
    assert sum(r.completion_tokens for r in rows) == sum(b["completion_tokens"] for b in model.billing)


def test_a_response_the_server_no_longer_has_is_asked_again_and_the_lost_attempt_counted(model, settings):
    # As a dead process leaves it: turn-001's attempt, with a response id the server does not know.
    settings.LLM_MODELS = models_setting(model)
    task = services.task_create(type="agent.plan_execute", params={"goal": GOAL, "model": "keeps", "tools": []})
    AgentMessage.objects.create(task=task, key="turn-001:g0:attempt:dead", turn=1, role="assistant", interrupted=True,
                                accounted=False, tokens_estimated=True, step_id="turn-001", prompt_tokens=120,
                                content="A durable harness", completion_tokens=4, response_id="resp_forgotten")
    assert drive_inline(task.pk) == "completed", Task.objects.get(pk=task.pk).status_reason
    assert [r.status for r in retrieved(model)] == [404]
    assert len(asked(model)) == 1
    assert list(ModelCallAttempt.objects.filter(task=task).values_list("outcome", "estimated", "prompt_tokens")) == [
        ("lost", True, 120), ("completed", False, model.billing[-1]["prompt_tokens"])]


@pytest.mark.workers
def test_kill_9_mid_stream_retrieves_the_finished_response_instead_of_paying_for_it_again(
        model, start_workers, settings):
    slow = f"{STANDIN_MODEL}+slow=0.1"  # 60-odd tokens: about 6 s of streaming
    settings.LLM_MODELS = models_setting(model, slow)
    start_workers(1, LLM_MODELS=models_setting(model, slow))
    task = services.task_create(type="agent.plan_execute", params={"goal": GOAL, "model": "keeps", "tools": []})
    wait_for(lambda: TaskEvent.objects.filter(task=task, kind="progress", payload__message="agent.stream").exists(),
             timeout=60, message="the answer streaming")
    [attempt] = AgentMessage.objects.filter(task=task, role="assistant", interrupted=True)
    assert attempt.response_id.startswith("resp_")  # recorded before the first token
    os.kill(Task.objects.get(pk=task.pk).worker_pid, signal.SIGKILL)
    task = settle(task.pk, timeout=90)
    assert task.status == "completed" and task.recovery_attempts == 1, task.status_reason

    # One request for the turn, then its retrieval by id: never asked (nor billed) twice.
    [request] = asked(model)
    assert retrieved(model) and all(r.path.endswith(attempt.response_id) for r in retrieved(model))
    [billed] = [b for b in model.billing if b["prompt_tokens"]]
    final = AgentMessage.objects.get(task=task, role="assistant", interrupted=False)
    assert final.content == model.response_text(attempt.response_id)  # the whole answer, not the part streamed
    assert len(final.content) > len(attempt.content)
    assert not AgentMessage.objects.filter(task=task, interrupted=True).exists()
    # The ledger: one attempt, re-attached, as the server billed it; the budget counted it once.
    [row] = ModelCallAttempt.objects.filter(task=task)
    assert (row.outcome, row.estimated, row.prompt_tokens, row.completion_tokens) == (
        "reattached", False, billed["prompt_tokens"], billed["completion_tokens"])
    assert task.tokens_used == billed["prompt_tokens"] + billed["completion_tokens"]
