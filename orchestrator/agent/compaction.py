"""Compaction: an agent's dialog kept within its model's context window (issue 22, items 1-2).

When a request would pass ORCH_AGENT_COMPACT_AT of the window (less the answer's cap), the
earlier turns are summarised by the model into a `summary` row (AgentMessage, role summary),
and later requests send the system prompt, the goal, the latest summary and the messages after
it. A summary stands for all turns up to its `last_turn` (it summarises the previous summary
with the turns after it), so the request stays bounded however long the run.

The model's prose is not trusted to remember what was done. Each time the summary is sent it
carries a **ledger written by the harness from the WAL**: every effect of the summarised turns
(tool, short arguments, key, outcome), every unknown outcome and how a reviewer decided it,
every call that was not executed. A finished action cannot look unfinished to the model
(openai/codex #38931: a compaction that revived plans already done).

Durable like any step: the summary row is written (fenced by the lease) under the key of the
step that made it, so a step that runs again after a crash finds it and never asks twice; an
attempt lost with its process is a row flagged interrupted, and its tokens are counted when the
step runs again. The rows summarised are kept (audit, export, the Conversation panel); a
rollback to before the compaction makes its step's row stale (history.current), so the
uncompacted dialog is what the model reads again.
"""
from __future__ import annotations

import hashlib
import json
import logging
import uuid

from django.conf import settings
from django.db.models import Q

from ..engine import llm_ledger
from ..llm import LLMCancelled, LLMStreamCut
from ..llm.client import estimate_tokens
from ..models import AgentMessage, ReviewItem, ReviewStatus, WalEntry, WalStatus

log = logging.getLogger(__name__)

SUMMARY_PROMPT = (
    "You compact an agent's dialog. Below are the earlier part of its work (and the summary of what came before, if "
    "any). Write a short summary the agent can continue from: what it has found and decided, intermediate results "
    "and figures it still needs, and what remains to do. Do not list the side effects (emails sent, records "
    "written): the harness appends an authoritative ledger of those. Answer with the summary only.")
SUMMARY_HEADER = "[Summary of turns {first}-{last}, written when the dialog was compacted; the full dialog is kept.]"
LEDGER_HEADER = ("[Ledger of the tool calls with side effects in turns 1-{last}, from the harness's write-ahead log. "
                 "It is authoritative: an effect marked done has happened; do not do it again.]")
# A summary row sorts after every message of its last turn (user messages are 1000 + their seq).
SUMMARY_ORDER = 2_000_000_000
TRANSCRIPT_MESSAGE_CHARS = 1500  # one message's text in the transcript the model summarises
ARGUMENT_CHARS, RESULT_CHARS = 160, 120


def summary_cap(window: int) -> int:
    """The summary's token cap: ORCH_AGENT_SUMMARY_TOKENS, at most an eighth of the window."""
    return max(64, min(settings.ORCH_AGENT_SUMMARY_TOKENS, window // 8))


def threshold(window: int, answer_cap: int) -> int:
    """Past this many prompt tokens the dialog is compacted."""
    share = min(max(settings.ORCH_AGENT_COMPACT_AT, 0.1), 1.0)
    return int(share * max(window - answer_cap, 0))


# --- what is sent ---------------------------------------------------------------------------

def latest(rows: list[AgentMessage]) -> AgentMessage | None:
    """The summary that counts among `rows` (the current rows of a task): the one that stands
    for the most."""
    summaries = [r for r in rows if r.role == AgentMessage.Role.SUMMARY and not r.interrupted and r.summary_of]
    return max(summaries, key=lambda r: r.summary_of["last_message_id"], default=None)


def hidden_by(summary: AgentMessage | None, row: AgentMessage) -> bool:
    """Whether `row` is summarised by `summary` (and so not sent)."""
    if row.role == AgentMessage.Role.SUMMARY:
        return True
    if summary is None or row.turn == 0:
        return False
    return row.turn <= summary.summary_of["last_turn"] and (row.id <= summary.summary_of["last_message_id"]
                                                             or row.interrupted)


def wire(task_id: int, summary: AgentMessage) -> dict:
    """The summary as the model reads it: the model's prose, then the harness's ledger."""
    of = summary.summary_of
    parts = [SUMMARY_HEADER.format(first=1, last=of["last_turn"]), summary.content.strip()]
    lines = ledger(task_id, of["last_turn"])
    if lines:
        parts += [LEDGER_HEADER.format(last=of["last_turn"]), *lines]
    return {"role": "user", "content": "\n".join(parts)}


def ledger(task_id: int, last_turn: int) -> list[str]:
    """One line per side effect of the tool calls of turns 1..last_turn, and per call that was not
    executed, from the WAL and the review decisions (never from the model's words)."""
    lines = []
    entries = [e for e in WalEntry.objects.filter(task_id=task_id, step_id__startswith="tool-").order_by("id")
               if _turn_of(e.step_id) <= last_turn]
    for entry in entries:
        lines.append(f"- turn {_turn_of(entry.step_id)}, {entry.tool} {_short(entry.args, ARGUMENT_CHARS)} "
                     f"(key {entry.idempotency_key}): {_outcome(entry)}")
    with_effects = {e.step_id for e in entries}
    not_done = (Q(content__startswith="not executed") | Q(content__startswith="rejected")
                | Q(content__startswith="skipped"))
    for row in AgentMessage.objects.filter(not_done, task_id=task_id, role=AgentMessage.Role.TOOL,
                                           turn__lte=last_turn, turn__gte=1).order_by("turn", "order"):
        text = row.content or ""
        if row.step_id not in with_effects and text.startswith(("not executed", "rejected", "skipped")):
            lines.append(f"- turn {row.turn}, {row.name}: {_clip(text, RESULT_CHARS)}")
    return lines


def review_of(entry: WalEntry):
    """The decided review of an effect in doubt, if a reviewer decided it."""
    return ReviewItem.objects.filter(wal_entry=entry).exclude(status=ReviewStatus.OPEN).first()


def _outcome(entry: WalEntry) -> str:
    decision = review_of(entry)
    if entry.status == WalStatus.DONE:
        said = f"done, result {_short(entry.result, RESULT_CHARS)}"
        if decision is not None and decision.decision == "happened":
            return f"{said} (its outcome was unknown; a reviewer found it happened)"
        return said
    if entry.status == WalStatus.SKIPPED:
        return f"not done: a reviewer skipped it ({decision.note if decision is not None else 'no note'})"
    if entry.status == WalStatus.FAILED:
        return f"failed, not done: {_clip(entry.error, RESULT_CHARS)}"
    return "outcome unknown: waiting for a reviewer to decide whether it happened; do not do it again"


def _turn_of(step_id: str) -> int:
    try:
        return int(step_id.split("-")[1])
    except (IndexError, ValueError):
        return 0


def _short(value, limit: int) -> str:
    return _clip(json.dumps(value, ensure_ascii=False, default=str, sort_keys=True), limit)


def _clip(text: str, limit: int) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 1] + "…"


# --- making one -----------------------------------------------------------------------------

def existing(task_id: int, key: str) -> AgentMessage | None:
    return AgentMessage.objects.filter(task_id=task_id, key=key, interrupted=False).first()


def summary_key(step_id: str, generation: int) -> str:
    return f"summary:{step_id}:g{generation}"


def compactable(rows: list[AgentMessage], up_to_turn: int) -> list[AgentMessage]:
    """Of a task's current `rows` (history.current), those a compaction made now would summarise:
    the rows of turns 1..up_to_turn not already summarised, and the latest summary itself
    (summarised again with them)."""
    summary = latest(rows)
    fresh = [r for r in rows if 1 <= r.turn <= up_to_turn and not r.interrupted and not hidden_by(summary, r)]
    return ([summary] if summary is not None else []) + fresh


def transcript(rows: list[AgentMessage], budget_tokens: int) -> str:
    """The rows as text for the model to summarise, each message clipped, the oldest left out
    if they still do not fit `budget_tokens` (they are in the previous summary or the ledger)."""
    lines = []
    for row in rows:
        if row.role == AgentMessage.Role.SUMMARY:
            lines.append(f"[earlier summary, turns 1-{row.summary_of['last_turn']}]\n{row.content}")
        elif row.role == AgentMessage.Role.ASSISTANT:
            calls = "; ".join(f"{c['name']}({_clip(c['arguments'], ARGUMENT_CHARS)})" for c in row.tool_calls)
            lines.append(f"[turn {row.turn}, assistant] {_clip(row.content, TRANSCRIPT_MESSAGE_CHARS)}"
                         + (f" calls: {calls}" if calls else ""))
        elif row.role == AgentMessage.Role.TOOL:
            lines.append(f"[turn {row.turn}, tool {row.name} result] {_clip(row.content, TRANSCRIPT_MESSAGE_CHARS)}")
        else:
            lines.append(f"[turn {row.turn}, {row.role}] {_clip(row.content, TRANSCRIPT_MESSAGE_CHARS)}")
    while len(lines) > 1 and estimate_tokens(sum(len(line) + 1 for line in lines)) > budget_tokens:
        lines.pop(1 if rows and rows[0].role == AgentMessage.Role.SUMMARY else 0)
    return "\n".join(lines)


def compact(ctx, rows: list[AgentMessage], *, up_to_turn: int, profile, fenced, reason: str) -> dict:
    """Summarise the task's current dialog of turns 1..up_to_turn into a summary row written
    under this step's key; once per step and generation (a step run again finds its row).
    Returns what the step records: the range, its digest, the summary, the ledger, the usage."""
    key = summary_key(ctx.step_id, ctx.generation)
    done = existing(ctx.task_id, key)
    if done is None:
        done = _ask_for_summary(ctx, key, rows, up_to_turn=up_to_turn, profile=profile, fenced=fenced, reason=reason)
    of = done.summary_of
    return {"compacted": True, "reason": reason, "first_turn": of["first_turn"], "last_turn": of["last_turn"],
            "messages": of["messages"], "digest": of["digest"], "summary": done.content,
            "ledger": ledger(ctx.task_id, of["last_turn"]),
            "usage": {"prompt": done.prompt_tokens, "completion": done.completion_tokens,
                      "estimated": done.tokens_estimated},
            "cost": str(done.cost) if done.cost is not None else None}


def _ask_for_summary(ctx, key: str, current: list[AgentMessage], *, up_to_turn: int, profile, fenced,
                     reason: str) -> AgentMessage:
    llm_ledger.check_cost(ctx)
    rows = compactable(current, up_to_turn)
    fresh = [r for r in rows if r.role != AgentMessage.Role.SUMMARY]
    if not fresh:
        raise NothingToCompact(f"nothing to compact up to turn {up_to_turn}")
    cap = summary_cap(profile.context_window)
    text = transcript(rows, budget_tokens=profile.context_window - cap - estimate_tokens(len(SUMMARY_PROMPT)) - 64)
    messages = [{"role": "system", "content": SUMMARY_PROMPT}, {"role": "user", "content": text}]
    digest = hashlib.sha256(text.encode()).hexdigest()
    # An attempt lost with its process (kill -9 mid-request) leaves this row; the step run again
    # counts its tokens (estimated) with the next attempt's.
    with fenced(ctx):
        attempt = AgentMessage.objects.create(
            task_id=ctx.task_id, turn=up_to_turn, order=SUMMARY_ORDER, role=AgentMessage.Role.SUMMARY, interrupted=True,
            accounted=False, tokens_estimated=True, step_id=ctx.step_id, generation=ctx.generation,
            key=f"{key}:attempt:{uuid.uuid4().hex[:12]}", prompt_tokens=estimate_tokens(len(json.dumps(messages))))
    client = profile.client()
    try:
        completion = client.chat(messages, model=profile.model, max_tokens_cap=cap, cancel=ctx.interrupt_requested)
    except (LLMCancelled, LLMStreamCut) as exc:
        # A summary is asked again whole: what this attempt streamed is counted, estimated.
        partial = exc.partial
        llm_ledger.record_failures(ctx, purpose="summary", profile=profile, failed_attempts=exc.failed_attempts)
        with fenced(ctx):
            attempt.delete()
        llm_ledger.record(ctx, purpose="summary", profile=profile, outcome=(
            llm_ledger.Outcome.CANCELLED if isinstance(exc, LLMCancelled) else llm_ledger.Outcome.CUT),
            prompt_tokens=(partial.usage.prompt_tokens if partial else 0) or attempt.prompt_tokens,
            completion_tokens=partial.usage.completion_tokens if partial else 0,
            estimated=partial.usage.estimated if partial else True)
        raise
    except Exception as exc:
        # Refused or away: the attempts the server read are in the ledger, as a turn's are.
        with fenced(ctx):
            attempt.delete()
        llm_ledger.record_call_failure(ctx, exc, purpose="summary", profile=profile)
        raise
    from ..primitives.faults import fault_point

    fault_point("compaction_answered", ctx.step_id)
    cost = profile.cost(completion.usage)
    last_id = max(r.id for r in fresh)
    llm_ledger.record_failures(ctx, purpose="summary", profile=profile, failed_attempts=completion.failed_attempts)
    with fenced(ctx):
        attempt.delete()
    llm_ledger.account_attempt_rows(ctx, profile=profile, role=AgentMessage.Role.SUMMARY)  # lost with a process earlier
    llm_ledger.record(ctx, purpose="summary", profile=profile, outcome=llm_ledger.Outcome.COMPLETED,
                      prompt_tokens=completion.usage.prompt_tokens, completion_tokens=completion.usage.completion_tokens,
                      cached_tokens=completion.usage.cached_tokens, estimated=completion.usage.estimated)
    with fenced(ctx):
        row, _ = AgentMessage.objects.update_or_create(task_id=ctx.task_id, key=key, defaults={
            "turn": up_to_turn, "order": SUMMARY_ORDER, "role": AgentMessage.Role.SUMMARY,
            "content": completion.content.strip(),
            "summary_of": {"first_turn": min(r.turn for r in fresh), "last_turn": up_to_turn,
                           "last_message_id": last_id, "digest": digest, "messages": len(fresh)},
            "prompt_tokens": completion.usage.prompt_tokens, "completion_tokens": completion.usage.completion_tokens,
            "tokens_estimated": completion.usage.estimated, "cost": cost, "step_id": ctx.step_id,
            "generation": ctx.generation})
    log.info("agent dialog compacted", extra={"task_id": ctx.task_id, "step_id": ctx.step_id,
                                              "compaction_reason": reason, "last_turn": up_to_turn,
                                              "messages": len(fresh)})
    return row


class NothingToCompact(Exception):
    """Every turn up to the one asked is already summarised (or there is none)."""
