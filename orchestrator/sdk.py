"""The authoring API: all a tool or task-type author imports (docs/extending.md).

    from orchestrator.sdk import KEYED, ProbeResult, StepSpec, TaskType, ToolCall, register_task_type, tool

Nothing in the harness imports this module: it is the door in, and what it exports is what the
harness keeps stable. The modules that use it are named in ORCH_EXTENSIONS (comma-separated
dotted paths) and imported by every process at start-up; one that cannot be imported stops the
start with its name (system check orchestrator.E030).

Tools. `@tool(name, effect=..., description=..., timeout=..., probe=..., reaches_host=False)` over
`fn(args: YourModel, call: ToolCall)`: the pydantic model's JSON schema is what the model sees
and what validates its arguments; `call` has the idempotency key, the cancellation token, the
deadline, the task and the step. Effect classes:

- READ_ONLY: runs at once when an agent calls it, no WAL entry;
- IDEMPOTENT: a replay is harmless (a PUT, a set);
- KEYED: the other side drops repeats of `call.key` (send it along); replayed with the same key;
- NON_IDEMPOTENT (the default: a missing effect fails closed): an agent's call waits for a reviewer
  unless an admin waived it; an unknown outcome goes to review, never replayed.

Every class but READ_ONLY runs through the WAL, exactly like the built-in side effects. `probe`
(args, call) -> ProbeResult asks the other side whether the call with `call.key` happened,
without doing it: recovery and the review queue ask it before a reviewer. `timeout` (seconds)
is enforced: the token is cancelled at the deadline, and a body still running is given up on
(OutcomeUnknown for a side effect, an error the model reads for a read).

Task types: subclass TaskType, decorate it with @register_task_type; a step calls a tool with
`call_tool(ctx, name, args)` (or `ctx.effect(name, args)` for a side effect).

Resuming after a deploy: a paused task remembers the code it ran against — the type's `version`
(a string, "1" by default: raise it when a change breaks what a paused task holds), a digest of
its `plan` function, and the schemas of the tools named in `uses_tools` (an agent's prompts,
model and granted tools too). A resume on different code follows `on_incompatible_resume`
(RESUME_POLICIES): "ask" (the default: the operator sees the differences and accepts them),
"pin" (refused) or "migrate" (`migrate(self, params, differences) -> params`). Extend
`compat_fingerprint(self, params)` (call super()) with digests of your own.
"""
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel

from .agent import toolbox  # the built-ins' names are reserved before any extension's tool is declared
from .agent import tooldef
from .agent.tooldef import ToolCall, tool
from .engine.signals import LimitExceeded, WaitTimedOut
from .models import EffectClass
from .primitives.cancellation import CancellationToken, Cancelled
from .primitives.errors import HarnessError, StepSignal
from .tasktypes import register as _register
from .tasktypes.base import FAILURE_POLICIES, RESUME_POLICIES, StepSpec, TaskType
from .tools.base import NotPerformed, OutcomeUnknown, ProbeResult, ToolError

READ_ONLY = EffectClass.READ_ONLY
IDEMPOTENT = EffectClass.IDEMPOTENT
KEYED = EffectClass.KEYED
NON_IDEMPOTENT = EffectClass.NON_IDEMPOTENT

__all__ = [
    "TaskType", "StepSpec", "FAILURE_POLICIES", "RESUME_POLICIES", "register_task_type", "task_type", "StepContext",
    "READ_ONLY", "IDEMPOTENT", "KEYED", "NON_IDEMPOTENT", "EffectClass", "tool", "ToolCall", "call_tool",
    "ToolError", "NotPerformed", "OutcomeUnknown", "ProbeResult", "Cancelled", "CancellationToken",
    "WaitTimedOut", "LimitExceeded", "HarnessError", "StepSignal",
]


@runtime_checkable
class StepContext(Protocol):
    """What `TaskType.run_step(ctx, step_id)` receives (the engine's orchestrator/engine/context.py
    implements it; a test checks the two agree)."""

    task_id: int
    step_id: str
    generation: int  # how many times the step was invalidated by an edit (part of its effects' keys)
    params: Any  # the task's params (the type's Params), read-only; the keys read are recorded
    deps: dict[str, Any]  # the results of the steps this one depends on, by step id
    skipped: dict[str, str]  # dependencies that were skipped, with why (their deps entry is None)
    token: CancellationToken  # cancelled by Stop, a Pause's cut, a preempt, the step's timeout

    def effect(self, tool: str, args: dict, *, at_commit: bool = False) -> Any:
        """Perform a side effect through the WAL (intent, effect with the call's idempotency key,
        `done` with the step's checkpoint); returns the tool's result, recorded and replayed.
        `at_commit` (db.upsert): written by the step's checkpoint, in its transaction, instead of
        now; the step cannot read it before then (docs/recovery.md, "Effects at commit")."""

    def wait_for(self, event_type: str, *, timeout: float | None = None, match: dict | None = None) -> dict:
        """The payload of the next `event_type` event sent into the task (declare it in the type's
        `awaited_event_types`); the task waits holding no worker until it comes. Raises
        WaitTimedOut after `timeout` seconds (kept across restarts)."""

    def request_approval(self, tool: str, arguments: dict, *, context: str = "", call_id: str = "",
                         reason: str = "") -> dict:
        """Wait for a reviewer to approve `tool(arguments)`: {"approved", "note", "arguments", ...}."""

    def add_steps(self, *specs: StepSpec) -> None:
        """Grow the plan: the specs join the task when this step commits."""

    def progress(self, message: str, **data) -> None:
        """A progress event in the task's log, shown live."""

    def sleep(self, seconds: float) -> None:
        """Wait, waking (and raising Cancelled) at once when cancelled."""

    def tokens_left(self) -> int:
        """What is left of the task's max_tokens budget."""

    def use_tokens(self, count: int) -> None:
        """Count LLM tokens against the task's max_tokens."""

    def interrupt_requested(self) -> bool:
        """Whether the step should stop what it streams (cancelled, or a Pause was asked)."""

    def run_subprocess(self, argv: list[str], *, cwd: str | None = None, env: dict | None = None,
                       timeout: float | None = None) -> Any:
        """A subprocess for pure computation, killed with its process group on cancel."""

    def http(self, method: str, url: str, **args) -> dict:
        """A read-only HTTP request, aborted on cancel (a side effect goes through effect())."""

    def llm_stream(self, url: str, payload: dict, timeout: float = 60) -> Iterator[str]:
        """Stream an LLM completion, each chunk counted against max_tokens."""

    def spawn(self, fn: Callable[[Any], Any], *, name: str = "") -> Future:
        """Run `fn(subtask_ctx)` concurrently under a child token (max_subtasks counts it)."""


def register_task_type(cls: type[TaskType]) -> type[TaskType]:
    """Class decorator: make a TaskType subclass a task type (the API's task types, the new-task
    form, the workers). Its module must be in ORCH_EXTENSIONS (or inside one that is)."""
    if not (isinstance(cls, type) and issubclass(cls, TaskType)):
        raise TypeError(f"register_task_type decorates a TaskType subclass, not {cls!r}")
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name.strip():
        raise TypeError(f"{cls.__qualname__}: set `name` (e.g. 'tickets.escalate')")
    params = getattr(cls, "Params", None)
    if not (isinstance(params, type) and issubclass(params, BaseModel)):
        raise TypeError(f"{cls.__qualname__}: set `Params` to a pydantic BaseModel (the new-task form and the API "
                        f"are generated from it)")
    if cls.on_step_failure not in FAILURE_POLICIES:
        raise ValueError(f"{cls.__qualname__}: on_step_failure must be one of {', '.join(FAILURE_POLICIES)}")
    # The compatibility gate of a resume after a deploy (docs/extending.md "Versions and resuming").
    if cls.on_incompatible_resume not in RESUME_POLICIES:
        raise ValueError(f"{cls.__qualname__}: on_incompatible_resume must be one of {', '.join(RESUME_POLICIES)}")
    if cls.on_incompatible_resume == "migrate" and cls.migrate is TaskType.migrate:
        raise TypeError(f"{cls.__qualname__}: on_incompatible_resume = 'migrate' needs a migrate(params, "
                        f"differences) method")
    if not isinstance(cls.version, str) or not cls.version.strip():
        raise TypeError(f"{cls.__qualname__}: `version` is a non-empty string (e.g. '2')")
    if isinstance(cls.uses_tools, str) or not all(isinstance(n, str) for n in cls.uses_tools):
        raise TypeError(f"{cls.__qualname__}: `uses_tools` is a tuple of tool names")
    return _register(cls)


task_type = register_task_type


def call_tool(ctx: StepContext, name: str, args: dict | BaseModel) -> Any:
    """From a step: call the tool `name` — yours (@tool), a built-in agent tool (`email_send`...) or
    an MCP server's (`<server>__<tool>`) — with `args`: a read at once, a side effect through the
    WAL with this step's next idempotency key. No approval is asked (a task type is the
    installation's own code; ctx.request_approval asks one). Raises ToolError when there is no such
    tool now or the arguments do not fit its schema."""
    found = toolbox.find_tool(name)
    if found is None:
        raise ToolError(f"there is no tool {name!r} (is its module in ORCH_EXTENSIONS?)")
    data = args.model_dump(mode="json") if isinstance(args, BaseModel) else args
    try:
        parsed = found.parse(data)
    except tooldef.InvalidArguments as exc:
        raise ToolError(f"{name}: invalid arguments: {exc}") from None
    return found.run(ctx, parsed)
