"""The ledger of every model call attempt: tokens in / out / cached, the price at the model
profile's rates, the outcome (issue 22, item 5). Its one writer: every attempt a step makes is
recorded here, and counted against the task's max_tokens (ctx.use_tokens) in the same breath,
so a budget counts every attempt, not only the one that completed.

`max_cost` is a task limit in money: a call does not start once the ledger's cost for the task
reaches it (check_cost; the task pauses with `limit: max_cost`, never fails), and resuming needs
it raised (engine/actions.limit_has_room reads cost_used).

A row is written in its own fenced transaction (engine/lease.py): a runner whose lease went
stale writes nothing. An attempt lost with its process has no row of its own until the step
runs again and finds what it left (record_lost).
"""
from __future__ import annotations

import logging
from contextlib import contextmanager
from decimal import Decimal

from django.db import transaction
from django.db.models import Count, Sum

from ..models import AgentMessage, ModelCallAttempt
from . import rows_at_commit
from .signals import LimitExceeded

log = logging.getLogger(__name__)
Outcome = ModelCallAttempt.Outcome


def record(ctx, *, purpose: str, profile, outcome: str, prompt_tokens: int = 0, completion_tokens: int = 0,
           cached_tokens: int = 0, estimated: bool = False, error: str = "", count: bool = True,
           fence_held: bool = False) -> ModelCallAttempt:
    """One attempt of `ctx`'s step. `count`: also add its tokens to the step's use (False for an
    attempt already counted some other way). `fence_held`: the caller's transaction holds the
    lease's fence already (its other writes and this row commit together)."""
    with _fenced(ctx, fence_held):
        row = ModelCallAttempt.objects.create(**_values(ctx, purpose=purpose, profile=profile, outcome=outcome,
                                                        prompt_tokens=prompt_tokens,
                                                        completion_tokens=completion_tokens,
                                                        cached_tokens=cached_tokens, estimated=estimated, error=error))
    if count:
        # Counted once the row is: a transaction that rolls back (its lease lost, a write after
        # it failed) counts nothing, and the attempt row left behind is counted lost later.
        transaction.on_commit(lambda: ctx.use_tokens(row.prompt_tokens + row.completion_tokens))
    return row


def record_with(ctx, rows: list, *, deleted: tuple = (), purpose: str, profile, outcome: str, prompt_tokens: int,
                completion_tokens: int, cached_tokens: int = 0, estimated: bool = False) -> None:
    """One attempt of `ctx`'s step, written with `rows` (rows_at_commit.RowAtCommit: a turn's
    answer) and the removal of `deleted` (its attempt row) in one fenced write
    (rows_at_commit.write_fenced: on PostgreSQL one statement), then counted."""
    ledger = rows_at_commit.RowAtCommit(ModelCallAttempt, (), _values(
        ctx, purpose=purpose, profile=profile, outcome=outcome, prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens, cached_tokens=cached_tokens, estimated=estimated))
    rows_at_commit.write_fenced(ctx.lease, [ledger, *rows], deleted=deleted)
    ctx.use_tokens(ledger.values["prompt_tokens"] + ledger.values["completion_tokens"])


def _values(ctx, *, purpose: str, profile, outcome: str, prompt_tokens: int, completion_tokens: int,
            cached_tokens: int, estimated: bool, error: str = "") -> dict:
    from ..llm.profiles import cost_of

    return dict(task_id=ctx.task_id, step_id=ctx.step_id, generation=ctx.generation, purpose=purpose,
                profile=getattr(profile, "name", "") or "", model=getattr(profile, "model", "") or "", outcome=outcome,
                prompt_tokens=max(int(prompt_tokens), 0), completion_tokens=max(int(completion_tokens), 0),
                cached_tokens=max(int(cached_tokens), 0), estimated=estimated, error=error[:2000],
                cost=cost_of(profile, prompt_tokens, completion_tokens, cached_tokens) if profile is not None else None)


@contextmanager
def _fenced(ctx, held: bool):
    from .lease import hold_fenced

    if held:
        if not transaction.get_connection().in_atomic_block:
            raise transaction.TransactionManagementError("fence_held: the caller must hold the fence in a transaction")
        yield
        return
    with transaction.atomic():
        hold_fenced(ctx.lease)
        yield


def record_failures(ctx, *, purpose: str, profile, failed_attempts) -> None:
    """The failed attempts a client made before it completed or gave up (429s, 5xx, cut before
    the first chunk): `retried`, with the prompt tokens the server read (estimated)."""
    for attempt in failed_attempts or ():
        record(ctx, purpose=purpose, profile=profile, outcome=Outcome.RETRIED, prompt_tokens=attempt.prompt_tokens,
               estimated=True, error=(f"HTTP {attempt.status_code}: " if attempt.status_code else "") + attempt.reason)


def record_call_failure(ctx, exc: Exception, *, purpose: str, profile) -> None:
    """A call that produced nothing: each attempt the client made is in the ledger (the last
    one `failed` when the attempts ran out; a refusal, `refused`, spends nothing)."""
    from ..llm import LLMRequestRejected, LLMUnavailable

    failed = list(getattr(exc, "failed_attempts", None) or [])
    if isinstance(exc, LLMUnavailable) and failed:
        record_failures(ctx, purpose=purpose, profile=profile, failed_attempts=failed[:-1])
        record(ctx, purpose=purpose, profile=profile, outcome=Outcome.FAILED, prompt_tokens=failed[-1].prompt_tokens,
               estimated=True, error=str(exc))
        return
    record_failures(ctx, purpose=purpose, profile=profile, failed_attempts=failed)
    if isinstance(exc, LLMRequestRejected):
        record(ctx, purpose=purpose, profile=profile, outcome=Outcome.REFUSED, error=str(exc))


def account_attempt_rows(ctx, *, profile, role: str, current: AgentMessage | None = None, outcome: str = "",
                         fence_held: bool = False) -> int:
    """Record in the ledger this step's attempt rows not yet accounted (engine/llm_ledger.py):
    `current` (a cut, cancelled or capped attempt, kept) with `outcome`, and any other one as
    lost with its process (estimated from what it had streamed). Their tokens count against
    max_tokens. Returns how many tokens they were. `fence_held`: as record's."""
    rows = list(AgentMessage.objects.filter(task_id=ctx.task_id, step_id=ctx.step_id, generation=ctx.generation,
                                            role=role, interrupted=True, accounted=False))
    purpose = "summary" if role == AgentMessage.Role.SUMMARY else "turn"
    tokens = 0
    for row in rows:
        mine = current is not None and row.pk == current.pk
        record(ctx, purpose=purpose, profile=profile,
                          outcome=outcome if mine else Outcome.LOST,
                          prompt_tokens=row.prompt_tokens, completion_tokens=row.completion_tokens,
                          estimated=row.tokens_estimated if mine else True,
                          error="" if mine else "the process making this call died before it finished",
                          fence_held=fence_held)
        tokens += row.prompt_tokens + row.completion_tokens
    if rows:
        AgentMessage.objects.filter(pk__in=[r.pk for r in rows]).update(accounted=True)
    return tokens


def cost_used(task_id: int) -> Decimal:
    """What the task's model calls cost so far, every attempt counted (0 when none has a price)."""
    total = ModelCallAttempt.objects.filter(task_id=task_id).aggregate(total=Sum("cost"))["total"]
    return _places(total) if total is not None else Decimal(0)


def costs_of(task_ids: list[int]) -> dict[int, Decimal]:
    """What each of these tasks' model calls cost (a page of the task list: one grouped query)."""
    if not task_ids:
        return {}
    rows = (ModelCallAttempt.objects.filter(task_id__in=task_ids, cost__isnull=False).values("task_id")
            .annotate(total=Sum("cost")).order_by())
    return {row["task_id"]: _places(row["total"]) for row in rows}


def check_cost(ctx) -> None:
    """Before a model call: raise LimitExceeded("max_cost") when the task's cost reached its
    max_cost (the task pauses; raise max_cost and resume)."""

    limit = ctx.limit("max_cost")  # a run's limits are fixed while it runs: no query per call
    if limit is None:
        return
    spent = cost_used(ctx.task_id)
    if spent >= Decimal(str(limit)):
        raise LimitExceeded("max_cost", detail=f"the model calls cost {spent} of max_cost {limit}; raise max_cost to "
                                               f"resume")


# The totals of a task with no model call yet (what `totals` returns for it).
NO_CALLS = {"attempts": 0, "prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0, "cost": None,
            "estimated_attempts": 0}


def totals(task_id: int) -> dict:
    """The task's ledger summed: attempts, tokens in / out / cached, cost, and how many were estimated."""
    sums = ModelCallAttempt.objects.filter(task_id=task_id).aggregate(
        attempts=Count("id"), prompt_tokens=Sum("prompt_tokens"), completion_tokens=Sum("completion_tokens"),
        cached_tokens=Sum("cached_tokens"), cost=Sum("cost"))
    estimated = ModelCallAttempt.objects.filter(task_id=task_id, estimated=True).count()
    return {"attempts": sums["attempts"], "prompt_tokens": sums["prompt_tokens"] or 0,
            "completion_tokens": sums["completion_tokens"] or 0, "cached_tokens": sums["cached_tokens"] or 0,
            "cost": str(_places(sums["cost"])) if sums["cost"] is not None else None, "estimated_attempts": estimated}


def _places(total) -> Decimal:
    """A sum of costs at the column's places (SQLite sums decimals as floats)."""
    from ..llm.profiles import COST_PLACES

    return Decimal(str(total)).quantize(COST_PLACES)


def attempts_of(task_id: int) -> list[dict]:
    """The task's ledger, row by row (API and export)."""
    return [{"id": a.pk, "step_id": a.step_id, "generation": a.generation, "purpose": a.purpose,
             "profile": a.profile, "model": a.model, "outcome": a.outcome, "prompt_tokens": a.prompt_tokens,
             "completion_tokens": a.completion_tokens, "cached_tokens": a.cached_tokens, "estimated": a.estimated,
             "cost": str(a.cost) if a.cost is not None else None, "error": a.error,
             "created_at": a.created_at.isoformat()}
            for a in ModelCallAttempt.objects.filter(task_id=task_id).order_by("id")]
