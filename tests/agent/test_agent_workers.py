"""The agent on real worker processes, talking to the stand-in model over HTTP: a pause
mid-stream, resume from the history, kill -9 during a tool call and during a stream."""
import os
import signal

import pytest
from django.utils import timezone

from orchestrator.agent import history
from orchestrator.engine import services
from orchestrator.llm.standin import StandinServer
from orchestrator.models import AgentMessage, Task, TaskEvent, WalEntry
from tests.conftest import wait_for
from tests.support.helpers import settle

pytestmark = [pytest.mark.workers, pytest.mark.django_db(transaction=True)]

LONG_GOAL = ("Explain in plain words why a durable task harness checkpoints every step, what a write-ahead log "
             "intent is for, and why an idempotency key makes a replay safe")


@pytest.fixture
def model():
    with StandinServer(token_seconds=0.0005) as server:
        yield server


def model_env(server, model: str = "standin-planner") -> dict:
    return {"LLM_BASE_URL": server.base_url, "LLM_API_KEY": "standin", "LLM_MODEL": model}


def test_pause_mid_stream_keeps_the_partial_answer_and_resume_continues_from_the_exact_history(
        model, start_workers):
    start_workers(1, **model_env(model, "standin-planner+slow=0.05"))
    task = services.task_create(type="agent.plan_execute", params={"goal": LONG_GOAL, "tools": []})
    wait_for(lambda: TaskEvent.objects.filter(task=task, kind="progress", payload__message="agent.stream").exists(),
             timeout=60, message="the answer streaming")
    services.task_pause(task_id=task.pk)
    asked_at = Task.objects.get(pk=task.pk).control_requested_at
    task = settle(task.pk, timeout=30)
    assert task.status == "paused"
    # The stream (tens of tokens at 50 ms each) was cut, not waited out.
    paused_at = TaskEvent.objects.filter(task=task, kind="status", payload__to="paused").latest("seq").created_at \
        if TaskEvent.objects.filter(task=task, kind="status").exists() else task.updated_at
    assert (paused_at - asked_at).total_seconds() < 5
    [partial] = AgentMessage.objects.filter(task=task, role="assistant", interrupted=True)
    assert partial.content and partial.tokens_estimated and not partial.accounted
    first = model.requests[-1].body["messages"]
    services.task_resume(task_id=task.pk)
    task = settle(task.pk, timeout=60)
    assert task.status == "completed"
    resumed = model.requests[-1].body["messages"]
    # The exact history, then the kept partial answer and the note that it was interrupted.
    assert resumed[:len(first)] == first
    assert resumed[len(first):] == [{"role": "assistant", "content": partial.content},
                                    {"role": "user", "content": history.INTERRUPTED_NOTE}]
    # The lost attempt's tokens were counted once, by the attempt that completed the turn.
    assert AgentMessage.objects.get(pk=partial.pk).accounted
    assert task.tokens_used >= partial.prompt_tokens + partial.completion_tokens


def test_kill_9_during_the_email_call_goes_to_review_and_exactly_one_email_is_sent(model, start_workers, smtp_server):
    env = {**model_env(model), "EMAIL_HOST": "127.0.0.1", "EMAIL_PORT": smtp_server.port,
           "ORCH_FAULTS": "email.send:after_intent:crash"}
    cluster = start_workers(1, **env)
    task = services.task_create(type="agent.plan_execute",
                                params={"goal": "Parse the 3 contracts and email a summary to ops@example.org"})
    wait_for(lambda: Task.objects.get(pk=task.pk).status in ("awaiting_review", "needs_human", "completed"),
             timeout=90, message="the crash to be recovered into a review")
    cluster.stop()
