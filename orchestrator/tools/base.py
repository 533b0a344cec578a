"""Side-effect tools. Each declares whether a call is idempotent (safe to replay after a
crash left it in doubt). Steps never call tools directly: they go through ctx.effect(),
which writes the WAL intent first (orchestrator/engine/wal.py)."""
from dataclasses import dataclass
from typing import Any, ClassVar

from ..primitives.cancellation import CancellationToken
from ..primitives.errors import HarnessError
from ..primitives.jsonlimits import nul_at


class ToolError(HarnessError):
    """The effect was *not performed*: the tool knows nothing reached the other side, or the
    other side refused before accepting anything (connection refused, DNS failure, an SMTP
    4xx/5xx to MAIL/RCPT/DATA, an HTTP response with an error status). Safe to retry."""


NotPerformed = ToolError


class OutcomeUnknown(HarnessError):
    """The request may have reached the other side and its answer never came (a timeout or
    reset after sending, a disconnect after SMTP DATA, cancellation while in flight).
    A non-idempotent effect in this state goes to review; nobody guesses.

    `evidence` is what the tool saw (the phase it was in, the error), for the reviewer."""

    def __init__(self, message: str, *, evidence: dict | None = None):
        super().__init__(message)
        self.evidence = evidence or {}


# A probe may take the time of one short request: recovery and the review queue wait for it.
PROBE_TIMEOUT_SECONDS = 5.0


@dataclass(frozen=True)
class ProbeResult:
    """What a tool's probe found out about an effect in doubt, by asking the other side:
    `done` (with the result the step expects from perform()), `not_done` (certainly never
    happened: it is performed again with the same key) or `unknown` (a reviewer decides).
    `how` says what was asked and what came back, for the record and the reviewer."""

    DONE: ClassVar[str] = "done"
    NOT_DONE: ClassVar[str] = "not_done"
    UNKNOWN: ClassVar[str] = "unknown"

    state: str
    how: str
    result: Any = None

    @classmethod
    def done(cls, result: Any, how: str) -> "ProbeResult":
        return cls(cls.DONE, how, result)

    @classmethod
    def not_done(cls, how: str) -> "ProbeResult":
        return cls(cls.NOT_DONE, how)

    @classmethod
    def unknown(cls, how: str) -> "ProbeResult":
        return cls(cls.UNKNOWN, how)

    @property
    def settled(self) -> bool:
        return self.state != self.UNKNOWN


class Tool:
    name: ClassVar[str]
    description: ClassVar[str] = ""
    idempotent: ClassVar[bool] = False
    # The effect is writes in the harness's own database: perform() runs inside the WAL's
    # transaction, so intent, effect and `done` commit together (engine/wal.py).
    transactional: ClassVar[bool] = False
    # A transactional tool whose result is known before it runs may be performed with the
    # step's checkpoint, in its transaction (ctx.effect(..., at_commit=True); engine/at_commit.py):
    # it implements planned_result() and commit_sql().
    commits_with_step: ClassVar[bool] = False

    def fits_in_commit(self, args: dict) -> bool:
        """Whether this call is small enough to ride in the step's commit statement (else it is
        performed in place)."""
        return True

    def planned_result(self, args: dict) -> Any:
        """What perform() returns for `args`, known before it runs (commits_with_step tools)."""
        raise NotImplementedError

    def commit_sql(self, args: dict, *, fence: str, prefix: str) -> tuple[str, dict]:
        """The effect as the body of one data-modifying CTE of the PostgreSQL step commit
        (commits_with_step tools): writes only where the SQL condition `fence` holds; its
        parameters are named, each name starting with `prefix`."""
        raise NotImplementedError

    def is_idempotent(self, args: dict) -> bool:
        """Whether replaying this call cannot duplicate its effect."""
        return self.idempotent

    def validate(self, args: dict) -> None:
        """Raise ToolError for arguments that can never work (before any intent is written)."""

    def perform(self, args: dict, *, key: str, token: CancellationToken) -> Any:
        raise NotImplementedError

    def wal_args(self, args: dict) -> dict:
        """What the WAL records of the arguments: all of them, unless they are bulky and the
        step can recompute them (a replay re-runs the step, not the WAL record)."""
        return args

    def confirmed_result(self, args: dict, *, key: str):
        """The result to record when a reviewer confirms the effect happened and gives none:
        the shape the step expects from perform()."""
        return {"confirmed_by_reviewer": True}

    def repeat_consequence(self, args: dict, *, idempotent: bool) -> str:
        """What performing this call again does, in an operator's words (revision previews)."""
        return "replays harmlessly (idempotent)" if idempotent else "will be performed again"

    def probe(self, args: dict, *, key: str) -> ProbeResult:
        """Ask the other side whether the call with `key` happened, without performing it:
        run by recovery and the review queue before a reviewer is asked (engine/wal.py,
        probe_entry). Must never perform the effect, and should answer within
        PROBE_TIMEOUT_SECONDS. `unknown` when the tool has no way to tell."""
        return ProbeResult.unknown(f"{self.name} has no probe: a reviewer decides")

    def evidence(self, args: dict, *, key: str) -> dict | None:
        """What the tool can tell a reviewer about whether `key` happened (None: nothing)."""
        return None


_TOOLS: dict[str, Tool] = {}


def validate_call(tool: Tool, args: dict) -> None:
    """tool.validate(args), then no NUL character in them: their intent could not be stored
    (PostgreSQL stores none), so the call is refused before anything is written or performed."""
    tool.validate(args)
    where = nul_at(args)
    if where is not None:
        raise ToolError(f"the arguments of {tool.name} hold the NUL character (U+0000) in {where}, which "
                        f"cannot be stored: remove it")


def register(cls: type[Tool]) -> type[Tool]:
    """A tool class's decorator: one instance of it is the tool `cls.name` (tools/catalog.py finds it)."""
    _TOOLS[cls.name] = cls()
    return cls
