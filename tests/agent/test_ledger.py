"""The ledger of every model call attempt (issue 22, item 5): each attempt is a row — completed,
retried after a 429 or a 500, cancelled by a Stop, lost with its process — with its tokens and
its price at the model profile's rates; its sums are what the stand-in billed; max_cost pauses a
task (never fails it) and it resumes once raised."""
import json
from decimal import Decimal

import pytest

from orchestrator.engine import actions, llm_ledger, services
from orchestrator.engine.worker import drive_inline
from orchestrator.llm.standin import STANDIN_MODEL
from orchestrator.models import ModelCallAttempt, Task
from tests.support.helpers import standin_for_this_process

pytestmark = pytest.mark.django_db(transaction=True)

GOAL = "Parse the 3 contracts and remember the summary"
PRICES = {"price_input_per_million": 2, "price_output_per_million": 8}


@pytest.fixture
def model(settings):
    with standin_for_this_process(settings, model=STANDIN_MODEL, token_seconds=0, LLM_MAX_ATTEMPTS=3) as server:
        yield server


def priced(settings, server, model: str) -> None:
    settings.LLM_MODELS = json.dumps({"priced": {"base_url": server.base_url, "api_key": "standin", "model": model,
                                                 **PRICES}})


def agent(**params) -> Task:
    return services.task_create(type="agent.plan_execute", params={
        "goal": GOAL, "model": "priced", "tools": ["contracts_list", "contracts_read", "memory_write"], **params})


def cost(prompt: int, completion: int) -> Decimal:
    return (Decimal(prompt * PRICES["price_input_per_million"] + completion * PRICES["price_output_per_million"])
            / Decimal(1_000_000)).quantize(Decimal("0.000001"))


def test_every_attempt_is_in_the_ledger_and_its_sums_equal_what_the_stand_in_billed(model, settings):
    # Every request is refused once with a 429 (unread: nothing billed), then fails once with a 500
    # (the prompt read: billed), then answered.
    priced(settings, model, f"{STANDIN_MODEL}+429@1+500@2")
    task = agent()
    assert drive_inline(task.pk) == "completed", Task.objects.get(pk=task.pk).status_reason
    rows = list(ModelCallAttempt.objects.filter(task=task))
    outcomes = [r.outcome for r in rows]
    turns = outcomes.count("completed")
    assert turns >= 3 and outcomes.count("retried") == 2 * turns and len(rows) == 3 * turns
    assert all(r.profile == "priced" and r.purpose == "turn" for r in rows)
    # 429: refused unread, 0 tokens; 500: its prompt, estimated; completed: the server's usage.
    assert all(r.prompt_tokens == 0 and r.error.startswith("HTTP 429") for r in rows if r.error.startswith("HTTP 429"))
    assert sum(1 for r in rows if r.error.startswith("HTTP 429")) == turns
    assert all(r.prompt_tokens > 0 and r.estimated for r in rows if r.error.startswith("HTTP 500"))
    assert all(not r.estimated for r in rows if r.outcome == "completed")

    billed = model.billing
    assert len(billed) == len(rows)
    assert sum(r.prompt_tokens for r in rows) == sum(b["prompt_tokens"] for b in billed)
    assert sum(r.completion_tokens for r in rows) == sum(b["completion_tokens"] for b in billed)
    # Each row's cost at the profile's prices; the task's cost is their sum, retries included.
    assert all(r.cost == cost(r.prompt_tokens, r.completion_tokens) for r in rows)
    assert llm_ledger.cost_used(task.pk) == sum(cost(b["prompt_tokens"], b["completion_tokens"]) for b in billed)
    # The budget counted every attempt: the task's tokens are the ledger's.
    task = Task.objects.get(pk=task.pk)
    totals = llm_ledger.totals(task.pk)
    assert task.tokens_used == totals["prompt_tokens"] + totals["completion_tokens"]


def test_max_cost_pauses_the_task_and_it_resumes_once_raised(model, settings):
    priced(settings, model, STANDIN_MODEL)
    task = services.task_create(type="agent.plan_execute", limits={"max_cost": 0.001}, params={
        "goal": GOAL, "model": "priced", "tools": ["contracts_list", "contracts_read", "memory_write"]})
    assert drive_inline(task.pk) == "paused"
    task = Task.objects.get(pk=task.pk)
    spent = llm_ledger.cost_used(task.pk)
    assert task.paused_by_limit == "max_cost" and spent >= Decimal("0.001")
    assert "raise max_cost" in task.status_reason
    # No call started once the cost reached the limit: the last attempt is the one that passed it.
    rows = list(ModelCallAttempt.objects.filter(task=task))
    assert sum(r.cost for r in rows[:-1]) < Decimal("0.001") <= sum(r.cost for r in rows)
    # Resuming without raising it is refused, and says why; raised, the task finishes.
    verdict = actions.check(task, "resume")
    assert not verdict.allowed and "raise max_cost" in verdict.reason
    services.task_resume(task_id=task.pk, limits={"max_cost": 1})
    assert drive_inline(task.pk) == "completed"
    assert llm_ledger.cost_used(task.pk) > spent


def test_the_api_the_export_and_the_admin_carry_the_ledger(model, settings, client, make_user):
    from orchestrator import selectors

    superuser = make_user("root", superuser=True)
    priced(settings, model, f"{STANDIN_MODEL}+429@1")
    task = agent()
    assert drive_inline(task.pk) == "completed"
    rows = list(ModelCallAttempt.objects.filter(task=task))
    client.force_login(superuser)
    usage = client.get(f"/api/tasks/{task.pk}").json()["counters"]["model_usage"]
    assert usage["attempts"] == len(rows) and usage["cost"] == str(sum(r.cost for r in rows))
    assert usage["prompt_tokens"] == sum(r.prompt_tokens for r in rows)
    exported = selectors.task_export(task.pk)
    assert [a["outcome"] for a in exported["model_attempts"]] == [r.outcome for r in rows]
    assert exported["model_usage"] == llm_ledger.totals(task.pk)
    # The admin sums the ledger per model, per task type and per day.
    page = client.get("/admin/orchestrator/modelcallattempt/").content.decode()
    assert 'data-testid="ledger-sums"' in page
    assert "Sums per model" in page and "Sums per task type" in page and "Sums per day" in page
    assert f"<td>agent.plan_execute</td><td>{len(rows)}</td><td>{usage['prompt_tokens']}</td>" in page
    # The task page's cost is the ledger's, retries included.
    page = client.get(f"/tasks/{task.pk}/").content.decode()
    assert f'data-testid="conversation-cost">{usage["cost"].rstrip("0")}' in page
    # And the list shows each task's tokens and cost.
    tokens = Task.objects.get(pk=task.pk).tokens_used
    page = client.get("/").content.decode()
    assert f'data-testid="task-usage">{tokens} tokens · cost {usage["cost"].rstrip("0")}</div>' in page


@pytest.mark.parametrize("fault, params, status, outcomes", [
    # The answer reaches max_tokens_per_call at the third turn: the server's usage, and a pause.
    ("", {"max_tokens_per_call": 16}, "paused", ["completed", "completed", "length"]),
    # Every request fails with a 500 (the prompt read: billed): three attempts (LLM_MAX_ATTEMPTS),
    # the last one `failed`; the step tries once more the same way, then asks a person.
    ("+500", {}, "needs_human", ["retried", "retried", "failed"] * 2),
    # The server's window (300 tokens) is smaller than the first request: refused unread.
    ("+context_window=300", {}, "paused", ["refused"]),
    # The server cuts every stream half way (a prose answer: no tools); the step tries once more.
    ("+cut", {"tools": []}, "needs_human", ["cut", "cut"]),
], ids=["length", "failed", "refused", "cut"])
def test_each_outcome_is_a_row_counted_by_the_task_and_billed_by_the_stand_in(model, settings, fault, params,
                                                                               status, outcomes):
    from orchestrator.llm.results import estimate_tokens
    from orchestrator.llm.standin import _content_pieces
    from orchestrator.models import AgentMessage

    priced(settings, model, STANDIN_MODEL + fault)
    task = agent(**params)
    assert drive_inline(task.pk) == status, Task.objects.get(pk=task.pk).status_reason
    rows = list(ModelCallAttempt.objects.filter(task=task).order_by("id"))
    assert [r.outcome for r in rows] == outcomes
    # One row per request the stand-in received, in order; the prompt tokens are what it billed,
    # row by row (both count characters / 4 of the same request; 0 for the refusal it never read).
    billed = model.billing
    assert [r.prompt_tokens for r in rows] == [b["prompt_tokens"] for b in billed]
    if fault == "+cut":
        # No usage comes with a cut stream: the client estimates characters / 4 of the text it
        # received, the server billed one token per word it sent. The stand-in flushes what it
        # sent before it closes (and streams without a pause here), so the client received every
        # word billed: each side is exact to its own rule, and the two differ by the
        # characters-per-word ratio of the text (about 1.5 estimated tokens a word).
        kept = list(AgentMessage.objects.filter(task=task, role="assistant", interrupted=True).order_by("id"))
        assert len(kept) == len(rows) and all(m.content for m in kept)
        assert [r.completion_tokens for r in rows] == [estimate_tokens(len(m.content)) for m in kept]
        assert [b["completion_tokens"] for b in billed] == [len(_content_pieces(m.content)) for m in kept]
        assert all(b["completion_tokens"] / 2 <= r.completion_tokens <= 2 * b["completion_tokens"]
                   for r, b in zip(rows, billed))
        assert all(r.estimated for r in rows)
    else:
        assert [r.completion_tokens for r in rows] == [b["completion_tokens"] for b in billed]
        # Estimated where no usage came (a failed attempt's prompt); the server's count otherwise.
        assert [r.estimated for r in rows] == [r.outcome in ("retried", "failed") for r in rows]
    if fault == "+context_window=300":
        assert rows[0].prompt_tokens == rows[0].completion_tokens == 0 and "context window" in rows[0].error
    # Each row priced at the profile's rates; the task counted every attempt, whatever its outcome.
    assert all(r.cost == cost(r.prompt_tokens, r.completion_tokens) for r in rows)
    task = Task.objects.get(pk=task.pk)
    assert task.tokens_used == sum(r.prompt_tokens + r.completion_tokens for r in rows)
    assert llm_ledger.cost_used(task.pk) == sum(r.cost for r in rows)


def test_cached_prompt_tokens_reach_the_ledger_and_are_priced_at_the_cached_price(model, settings):
    # The server reads 256 tokens of every prompt (each is longer) from its cache, and says so in
    # its usage (prompt_tokens_details.cached_tokens); the profile prices them at 1 a million.
    settings.LLM_MODELS = json.dumps({"priced": {"base_url": model.base_url, "api_key": "standin",
                                                 "model": f"{STANDIN_MODEL}+cached=256", **PRICES,
                                                 "price_cached_per_million": 1}})
    task = agent()
    assert drive_inline(task.pk) == "completed", Task.objects.get(pk=task.pk).status_reason
    rows = list(ModelCallAttempt.objects.filter(task=task).order_by("id"))
    billed = model.billing
    assert len(rows) == len(billed) >= 3 and all(r.outcome == "completed" for r in rows)
    assert [r.cached_tokens for r in rows] == [b["cached_tokens"] for b in billed] == [256] * len(rows)
    assert [r.prompt_tokens for r in rows] == [b["prompt_tokens"] for b in billed]
    # The cached tokens at the cached price, the rest of the prompt at the input price.
    for r in rows:
        assert r.cost == (Decimal((r.prompt_tokens - 256) * 2 + 256 * 1 + r.completion_tokens * 8)
                          / Decimal(1_000_000)).quantize(Decimal("0.000001"))
        assert r.cost < cost(r.prompt_tokens, r.completion_tokens)
    assert llm_ledger.totals(task.pk)["cached_tokens"] == 256 * len(rows)
