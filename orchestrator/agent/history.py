"""An agent's dialog as durable rows (AgentMessage), and the history sent to the model,
rebuilt from them — always valid: every assistant `tool_calls` entry is followed by one
`tool` message per id (AGENT.md).

Order: turn by turn. Turn 0 holds the system prompt and the goal; turn N holds the model's
answer (order 0; an interrupted attempt before it, with a note to the model after it) and
the results of its tool calls (order 1..); a user message sent into the running task joins
the latest turn the model answered or began to (order 1000 + its inbox seq), so it comes
after what the model said and before its next answer.

Only rows of the current generation of the step that wrote them count: after an edit or a
rollback re-runs a turn, what the earlier run said is history no more.
"""
from functools import lru_cache

from django.db import connection
from django.db.models import Exists, Max, OuterRef, Q

from ..engine import rows_at_commit
from ..models import AgentMessage, Step, WalEntry, WalStatus
from . import compaction
from .compaction import review_of

USER_ORDER = 1000
INTERRUPTED_NOTE = ("(Your previous answer was interrupted before it was complete; what you had written is above. "
                    "Continue from there.)")
NOT_EXECUTED = "not executed: the run was interrupted before this call"


def current(task_id: int, rows=None):
    """The task's rows that still count (their step's generation is the current one); of
    `rows` (a queryset of the task's AgentMessage) when given. One query: the generation is
    matched against the step's row in the database."""
    written_by_current_run = Exists(Step.objects.filter(task_id=task_id, step_id=OuterRef("step_id"),
                                                        generation=OuterRef("generation")))
    rows = rows if rows is not None else AgentMessage.objects.filter(task_id=task_id)
    return list(rows.filter(Q(step_id="") | written_by_current_run).order_by("turn", "order", "id"))


DIALOG_KEY = ("task", "key")  # AgentMessage's unique constraint: a step's row is found again by it


def write_with_step(ctx, key: str, **fields) -> None:
    """A dialog row of `ctx`'s step by its key, written by the step's checkpoint, in its
    transaction (ctx.write_at_commit): a step that does not commit leaves none of it."""
    ctx.write_at_commit(AgentMessage, unique=DIALOG_KEY, task_id=ctx.task_id, key=key, **fields)


def write(task_id: int, key: str, **fields) -> None:
    """A dialog row by its key, inserted or overwritten in one statement (INSERT … ON CONFLICT):
    a step that runs again writes its own row again. Inside the caller's fenced transaction."""
    rows_at_commit.write_in_transaction([row(task_id, key, **fields)])


def row(task_id: int, key: str, **fields) -> rows_at_commit.RowAtCommit:
    """A dialog row by its key, for a write of several (rows_at_commit.write_fenced)."""
    return rows_at_commit.RowAtCommit(AgentMessage, DIALOG_KEY, {"task_id": task_id, "key": key, **fields})


def sendable(task_id: int, turn: int) -> tuple[AgentMessage | None, list[AgentMessage]]:
    """The summary that counts for `turn`'s request, and the current rows not summarised by it
    (read without the summarised ones: a long run's request costs the same at turn 200 as at
    turn 10)."""
    rows = _current_unless_summarised(task_id, turn)
    if rows:  # no summary before `turn`: every current row, in one query
        return None, rows
    summaries = current(task_id, AgentMessage.objects.filter(task_id=task_id, role=AgentMessage.Role.SUMMARY,
                                                             turn__lt=turn, interrupted=False))
    summary = compaction.latest(summaries)
    if summary is None:
        return None, current(task_id)
    of = summary.summary_of
    rows = AgentMessage.objects.filter(task_id=task_id).filter(
        Q(turn=0) | Q(turn__gt=of["last_turn"]) | Q(id__gt=of["last_message_id"])
        | Q(interrupted=True, turn__gte=of["last_turn"]))
    return summary, [r for r in current(task_id, rows) if not compaction.hidden_by(summary, r)]


def _current_unless_summarised(task_id: int, turn: int) -> list[AgentMessage]:
    """The task's current rows (as `current`), or none when a summary before `turn` exists (of
    any generation: sendable then reads what the summary leaves). Written out: every turn of
    every agent reads it, and the ORM's building of the query and its rows cost ~2.5 ms per
    turn against ~1 ms this way."""
    return list(AgentMessage.objects.raw(_current_unless_summarised_sql(),
                                         [task_id, task_id, task_id, AgentMessage.Role.SUMMARY, turn]))


@lru_cache(maxsize=None)
def _current_unless_summarised_sql() -> str:
    quote = connection.ops.quote_name
    message, step = quote(AgentMessage._meta.db_table), quote(Step._meta.db_table)
    columns = ", ".join(f"m.{quote(f.column)}" for f in AgentMessage._meta.concrete_fields)
    return (f"SELECT {columns} FROM {message} m WHERE m.task_id = %s "
            f"AND (m.step_id = '' OR EXISTS (SELECT 1 FROM {step} s WHERE s.task_id = %s AND s.step_id = m.step_id "
            f"AND s.generation = m.generation)) "
            f"AND NOT EXISTS (SELECT 1 FROM {message} x WHERE x.task_id = %s AND x.role = %s AND x.turn < %s "
            f"AND NOT x.interrupted) "
            f"ORDER BY m.turn, m.{quote('order')}, m.id")


def messages_for_turn(task_id: int, turn: int, settled: dict[str, str] | None = None, *,
                      include_reasoning: bool = False) -> list[dict]:
    """The messages of the request for `turn`: everything before it, plus its own
    interrupted attempts (the model continues them instead of starting over). Raises
    Unsettled for a dangling call whose effect must go through the WAL first (see repaired).
    The model's reasoning goes back (`reasoning_content`) only with `include_reasoning` (the
    profile's send_reasoning_back): servers differ in accepting it."""
    # The turns a compaction summarised are sent as its summary (with the harness's ledger),
    # right after the system prompt and the goal (compaction.py).
    summary, unsummarised = sendable(task_id, turn)
    # Its own answer and tool results are not part of its request; an attempt that was lost
    # before its first token has nothing to continue.
    rows = [r for r in unsummarised
            if ((r.interrupted and r.content and r.turn <= turn)
                or (not r.interrupted and (r.turn < turn or (r.turn == turn and r.role == AgentMessage.Role.USER))))
            and r.role != AgentMessage.Role.SUMMARY]
    messages = _with_notes(rows, include_reasoning)
    if summary is not None:
        opening = sum(1 for r in rows if r.turn == 0)
        messages[opening:opening] = [compaction.wire(task_id, summary)]
    return repaired(task_id, messages, {c["id"]: c.get("step", "") for r in rows for c in r.tool_calls}, settled)


def _with_notes(rows, include_reasoning: bool = False) -> list[dict]:
    messages = []
    for row in rows:
        messages.append(_wire(row, include_reasoning))
        if row.role == AgentMessage.Role.ASSISTANT and row.interrupted:
            messages.append({"role": "user", "content": INTERRUPTED_NOTE})
    return messages


def _wire(row: AgentMessage, include_reasoning: bool = False) -> dict:
    if row.role == AgentMessage.Role.TOOL:
        return {"role": "tool", "tool_call_id": row.tool_call_id, "content": row.content}
    if row.role == AgentMessage.Role.ASSISTANT:
        message = {"role": "assistant", "content": row.content or None}
        if include_reasoning and row.reasoning:
            message["reasoning_content"] = row.reasoning
        if row.tool_calls:
            message["tool_calls"] = [{"id": c["id"], "type": "function",
                                      "function": {"name": c["name"], "arguments": c["arguments"]}}
                                     for c in row.tool_calls]
        return message
    return {"role": row.role, "content": row.content}


class Unsettled(Exception):
    """A dangling tool call whose effect must go through the WAL again before the model can be
    told what happened: an intent whose outcome is unknown (replayed with the same key when the
    tool is idempotent, put before a reviewer when it is not), or one a reviewer found did not
    happen (performed again, same key). The turn settles it and asks again (`settled`)."""

    def __init__(self, entry: WalEntry, step_id: str, call: dict):
        super().__init__(f"tool call {call.get('id')} ({entry.tool}, step {step_id}) has an unsettled WAL intent")
        self.entry, self.step_id, self.call = entry, step_id, call


def repaired(task_id: int, messages: list[dict], steps_of_calls: dict[str, str],
             settled: dict[str, str] | None = None) -> list[dict]:
    """`messages` with a `tool` message for every tool call that has none, from the durable
    record — never guessed (AGENT.md "Repairing history on resume"): a call that ran is told
    its result (a read-only call's is its step's result: reads have no WAL row); an effect in
    doubt goes through the WAL again first (Unsettled); a reviewer's decision is the result; a
    skipped call says who skipped it and why; only a call with no trace was "not executed".
    (The plan makes a turn wait for all its tool steps, so this is a safety net: a history
    that still lacks an answer here is not sent half-made.) `settled`: answers the turn got by
    settling Unsettled calls, by step id."""
    out: list[dict] = []
    pending: list[dict] = []
    for message in messages + [{"role": "end"}]:
        if message["role"] == "tool":
            pending = [c for c in pending if c["id"] != message["tool_call_id"]]
        elif pending:
            for call in pending:
                step_id = steps_of_calls.get(call["id"], "")
                as_made = {"id": call["id"], "name": call["function"]["name"],
                           "arguments": call["function"]["arguments"]}
                out.append({"role": "tool", "tool_call_id": call["id"],
                            "content": answer_for(task_id, as_made, step_id, settled or {})})
            pending = []
        if message["role"] == "assistant":
            pending = list(message.get("tool_calls") or [])
        if message["role"] != "end":
            out.append(message)
    return out


def answer_for(task_id: int, call: dict, step_id: str, settled: dict[str, str]) -> str:
    """What the model is told of a tool call ({"id", "name", "arguments"}) that has no `tool`
    message (AGENT.md's table)."""
    from ..models import StepStatus
    from .toolbox import as_message_text

    if step_id in settled:
        return settled[step_id]
    if not step_id:
        return NOT_EXECUTED
    step = Step.objects.filter(task_id=task_id, step_id=step_id).first()
    entry = WalEntry.objects.filter(task_id=task_id, step_id=step_id).order_by("-id").first()
    if step is not None and step.status == StepStatus.DONE:
        from ..engine.results import result_of

        result = result_of(step)  # the tool step's record: {"tool_call_id", "name", "ok", "result"}
        value = result.get("result") if isinstance(result, dict) and "result" in result else result
        return reviewed(task_id, step_id, as_message_text(value, ref=step_id))
    if entry is not None:
        decision = review_of(entry)
        if entry.status == WalStatus.DONE:
            return reviewed(task_id, step_id, as_message_text(entry.result))
        if entry.status == WalStatus.SKIPPED:
            return reviewed(task_id, step_id, "")
        if entry.status == WalStatus.PENDING:
            raise Unsettled(entry, step_id, call)  # its outcome is unknown: never told "not executed"
        if decision is not None and decision.decision == "not_happened":
            raise Unsettled(entry, step_id, call)  # the reviewer found it did not happen: performed again
    if step is not None and step.status == StepStatus.SKIPPED:
        return skipped_text(task_id, step_id, step.error)
    if superseded(task_id, int(step_id.split("-")[1])):  # tool-TTT-i: a call of turn TTT
        return SUPERSEDED
    return NOT_EXECUTED


SUPERSEDED = "skipped: superseded by a new user message"


def skipped_text(task_id: int, step_id: str, error: str) -> str:
    """A skipped tool step, told to the model: an operator's Skip step with the operator's
    reason (from the audit log: the step's error also names who, which the model need not
    read), otherwise the step's own error (a failure policy, a skipped dependency)."""
    from ..models import AuditEntry

    audit = (AuditEntry.objects.filter(task_id=task_id, action="task.skip_step", before__step=step_id)
             .order_by("-id").first())
    if audit is not None:
        return f"skipped by an operator: {audit.reason or 'no reason given'}"
    return error if error.startswith("skipped") else f"skipped: {error or 'no reason recorded'}"


def reviewed(task_id: int, step_id: str, text: str) -> str:
    """`text` (a tool call's result) as the model reads it when a reviewer decided the call's
    effect in doubt: "happened: …", "did not happen, re-executed: …", "skipped by reviewer: note"."""
    entry = WalEntry.objects.filter(task_id=task_id, step_id=step_id).order_by("-id").first() if step_id else None
    decision = review_of(entry) if entry is not None else None
    if decision is None:
        return text
    if decision.decision == "happened":
        return f"happened: {text}"
    if decision.decision == "not_happened":
        return f"did not happen, re-executed: {text}"
    if decision.decision == "skip":
        return f"skipped by reviewer: {decision.note or 'no note'}"
    return text


def latest_turn(task_id: int) -> int:
    """The turn a user message sent now joins: the last one the model answered, or began to
    (an interrupted answer), so the message comes after what the model said."""
    return (AgentMessage.objects.filter(task_id=task_id, role=AgentMessage.Role.ASSISTANT)
            .exclude(interrupted=True, content="").aggregate(n=Max("turn"))["n"] or 0)


def superseded(task_id: int, turn: int) -> bool:
    """A user message arrived after turn `turn` was answered: its calls not yet started are
    superseded (the model decides again with the message in view)."""
    return AgentMessage.objects.filter(_superseding(task_id, turn)).exists()


def call_state(task_id: int, step_id: str, turn: int) -> tuple[bool, bool]:
    """Of a tool call's step, in one query: whether an earlier run of it left a WAL intent
    (started), and whether its turn's calls are superseded (as `superseded`)."""
    with connection.cursor() as cursor:
        cursor.execute(_call_state_sql(), [task_id, step_id, task_id, AgentMessage.Role.USER, turn, USER_ORDER,
                                           task_id, AgentMessage.Role.ASSISTANT, turn])
        started, superseded_now = cursor.fetchone()
    return bool(started), bool(superseded_now)


@lru_cache(maxsize=None)
def _call_state_sql() -> str:
    """call_state's query, written out: every tool call of every agent runs it, and the ORM's
    building of its two subqueries cost ~1 ms of Python per call (several beside a turn's other
    calls on the step pool), against ~0.05 ms for the database."""
    quote = connection.ops.quote_name
    wal, message = quote(WalEntry._meta.db_table), quote(AgentMessage._meta.db_table)
    return (f"SELECT EXISTS (SELECT 1 FROM {wal} WHERE task_id = %s AND step_id = %s), "
            f"EXISTS (SELECT 1 FROM {message} WHERE task_id = %s AND role = %s AND turn >= %s "
            f"AND {quote('order')} >= %s AND id > (SELECT id FROM {message} WHERE task_id = %s AND role = %s "
            f"AND turn = %s AND NOT interrupted ORDER BY id DESC LIMIT 1))")


def _superseding(task_id: int, turn: int) -> Q:
    """The user messages that supersede turn `turn`'s calls: sent after its answer."""
    answer = (AgentMessage.objects.filter(task_id=task_id, role=AgentMessage.Role.ASSISTANT, turn=turn,
                                          interrupted=False).order_by("-id").values("id")[:1])
    return Q(task_id=task_id, role=AgentMessage.Role.USER, turn__gte=turn, order__gte=USER_ORDER, id__gt=answer)
