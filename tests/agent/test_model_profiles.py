"""Models as configuration: agents pick a model profile with `model`; each request goes to its
profile's server with its profile's key (stand-in servers on their own ports record the
Authorization header); the keys never reach the export, the logs or the page. Reasoning is
kept apart and shown, sent back only where the profile says so; an answer cut at its token
cap pauses the task with the dialog kept; each call's cost is recorded at the profile's prices.
Each server dialect (vLLM, Ollama, llama.cpp) carries a whole agent run."""
import json
import logging
from decimal import Decimal

import pytest
from django.core.serializers.json import DjangoJSONEncoder
from django.urls import reverse

from orchestrator import selectors
from orchestrator.agent import history
from orchestrator.engine import revisions, services
from orchestrator.engine.worker import drive_inline
from orchestrator.llm.standin import STANDIN_MODEL, StandinServer
from orchestrator.models import AgentMessage, ModelProfile, Task
from tests.support.helpers import settle

GOAL = "Parse the 2 contracts and total their amounts"
ALPHA_KEY = "sk-alpha-4f1c9e0b7a2d6e3f"
BETA_KEY = "sk-beta-9a8b7c6d5e4f3a2b"
DEFAULT_KEY = "sk-default-0011223344556677"


def bearer(key: str) -> str:
    return f"Bearer {key}"


@pytest.fixture
def servers():
    """Three stand-in model servers on three ports: two profiles' and the default's."""
    with StandinServer(token_seconds=0.0005) as alpha, StandinServer(token_seconds=0.0005) as beta, \
            StandinServer(token_seconds=0.0005) as default:
        yield alpha, beta, default


def llm_models(alpha, **extra) -> str:
    return json.dumps({"alpha": {"base_url": alpha.base_url, "api_key": ALPHA_KEY, "model": f"{STANDIN_MODEL}+vllm",
                                 "price_input_per_million": 2, "price_output_per_million": 8, **extra}})


@pytest.fixture
def installation(servers, settings):
    """This process's settings: the default server and LLM_MODELS' profile `alpha`; the
    admin's profile `beta` (Ollama-shaped, no prices)."""
    alpha, beta, default = servers
    settings.LLM_BASE_URL, settings.LLM_API_KEY, settings.LLM_MODEL = default.base_url, DEFAULT_KEY, STANDIN_MODEL
    settings.LLM_MODELS = llm_models(alpha)
    settings.LLM_MAX_ATTEMPTS = 2
    ModelProfile.objects.create(name="beta", base_url=beta.base_url, api_key=BETA_KEY,
                                model=f"{STANDIN_MODEL}+ollama")
    return servers


def agent(model: str, goal: str = GOAL, **params) -> Task:
    return services.task_create(type="agent.plan_execute", params={"goal": goal, "model": model, **params})


def leaks(text: str) -> list[str]:
    return [name for name, key in (("alpha", ALPHA_KEY), ("beta", BETA_KEY), ("default", DEFAULT_KEY)) if key in text]


def page_of(client, viewer, task: Task) -> str:
    client.force_login(viewer)
    response = client.get(reverse("task_detail", kwargs={"task_id": task.pk}))
    assert response.status_code == 200
    return response.content.decode()


def assert_completed_with_tool_calls(task: Task) -> list[AgentMessage]:
    task = Task.objects.get(pk=task.pk)
    assert task.status == "completed", (task.status, task.status_reason, task.error)
    answers = list(AgentMessage.objects.filter(task=task, role="assistant", interrupted=False).order_by("turn"))
    assert len(answers) >= 3 and answers[0].tool_calls and not answers[-1].tool_calls
    assert sum(1 for m in AgentMessage.objects.filter(task=task, role="tool")) >= 3  # list, read x2
    return answers


# --- two profiles, two servers, two keys --------------------------------------------------

@pytest.mark.workers
@pytest.mark.django_db(transaction=True)
def test_two_agents_on_two_profiles_each_request_goes_to_its_own_server_with_its_own_key(
        servers, settings, start_workers, client, viewer):
    alpha, beta, default = servers
    settings.LLM_MODELS = llm_models(alpha)
    ModelProfile.objects.create(name="beta", base_url=beta.base_url, api_key=BETA_KEY, model=f"{STANDIN_MODEL}+ollama")
    cluster = start_workers(2, LLM_BASE_URL=default.base_url, LLM_API_KEY=DEFAULT_KEY, LLM_MODEL=STANDIN_MODEL,
                            LLM_MODELS=llm_models(alpha), ORCH_LOG_LEVEL="DEBUG")
    on_alpha, on_beta = agent("alpha"), agent("beta")
    for task in (on_alpha, on_beta):
        assert settle(task.pk, timeout=90).status == "completed"
        assert_completed_with_tool_calls(task)

    # Each server got its profile's requests, with its profile's key and model; the default none.
    assert len(alpha.requests) >= 3 and len(beta.requests) >= 3 and default.requests == []
    assert {r.authorization for r in alpha.requests} == {bearer(ALPHA_KEY)}
    assert {r.authorization for r in beta.requests} == {bearer(BETA_KEY)}
    assert {r.model for r in alpha.requests} == {f"{STANDIN_MODEL}+vllm"}
    assert {r.model for r in beta.requests} == {f"{STANDIN_MODEL}+ollama"}
    # Each agent's dialog is its own server's: the goal of each request is its task's.
    turns_alpha = AgentMessage.objects.filter(task=on_alpha, role="assistant", interrupted=False).count()
    turns_beta = AgentMessage.objects.filter(task=on_beta, role="assistant", interrupted=False).count()
    assert (len(alpha.requests), len(beta.requests)) == (turns_alpha, turns_beta)

    # The keys never reach the export, the worker's logs (debug level) or the page.
    for task in (on_alpha, on_beta):
        exported = json.dumps(selectors.task_export(task.pk), cls=DjangoJSONEncoder)
        assert leaks(exported) == [], f"a key in the export of task {task.pk}"
        assert leaks(page_of(client, viewer, task)) == [], f"a key on the page of task {task.pk}"
    logs = cluster.output()
    assert "model call finished" in logs  # the client's own lines are there, at debug level
    assert leaks(logs) == []


# --- each dialect carries a whole agent run -------------------------------------------------

@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("dialect", ["vllm", "ollama", "llamacpp"])
def test_an_agent_with_tool_calls_completes_under_each_dialect_with_its_reasoning_apart(installation, dialect,
                                                                                         caplog):
    alpha, beta, default = installation
    caplog.set_level(logging.DEBUG)  # every logger, the openai package's and httpx's included
    task = agent(f"{STANDIN_MODEL}+{dialect}")  # no profile of that name: a model on the default server
    assert drive_inline(task.pk) == "completed"
    answers = assert_completed_with_tool_calls(task)
    assert {r.authorization for r in default.requests} == {bearer(DEFAULT_KEY)}
    # The reasoning of every answer is kept apart from its text.
    assert all(a.reasoning.startswith("Thinking:") and "Thinking" not in a.content for a in answers)
    assert "read" in answers[-1].content or "Summary" in answers[-1].content
    # Usage: estimated where the server sends none (Ollama), the server's own elsewhere.
    assert {a.tokens_estimated for a in answers} == {dialect == "ollama"}
    # The default profile does not send reasoning back.
    sent = [m for r in default.requests for m in r.body["messages"]]
    assert not any("reasoning_content" in m or "reasoning" in m for m in sent)
    # Not even a debug line of any library carries the key (before any redaction).
    raw = [str(record.__dict__) + record.getMessage() for record in caplog.records]
    assert raw and not any(DEFAULT_KEY in line for line in raw)


@pytest.mark.django_db(transaction=True)
def test_reasoning_goes_back_to_the_server_only_when_its_profile_says_so(installation):
    alpha, beta, default = installation
    ModelProfile.objects.filter(name="beta").update(send_reasoning_back=True)
    task = agent("beta")
    assert drive_inline(task.pk) == "completed"
    answers = assert_completed_with_tool_calls(task)
    last = beta.requests[-1].body["messages"]
    sent_back = [m.get("reasoning_content") for m in last if m["role"] == "assistant"]
    assert sent_back == [a.reasoning for a in answers[:-1]] and all(sent_back)
    # LLM_MODELS' alpha does not: nothing of the kind in its requests.
    other = agent("alpha")
    assert drive_inline(other.pk) == "completed"
    assert not any("reasoning_content" in m for r in alpha.requests for m in r.body["messages"])


@pytest.mark.django_db(transaction=True)
def test_the_page_shows_the_reasoning_and_each_call_s_cost_at_the_profile_s_prices(installation, client, viewer):
    alpha, beta, default = installation
    task = agent("alpha")
    assert drive_inline(task.pk) == "completed"
    answers = assert_completed_with_tool_calls(task)
    for answer in answers:  # vLLM-shaped: the server's own usage; alpha costs 2 in / 8 out per million
        assert not answer.tokens_estimated
        assert answer.cost == (Decimal(answer.prompt_tokens * 2 + answer.completion_tokens * 8)
                               / Decimal(1_000_000)).quantize(Decimal("0.000001"))
    total = sum(a.cost for a in answers)
    result = Task.objects.get(pk=task.pk).steps.get(step_id="turn-001").result
    assert result["profile"] == "alpha" and Decimal(result["cost"]) == answers[0].cost
    page = page_of(client, viewer, task)
    assert 'data-testid="dialog-reasoning"' in page and answers[0].reasoning in page
    assert f'data-testid="conversation-cost">{total.normalize():f}' in page
    assert page.count('data-testid="message-cost"') == len(answers)
    # A profile without prices records no cost, and the page says none.
    unpriced = agent("beta")
    assert drive_inline(unpriced.pk) == "completed"
    assert not AgentMessage.objects.filter(task=unpriced, cost__isnull=False).exists()
    assert "conversation-cost" not in page_of(client, viewer, unpriced)


# --- the profile's flags -------------------------------------------------------------------

@pytest.mark.django_db(transaction=True)
def test_a_profile_without_tools_or_stream_options_is_sent_neither(installation, settings):
    alpha, beta, default = installation
    # This server refuses both (HTTP 400), as some do: the profile says so and it is served.
    settings.LLM_MODELS = json.dumps({"plain": {"base_url": alpha.base_url, "api_key": ALPHA_KEY,
                                                "model": f"{STANDIN_MODEL}+no-tools+no-stream-options",
                                                "supports_tools": False, "supports_stream_options": False}})
    task = agent("plain")
    assert drive_inline(task.pk) == "completed"
    [request] = alpha.requests
    assert request.status == 200 and "tools" not in request.body and "stream_options" not in request.body
    [answer] = AgentMessage.objects.filter(task=task, role="assistant")
    assert "No tool applies" in answer.content and answer.tokens_estimated
    # The same server named as a plain model (tools and stream_options sent) refuses the request.
    refused = agent(f"{STANDIN_MODEL}+no-tools")
    settings.LLM_BASE_URL = alpha.base_url
    drive_inline(refused.pk)
    assert alpha.requests[-1].status == 400


@pytest.mark.django_db(transaction=True)
def test_a_dialog_larger_than_the_profile_s_window_pauses_before_the_call(installation, settings):
    alpha, beta, default = installation
    settings.LLM_MODELS = llm_models(alpha, context_window=300)
    task = agent("alpha")
    assert drive_inline(task.pk) == "paused"
    task = Task.objects.get(pk=task.pk)
    assert task.paused_by_limit == "context_window"
    assert task.status_reason.startswith("limit: context_window (the dialog") and "300-token window" in task.status_reason
    assert "no earlier turns to summarise" in task.status_reason  # turn 1: nothing to compact
    assert alpha.requests == []


# --- finish_reason: length --------------------------------------------------------------------

@pytest.mark.django_db(transaction=True)
def test_an_answer_cut_at_its_cap_pauses_with_the_dialog_kept_and_continues_on_resume(installation):
    alpha, beta, default = installation
    # The tool turns fit in 24 tokens; the final summary (with its reasoning) does not.
    task = agent("alpha", max_tokens_per_call=24)
    assert drive_inline(task.pk) == "paused"
    task = Task.objects.get(pk=task.pk)
    assert task.paused_by_limit == "max_tokens_per_call"
    assert "finish_reason: length" in task.status_reason and "raise max_tokens_per_call" in task.status_reason
    # The scene is kept: the turns and tool results before, and the cut answer flagged interrupted,
    # its reasoning apart, its tokens and cost counted.
    assert AgentMessage.objects.filter(task=task, role="tool").count() == 3
    [cut] = AgentMessage.objects.filter(task=task, role="assistant", interrupted=True)
    assert cut.content and cut.reasoning.startswith("Thinking") and cut.accounted and not cut.tool_calls
    assert cut.completion_tokens == 24 and cut.cost > 0
    assert task.tokens_used == sum(m.prompt_tokens + m.completion_tokens
                                   for m in AgentMessage.objects.filter(task=task, role="assistant"))
    # Resumed as it is, the turn continues the kept answer (the stand-in, not a model, says the
    # same again and is cut again: paused again, nothing lost).
    asked = len(alpha.requests)
    services.task_resume(task_id=task.pk)
    assert drive_inline(task.pk) == "paused"
    resumed = alpha.requests[asked].body["messages"]
    assert resumed[-2:] == [{"role": "assistant", "content": cut.content},
                            {"role": "user", "content": history.INTERRUPTED_NOTE}]
    # With the cap raised, it finishes.
    task = Task.objects.get(pk=task.pk)
    revisions.apply_edit(task_id=task.pk, new_params=revisions.edited_params(task, {"max_tokens_per_call": 2000}),
                         expected_version=None)
    assert drive_inline(task.pk) == "completed"
    assert "Summary of 2 contracts" in AgentMessage.objects.filter(
        task=task, role="assistant", interrupted=False).order_by("-id").first().content
