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
from django.db.models import Max

from ..models import AgentMessage, Step, WalEntry, WalStatus

USER_ORDER = 1000
INTERRUPTED_NOTE = ("(Your previous answer was interrupted before it was complete; what you had written is above. "
                    "Continue from there.)")
NOT_EXECUTED = "not executed: the run was interrupted before this call"


def current(task_id: int):
    """The task's rows that still count (their step's generation is the current one)."""
    generations = dict(Step.objects.filter(task_id=task_id).values_list("step_id", "generation"))
    rows = AgentMessage.objects.filter(task_id=task_id).order_by("turn", "order", "id")
    return [row for row in rows if not row.step_id or generations.get(row.step_id) == row.generation]


def messages_for_turn(task_id: int, turn: int) -> list[dict]:
    """The messages of the request for `turn`: everything before it, plus its own
    interrupted attempts (the model continues them instead of starting over)."""
    # Its own answer and tool results are not part of its request; an attempt that was lost
    # before its first token has nothing to continue.
    rows = [r for r in current(task_id)
            if (r.interrupted and r.content and r.turn <= turn)
            or (not r.interrupted and (r.turn < turn or (r.turn == turn and r.role == AgentMessage.Role.USER)))]
    return repaired(task_id, _with_notes(rows), {c["id"]: c.get("step", "") for r in rows for c in r.tool_calls})


def _with_notes(rows) -> list[dict]:
    messages = []
    for row in rows:
        messages.append(_wire(row))
        if row.role == AgentMessage.Role.ASSISTANT and row.interrupted:
            messages.append({"role": "user", "content": INTERRUPTED_NOTE})
    return messages


def _wire(row: AgentMessage) -> dict:
    if row.role == AgentMessage.Role.TOOL:
        return {"role": "tool", "tool_call_id": row.tool_call_id, "content": row.content}
    if row.role == AgentMessage.Role.ASSISTANT:
        message = {"role": "assistant", "content": row.content or None}
        if row.tool_calls:
            message["tool_calls"] = [{"id": c["id"], "type": "function",
                                      "function": {"name": c["name"], "arguments": c["arguments"]}}
                                     for c in row.tool_calls]
        return message
    return {"role": row.role, "content": row.content}


def repaired(task_id: int, messages: list[dict], steps_of_calls: dict[str, str]) -> list[dict]:
    """`messages` with a `tool` message for every tool call that has none, from the WAL —
    never guessed: a recorded result is replayed; a call that never wrote an intent was not
    executed. (The plan makes a turn wait for all its tool steps, so this is a safety net:
    a history that still lacks an answer here is not sent half-made.)"""
    out: list[dict] = []
    pending: list[dict] = []
    for message in messages + [{"role": "end"}]:
        if message["role"] == "tool":
            pending = [c for c in pending if c["id"] != message["tool_call_id"]]
        elif pending:
            for call in pending:
                out.append({"role": "tool", "tool_call_id": call["id"],
                            "content": _from_wal(task_id, steps_of_calls.get(call["id"], ""))})
            pending = []
        if message["role"] == "assistant":
            pending = list(message.get("tool_calls") or [])
        if message["role"] != "end":
            out.append(message)
    return out


def _from_wal(task_id: int, step_id: str) -> str:
    entry = (WalEntry.objects.filter(task_id=task_id, step_id=step_id, status=WalStatus.DONE).order_by("-id").first()
             if step_id else None)
    return f"(recorded result) {entry.result}" if entry is not None else NOT_EXECUTED


def latest_turn(task_id: int) -> int:
    """The turn a user message sent now joins: the last one the model answered, or began to
    (an interrupted answer), so the message comes after what the model said."""
    return (AgentMessage.objects.filter(task_id=task_id, role=AgentMessage.Role.ASSISTANT)
            .exclude(interrupted=True, content="").aggregate(n=Max("turn"))["n"] or 0)


def superseded(task_id: int, turn: int) -> bool:
    """A user message arrived after turn `turn` was answered: its calls not yet started are
    superseded (the model decides again with the message in view)."""
    answer = (AgentMessage.objects.filter(task_id=task_id, role=AgentMessage.Role.ASSISTANT, turn=turn,
                                          interrupted=False).order_by("-id").first())
    return answer is not None and AgentMessage.objects.filter(
        task_id=task_id, role=AgentMessage.Role.USER, turn__gte=turn, order__gte=USER_ORDER, id__gt=answer.id).exists()
