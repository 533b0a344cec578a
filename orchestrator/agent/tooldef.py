"""Tools written as functions: what `@tool` (orchestrator.sdk) builds, and the AgentTool an
agent is offered.

A tool is a function `fn(args: SomeModel, call: ToolCall)`: the pydantic model is the JSON
schema the model sees and what validates its arguments; ToolCall carries the call's idempotency
key, its cancellation token, its deadline, the task and the step. `@tool` registers two things:

- the agent's entry (AgentTool): a `read_only` tool runs at once, in the step, with no WAL entry;
  any other runs as `ctx.effect(name, args)` — through the WAL with the call's key, exactly like
  the built-in side effects (approval by default for `non_idempotent`, an unknown outcome goes to
  review, a kill -9 is settled by recovery);
- for every class but `read_only`, a WAL tool of the same name (tools/base.py `register`), so
  `ctx.effect(name, ...)` from any step, the recovery sweeper and the review queue (probes) find it.

`timeout` is enforced: the body runs in a thread of its own, the call's token is cancelled at the
deadline, and a body still running TIMEOUT_GRACE_SECONDS later is given up on — its outcome is
unknown (OutcomeUnknown: retried with the same key when the class is idempotent or keyed, reviewed
otherwise); a read that overruns is an error the model reads. Python cannot kill a thread: a body
that ignores its token goes on until it returns, and what it returns then is dropped.

Tools defined outside the core are offered only while the module that defines them is configured
(ORCH_EXTENSIONS or ORCH_EXTRA_TASK_TYPES, orchestrator/extensions.py).
"""
import copy
import functools
import inspect
import re
import threading
import time
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from django.db import connection
from pydantic import BaseModel, ValidationError
from pydantic_core import to_jsonable_python

from .. import extensions
from ..engine.wal_terms import key_parts
from ..models import EffectClass
from ..primitives.cancellation import CancellationToken, Cancelled
from ..primitives.faults import fault_point_for_key
from ..tools.base import PROBE_TIMEOUT_SECONDS, OutcomeUnknown, ProbeResult, Tool, ToolError, register
from ..primitives.errors import HarnessError

READ_ONLY, IDEMPOTENT, KEYED, NON_IDEMPOTENT = (EffectClass.READ_ONLY.value, EffectClass.IDEMPOTENT.value,
                                                EffectClass.KEYED.value, EffectClass.NON_IDEMPOTENT.value)
EFFECT_CLASSES = (READ_ONLY, IDEMPOTENT, KEYED, NON_IDEMPOTENT)
# How long a body whose deadline passed gets to notice its cancelled token before it is given up on.
TIMEOUT_GRACE_SECONDS = 1.0
# The Chat Completions protocol allows [a-zA-Z0-9_-] in a function name, 64 at most; "__" is left
# to MCP servers' tools (<server>__<tool>).
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class InvalidArguments(HarnessError, ValueError):
    """The model's arguments do not fit the tool's schema (the message names each problem)."""


@functools.cache
def _args_schema(args: type[BaseModel]) -> dict:
    """The JSON schema of an `Args` model, made once per class (pydantic builds it anew on each
    call: a few ms per tool per agent turn, bench/agent.py). Callers get a copy."""
    parameters = args.model_json_schema()
    parameters.pop("title", None)
    return parameters


@dataclass(frozen=True)
class AgentTool:
    name: str
    description: str
    Args: type[BaseModel] | None  # None when `parameters` gives the schema
    run: Callable[[Any, Any], Any]  # (step context, validated args) -> JSON-serialisable result
    # read_only: no WAL entry; idempotent: replay is safe; keyed: the idempotency key travels to the
    # other side, which drops repeats; non_idempotent: needs a reviewer by default, and an unknown
    # outcome goes to review. Missing means non_idempotent (fail closed).
    effect: str = NON_IDEMPOTENT
    # Reaches the worker's host or the harness's database: enabled per installation
    # (ORCH_AGENT_HOST_TOOLS) and granted per task by an admin only.
    reaches_host: bool = False
    # A JSON schema given as is, instead of `Args` (an MCP server's inputSchema, agent/mcp.py):
    # the arguments are checked against it and `run` gets them as a dict.
    parameters: dict | None = None

    @property
    def side_effect(self) -> bool:
        return self.effect != READ_ONLY

    def parameters_schema(self) -> dict:
        """The JSON schema of the arguments."""
        if self.parameters is not None:
            return dict(self.parameters)
        return copy.deepcopy(_args_schema(self.Args))

    def schema(self) -> dict:
        """The tool as offered to the model (Chat Completions `tools` entry)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters_schema()}}

    def parse(self, arguments) -> Any:
        """The model's arguments, validated: an `Args` instance, or with `parameters` the dict
        itself; InvalidArguments saying what is wrong when they do not fit."""
        if self.parameters is None:
            try:
                return self.Args.model_validate(arguments)
            except ValidationError as exc:
                raise InvalidArguments("; ".join(f"{'.'.join(map(str, e['loc'])) or 'arguments'}: {e['msg']}"
                                                 for e in exc.errors()[:5])) from None
        import jsonschema  # the mcp package's dependency; only tools with a JSON schema need it

        try:
            validator = jsonschema.validators.validator_for(self.parameters)
            validator.check_schema(self.parameters)
        except jsonschema.SchemaError:
            validator = None  # a schema that is itself wrong: the other side checks what it gets
        if not isinstance(arguments, dict):
            raise InvalidArguments("arguments: expected a JSON object")
        if validator is not None:
            errors = sorted(validator(self.parameters).iter_errors(arguments), key=lambda e: list(e.absolute_path))
            if errors:
                raise InvalidArguments("; ".join(f"{'.'.join(map(str, e.absolute_path)) or 'arguments'}: {e.message}"
                                                 for e in errors[:5]))
        return arguments


@dataclass(frozen=True)
class ToolCall:
    """What a tool's body (and its probe) knows of the call besides its arguments."""

    key: str | None  # the idempotency key, the same on every replay; None for a read (no WAL entry)
    token: CancellationToken  # cancelled by Stop, Pause's cut, a preempt, and the tool's own timeout
    deadline: float | None  # time.monotonic() at which the call is given up on (None: no timeout)
    task_id: int | None
    step_id: str | None

    def seconds_left(self) -> float | None:
        """Seconds before the deadline (None: no deadline): a timeout to give a client."""
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def raise_if_cancelled(self) -> None:
        """Raise Cancelled if the call was cancelled: call it before sending anything (a body that
        raises Cancelled tells the WAL nothing was performed)."""
        self.token.raise_if_cancelled()


@dataclass(frozen=True)
class ToolDefinition:
    name: str
    fn: Callable[[BaseModel, ToolCall], Any]
    Args: type[BaseModel]
    effect: str
    description: str
    timeout: float | None
    probe: Callable[[BaseModel, ToolCall], ProbeResult] | None
    reaches_host: bool
    module: str
    granted_by_default: bool = False  # a read an agent created with only a goal gets (toolbox.safe_default)
    agent_tool: AgentTool = field(init=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "agent_tool", AgentTool(self.name, self.description, self.Args, self.run_in_step,
                                                         effect=self.effect, reaches_host=self.reaches_host))

    @property
    def origin(self) -> str:
        return f"{self.module}.{getattr(self.fn, '__qualname__', self.fn)}"

    def run_in_step(self, ctx, args: BaseModel) -> Any:
        """The call from a step (an agent's, or a task type's through sdk.call_tool): a read at
        once, in this step; anything else through the WAL with the call's key."""
        if self.effect != READ_ONLY:
            return ctx.effect(self.name, args.model_dump(mode="json"))
        parent = ctx.token if ctx is not None else CancellationToken(f"read:{self.name}")
        return _jsonable(run_bounded(self, args, parent, key=None, task_id=getattr(ctx, "task_id", None),
                                     step_id=getattr(ctx, "step_id", None)))


def _jsonable(value: Any) -> Any:
    # What the WAL and the step record: JSON. A value JSON cannot hold is kept as its text rather
    # than failing the checkpoint of an effect that happened.
    return to_jsonable_python(value, fallback=str)


class FunctionTool(Tool):
    """The WAL side of a decorated function (every class but read_only): one subclass per tool,
    made by define(), with its `definition`."""

    definition: typing.ClassVar[ToolDefinition]

    def is_idempotent(self, args: dict) -> bool:
        return self.definition.effect in (IDEMPOTENT, KEYED)

    def parse(self, args: dict) -> BaseModel:
        try:
            return self.definition.Args.model_validate(args)
        except ValidationError as exc:
            raise ToolError(f"{self.name}: invalid arguments: {exc}") from None

    def validate(self, args: dict) -> None:
        self.parse(args)

    def perform(self, args: dict, *, key: str, token: CancellationToken) -> Any:
        task_id, step_id, _ = key_parts(key)
        result = run_bounded(self.definition, self.parse(args), token, key=key, task_id=task_id, step_id=step_id)
        fault_point_for_key("during_effect", key)  # it happened; the process may die before the WAL knows
        return _jsonable(result)

    def probe(self, args: dict, *, key: str) -> ProbeResult:
        ask = self.definition.probe
        if ask is None:
            return super().probe(args, key=key)
        task_id, step_id, _ = key_parts(key)
        probe = ToolDefinition(f"{self.name} (probe)", ask, self.definition.Args, READ_ONLY, "",
                               PROBE_TIMEOUT_SECONDS, None, False, self.definition.module)
        try:
            found = run_bounded(probe, self.parse(args), CancellationToken(f"probe:{self.name}"), key=key,
                                task_id=task_id, step_id=step_id)
        except ToolError as exc:
            return ProbeResult.unknown(f"{self.name}'s probe could not tell ({exc}): a reviewer decides")
        if not isinstance(found, ProbeResult):
            return ProbeResult.unknown(f"{self.name}'s probe answered {type(found).__name__}, not a ProbeResult: "
                                       f"a reviewer decides")
        return ProbeResult(found.state, found.how, _jsonable(found.result))


def run_bounded(definition: ToolDefinition, args: BaseModel, parent: CancellationToken, *, key: str | None,
                task_id: int | None, step_id: str | None) -> Any:
    """Run the body under a child of `parent` (so Stop, a cut or a preempt cancel it too) and, with a
    timeout, in a thread of its own that is given up on at the deadline (see the module's doc)."""
    token = parent.child(f"tool:{definition.name}")
    seconds = definition.timeout
    deadline = None if seconds is None else time.monotonic() + seconds
    call = ToolCall(key=key, token=token, deadline=deadline, task_id=task_id, step_id=step_id)
    try:
        with token.track("tool", definition.name):
            if seconds is None:
                return _settle(definition, parent, token, lambda: definition.fn(args, call))
            return _settle(definition, parent, token, lambda: _in_thread(definition, args, call, seconds))
    finally:
        parent.discard_child(token)


def _in_thread(definition: ToolDefinition, args: BaseModel, call: ToolCall, seconds: float) -> Any:
    outcome: dict[str, Any] = {}
    finished = threading.Event()

    def body():
        try:
            outcome["result"] = definition.fn(args, call)
        except BaseException as exc:  # handed to the caller, below
            outcome["error"] = exc
        finally:
            finished.set()
            connection.close()  # this thread's own database connection, if the body opened one

    thread = threading.Thread(target=body, name=f"tool:{definition.name}", daemon=True)
    thread.start()
    if not finished.wait(seconds):
        call.token.cancel(f"{definition.name} timed out after {seconds:g} s")
        if not finished.wait(TIMEOUT_GRACE_SECONDS):
            evidence = {"timeout_seconds": seconds, "phase": "the tool's body was still running at its deadline"}
            if definition.effect == READ_ONLY:
                raise ToolError(f"{definition.name} did not answer within its timeout of {seconds:g} s")
            raise OutcomeUnknown(f"{definition.name} was still running when its timeout of {seconds:g} s passed: "
                                 f"whether it took effect is unknown", evidence=evidence)
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("result")


def _settle(definition: ToolDefinition, parent: CancellationToken, token: CancellationToken, run) -> Any:
    try:
        return run()
    except Cancelled:
        if parent.cancelled:
            raise  # Stop, a cut or a preempt: the engine's own cancellation
        # Only the tool's deadline: the body gave up before sending anything (that is what raising
        # Cancelled says), so nothing was performed and a retry is safe.
        raise ToolError(f"{definition.name} gave up at its timeout ({token.reason}) before performing anything") \
            from None


# --- the registry of tools defined outside the core ------------------------------------------
_DEFINED: dict[str, ToolDefinition] = {}
_RESERVED: set[str] = set()  # the built-in agent tools' names (toolbox.py)
_lock = threading.Lock()


def reserve(names) -> None:
    """Names a decorated tool may not take (the built-ins)."""
    _RESERVED.update(names)


def tool(name: str, *, effect: str | None = None, description: str = "", timeout: float | None = None,
         probe: Callable[[BaseModel, ToolCall], ProbeResult] | None = None, reaches_host: bool = False,
         granted_by_default: bool = False):
    """Declare `fn(args: Model, call: ToolCall)` a tool an agent may be granted and a step may
    call (orchestrator.sdk; docs/extending.md). Errors in the declaration raise here, at import.
    `granted_by_default`: an agent created with only a goal gets it, as the built-in reads — for
    a read_only tool that reaches neither the host nor the outside, never anything else."""
    effect_class = effect_of(name, effect)
    if granted_by_default and (effect_class != READ_ONLY or reaches_host):
        raise ValueError(f"tool {name!r}: only a read_only tool that does not reach the host can be granted by "
                         f"default (side effects and host tools must be named, and granted)")
    if not isinstance(name, str) or not NAME.match(name) or "__" in name:
        raise ValueError(f"tool name {name!r}: letters, digits, _ and - only, 64 at most, no '__' (kept for MCP "
                         f"servers' tools)")
    if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"tool {name!r}: timeout must be a positive number of seconds, or None")
    if probe is not None and not callable(probe):
        raise TypeError(f"tool {name!r}: probe must be a function (args, call) -> ProbeResult")
    if probe is not None and effect_class == READ_ONLY:
        raise ValueError(f"tool {name!r}: a read_only tool has no WAL entry, so nothing to probe")

    def decorate(fn):
        definition = ToolDefinition(name, fn, argument_model(name, fn), effect_class,
                                    description or inspect.getdoc(fn) or "", float(timeout) if timeout else None,
                                    probe, bool(reaches_host), fn.__module__, bool(granted_by_default))
        define(definition)
        fn.tool_definition = definition
        return fn

    return decorate


def effect_of(name: str, effect) -> str:
    if effect is None:
        return NON_IDEMPOTENT  # fail closed: an undeclared tool is treated as the most dangerous
    value = getattr(effect, "value", effect)
    if value not in EFFECT_CLASSES:
        raise ValueError(f"tool {name!r}: unknown effect {effect!r}; one of {', '.join(EFFECT_CLASSES)}")
    return value


def argument_model(name: str, fn) -> type[BaseModel]:
    """The pydantic model of `fn`'s first parameter; its second must be there (the ToolCall)."""
    if not callable(fn):
        raise TypeError(f"tool {name!r}: @tool decorates a function")
    parameters = list(inspect.signature(fn).parameters.values())
    if len(parameters) != 2:
        raise TypeError(f"tool {name!r}: the function takes (args, call): its arguments as a pydantic model, then "
                        f"the ToolCall; it takes {len(parameters)} parameter(s)")
    try:
        hints = typing.get_type_hints(fn)
    except Exception as exc:
        raise TypeError(f"tool {name!r}: its annotations cannot be resolved ({exc})") from None
    model = hints.get(parameters[0].name)
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        raise TypeError(f"tool {name!r}: annotate its first parameter ({parameters[0].name}) with a pydantic "
                        f"BaseModel: its JSON schema is what the model sees")
    return model


def builtin_read(name: str, *, description: str, reaches_host: bool = False):
    """A built-in read tool (toolbox.py) written like a decorated one, kept out of the registry:
    `fn(args, call)` becomes an AgentTool."""

    def decorate(fn) -> AgentTool:
        return ToolDefinition(name, fn, argument_model(name, fn), READ_ONLY, description, None, None, reaches_host,
                              fn.__module__).agent_tool

    return decorate


def define(definition: ToolDefinition) -> None:
    with _lock:
        if definition.name in _RESERVED:
            raise ValueError(f"tool {definition.name!r} is a built-in tool's name")
        earlier = _DEFINED.get(definition.name)
        if earlier is not None and earlier.origin != definition.origin:
            raise ValueError(f"tool {definition.name!r} is already defined by {earlier.origin}")
        _DEFINED[definition.name] = definition
        if definition.effect != READ_ONLY:
            register(type(f"FunctionTool_{definition.name}", (FunctionTool,), {
                "name": definition.name, "description": definition.description, "definition": definition,
                "idempotent": definition.effect in (IDEMPOTENT, KEYED)}))


def find(name: str) -> AgentTool | None:
    """A decorated tool by name, while the module that defines it is configured."""
    extensions.load()
    definition = _DEFINED.get(name)
    if definition is None or not extensions.configured(definition.module):
        return None
    return definition.agent_tool


def names() -> list[str]:
    extensions.load()
    return sorted(n for n, d in list(_DEFINED.items()) if extensions.configured(d.module))


def granted_by_default() -> list[str]:
    """The configured decorated tools an agent created with only a goal gets."""
    extensions.load()
    return sorted(n for n, d in list(_DEFINED.items()) if d.granted_by_default and extensions.configured(d.module))
