"""Effects performed with the step's checkpoint: `ctx.effect(tool, args, at_commit=True)`.

A transactional tool whose result is known before it runs (`Tool.commits_with_step`: db.upsert)
need not be performed when the step calls it: the call is validated, its result returned at
once, and the effect is written by the step's checkpoint, in its transaction — on PostgreSQL
inside the one commit statement (engine/commit_statement.py), with its WAL entry `done` and its
idempotency key. One transaction and one round trip instead of an effect transaction (BEGIN,
the write, its record, a flushed COMMIT) followed by the checkpoint. All or nothing: a step
that does not commit (it raised, it waits, its lease went, the process died) leaves no trace
of the effect, and the step's next run performs it again with the same key.

What the step gives up for it: it cannot read what the effect writes before its checkpoint,
and an effect that fails (a value its column refuses) fails at the commit, not at the call.
Such a failure is a failed attempt of the step (retried by its policy); the retries perform
the step's effects in place (`ctx.effect` as without at_commit), so its code sees the error.
A key an earlier execution recorded is not written again: the commit statement's fence refuses
it (no read on the way), and the step runs again with its effects in place, which returns the
recorded result (RecordedEarlier).
"""
from dataclasses import dataclass
from typing import Any

from ..models import WalEntry
from ..primitives.cancellation import CancellationToken
from ..primitives.errors import HarnessError
from ..tools.base import Tool, ToolError, validate_call
from ..tools.catalog import get_tool
from . import wal
from .lease import Lease

@dataclass
class EffectAtCommit:
    key: str
    step_id: str
    call_index: int
    tool: Tool
    args: dict
    result: Any


class RecordedEarlier(HarnessError):
    """A key of an effect at commit was recorded by an earlier execution of the step (one that
    performed it in place, then died before its checkpoint): the commit did not happen, and the
    step runs again with its effects in place, which returns the recorded result."""


def recorded_earlier(pending: list[EffectAtCommit]) -> bool:
    """After a commit whose fence failed: whether one of its effects' keys is recorded (the
    statement's fence refuses those; no read before, on the hot path)."""
    return WalEntry.objects.filter(idempotency_key__in=[e.key for e in pending]).exists()


class FailedAtCommit(HarnessError):
    """The step's checkpoint, with an effect performed at commit, was refused (by the database,
    or a value the tool could not convert): nothing of it was written."""


def defer(*, lease: Lease, step_id: str, call_index: int, tool_name: str, args: dict, generation: int,
          pending: list[EffectAtCommit]) -> tuple[bool, Any]:
    """(True, the tool's result) when the effect will be written with the step's checkpoint;
    (False, None) when the caller must perform it in place (too many values for one statement)."""
    tool = get_tool(tool_name)
    if not tool.commits_with_step:
        raise ToolError(f"{tool_name} cannot be performed at the step's commit (at_commit=True): only a "
                        f"transactional tool whose result is known before it runs can (db.upsert)")
    validate_call(tool, args)
    if not tool.fits_in_commit(args):
        return False, None
    key = wal.idempotency_key(lease.task_id, step_id, call_index, generation)
    result = tool.planned_result(args)
    pending.append(EffectAtCommit(key, step_id, call_index, tool, args, result))
    return True, result


def perform_in_transaction(lease: Lease, pending: list[EffectAtCommit]) -> None:
    """In the checkpoint's transaction (SQLite, or a PostgreSQL commit of more than one
    statement): each effect, then its record `done` and its key (fenced on the lease)."""
    if pending and recorded_earlier(pending):  # as the one statement's fence refuses them
        raise RecordedEarlier(f"step {pending[0].step_id}: an effect's key was recorded earlier")
    for effect in pending:
        try:
            effect.tool.perform(effect.args, key=effect.key, token=CancellationToken())
        except Exception as exc:  # the transaction rolls back: nothing of the checkpoint is written
            raise refused(exc, pending) from exc
        wal._record_done(lease, None, step_id=effect.step_id, call_index=effect.call_index, tool=effect.tool,
                         args=effect.args, key=effect.key, result=effect.result)


def refused(exc: Exception, pending: list[EffectAtCommit]) -> FailedAtCommit:
    names = ", ".join(sorted({effect.tool.name for effect in pending}))
    return FailedAtCommit(f"the step's checkpoint with {names} at commit was refused "
                          f"({type(exc).__name__}: {str(exc).strip()[:300]}); nothing of it was written, "
                          f"and the step's next attempt performs its effects in place")


def sql(pending: list[EffectAtCommit]) -> tuple[str, dict]:
    """The effects as common table expressions of the PostgreSQL commit statement (they follow
    its others), fenced on its `t`; their WAL entries and keys are the statement's
    (wal.done_sql, from records())."""
    parts, params = [], {}
    for index, effect in enumerate(pending):
        try:  # a value its column cannot take is refused here, before anything is sent
            body, values = effect.tool.commit_sql(effect.args, fence="EXISTS (SELECT 1 FROM t)", prefix=f"ac{index}_")
        except Exception as exc:
            raise refused(exc, pending) from exc
        parts.append(f", ac{index} AS ({body})")
        params.update(values)
    return "".join(parts), params


def records(pending: list[EffectAtCommit]) -> list[dict]:
    """The WAL entries the commit statement writes `done` for them (wal.done_parameter's `new`)."""
    return [{"key": e.key, "tool": e.tool.name, "result": e.result, "step_id": e.step_id, "call_index": e.call_index,
             "args": e.tool.wal_args(e.args), "idempotent": e.tool.is_idempotent(e.args)} for e in pending]
