"""The WAL protocol's terms (engine/wal.py is the protocol): an effect's idempotency key, and
what a call of ctx.effect can end as. Callers name them through `wal` too."""
from dataclasses import dataclass
from typing import Any

from ..models import WalEntry
from ..primitives.errors import HarnessError, StepSignal


class AmbiguousEffect(StepSignal):
    """A non-idempotent effect may or may not have happened: a human must decide.

    `reason` says why nobody knows (for the review item); `evidence` is what the tool saw."""

    def __init__(self, entry: WalEntry, *, reason: str = "", evidence: dict | None = None):
        super().__init__(f"{entry.tool} with key {entry.idempotency_key} may or may not have happened")
        self.entry = entry
        self.reason = reason or (
            f"The step was retried and found this {entry.tool} intent still pending: an earlier attempt "
            f"(worker {entry.worker}) failed after writing the intent, so whether the effect happened is unknown.")
        self.evidence = evidence or {}


class EffectFailed(HarnessError):
    """The tool reported a failure; the WAL entry is (or will be) marked failed."""

    def __init__(self, entry_id: int, error: Exception):
        super().__init__(str(error))
        self.entry_id, self.error = entry_id, error


@dataclass
class CompletedEffect:
    """An effect that happened and whose `done` is committed with the step checkpoint
    (`committed`: already recorded done, in the effect's own transaction)."""

    entry_id: int
    key: str
    tool: str
    result: Any
    committed: bool = False


def idempotency_key(task_id: int, step_id: str, call_index: int, generation: int = 0) -> str:
    """Deterministic: the same step, generation and call give the same key on every replay."""
    step = f"{step_id}@{generation}" if generation else step_id
    return f"t{task_id}:{step}:{call_index}"


def key_parts(key: str) -> tuple[int | None, str | None, int | None]:
    """(task id, step id, call index) of a key made by idempotency_key; Nones for any other."""
    task, _, rest = key.partition(":")
    step, _, index = rest.rpartition(":")
    if not (task.startswith("t") and task[1:].isdigit() and step and index.isdigit()):
        return None, None, None
    return int(task[1:]), step.rsplit("@", 1)[0], int(index)
