"""The tools an agent may call: each has a pydantic argument model, which is both the JSON
schema the model sees and what validates the model's arguments (a bad call goes back to
the model as an error message, never a crash).

Tools with a side effect run through the WAL (`ctx.effect`, with the call's idempotency
key): `db_upsert`, `email_send`, `http_request`, `shell_run`, `memory_write`. The others only read:
`db_query` (SELECT only, on the allowed tables, as a read-only
role: tools/dbread.py), `memory_search` (long-term memory, a store of its own, scoped to the task's
owner: never copied into a snapshot).

Least privilege (docs/agent.md, "Security model"): each tool declares its effect class and whether it
reaches the host or the database. An agent created with only a goal gets SAFE_DEFAULT (read-only,
nothing of the host); a side-effect tool must be named; a host tool must be enabled by the
installation (ORCH_AGENT_HOST_TOOLS) and granted by an admin; a non-idempotent call waits for a
reviewer unless an admin waived that for the task (`needs_approval`).

Names use `_` because the Chat Completions protocol allows only [a-zA-Z0-9_-] in a
function name.
"""
import fnmatch
import json
import re
from typing import Any, Callable, Literal

from django.conf import settings
from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..engine.wal import EffectFailed
from ..engine.results import result_of
from ..models import Step, StepStatus
from ..primitives.redaction import redact
from ..tools.base import OutcomeUnknown, ToolError
from ..tools.dbread import read_only_query
from . import memory, tooldef
from .tooldef import IDEMPOTENT, KEYED, NON_IDEMPOTENT, READ_ONLY, AgentTool, ToolCall, builtin_read
from ..primitives.errors import HarnessError

__all__ = ["AgentTool", "READ_ONLY", "IDEMPOTENT", "KEYED", "NON_IDEMPOTENT", "TOOLS", "add_source", "find_tool",
           "known_names", "needs_approval", "call", "as_message_text", "ToolCallError"]

# A page of result_read at most (the model asks for less or more, within this): below the default
# ORCH_AGENT_RESULT_INLINE_CHARS, so a page is never itself shortened.
READ_PAGE_CHARACTERS = 6000
TOOL_STEP = re.compile(r"^tool-\d{1,6}-\d{1,4}$")
# The end of a shortened result, where the model learns how to read on (history.py looks for it).
SHORTENED_MARK = "more characters not shown: the whole result is kept"
QUERY_ROWS = 100


class DbQueryArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    sql: str = Field(..., min_length=1, max_length=5000, description="one SELECT statement")


class MemorySearchArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    query: str = Field(..., min_length=1, max_length=500)


class MemoryWriteArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    key: str = Field(..., min_length=1, max_length=150, description="what the fact is about")
    body: str = Field(..., min_length=1, max_length=20_000, description="the fact")

    @field_validator("key")
    @classmethod
    def _stays_in_its_scope(cls, key: str) -> str:
        # A named agent's scope is "<owner>/@<name>/": a key starting with @ would write into it.
        if key.startswith(memory.NAMED):
            raise ValueError(f"a key may not start with {memory.NAMED!r}")
        return key


class EmailSendArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    to: list[str] = Field(..., min_length=1, max_length=20, description="recipient addresses")
    subject: str = Field(..., min_length=1, max_length=300)
    body: str = Field(..., min_length=1, max_length=50_000)


class HttpRequestArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    method: Literal["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE"] = "GET"
    url: str = Field(..., pattern=r"^https?://", max_length=2000)
    json_body: dict | list | None = Field(None, description="a JSON body to send")


class DbUpsertArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    table: Literal["demo_contract_extraction", "demo_destination"] = Field(..., description="the table to write")
    columns: list[str] = Field(..., min_length=1, max_length=20, description="its columns, the primary key included")
    rows: list[list] = Field(..., min_length=1, max_length=500, description="rows, values in the columns' order")


class ShellRunArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    argv: list[str] = Field(..., min_length=1, max_length=50, description="the program and its arguments")
    timeout: float = Field(60, gt=0, le=600)


# The read tools are written as an extension's would be (tooldef.py, orchestrator.sdk's @tool):
# `fn(args, call)`, run at once in the step, no WAL entry. The side-effect tools below stay
# adapters onto the WAL tools of tools/ (email.send, http.request, ...), whose names, arguments,
# probes and records other task types share.
@builtin_read("db_query", description="Run one read-only SELECT on the tables it may read (at most 100 rows come "
                                      "back).", reaches_host=True)
def _db_query(args: DbQueryArgs, call: ToolCall):
    # Only the allowed tables, as a read-only role (PostgreSQL) or under an authorizer (SQLite).
    return read_only_query(args.sql, max_rows=QUERY_ROWS)


class ResultReadArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ref: str = Field(..., max_length=40, description="the reference a shortened tool result gave, e.g. tool-003-1")
    offset: int = Field(0, ge=0, description="the first character to read")
    limit: int = Field(READ_PAGE_CHARACTERS, ge=1, le=READ_PAGE_CHARACTERS, description="how many characters")


@builtin_read("result_read", description="Read on in a tool result that was too long to show whole: give the ref it "
                                         "ended with, and an offset.")
def _result_read(args: ResultReadArgs, call: ToolCall):
    # Only this task's own tool results: what its tools already returned to it, nothing more.
    step = (Step.objects.filter(task_id=call.task_id, step_id=args.ref, status=StepStatus.DONE).first()
            if call.task_id and TOOL_STEP.match(args.ref) else None)
    if step is None:
        raise ToolCallError(f"there is no tool result {args.ref!r} in this task: give the ref a shortened result "
                            f"ended with")
    record = result_of(step)  # the tool step's record: {"tool_call_id", "name", "ok", "result"}
    text = message_text(record.get("result") if isinstance(record, dict) and "result" in record else record)
    if args.offset >= len(text):
        raise ToolCallError(f"{args.ref} has {len(text)} characters: offset {args.offset} is past its end")
    page = text[args.offset:args.offset + args.limit]
    end = args.offset + len(page)
    more = f' Read on with result_read(ref="{args.ref}", offset={end}).' if end < len(text) else " That is the end."
    return f"[{args.ref}: characters {args.offset}-{end} of {len(text)}.{more}]\n{page}"


# Offered to an agent only once its dialog holds a shortened result (tasktypes/agent.py), and always
# allowed: it reads nothing the task's own tools did not already return to it.
IMPLICIT = ("result_read",)


@builtin_read("memory_search", description="Search the long-term memory (facts kept across tasks).")
def _memory_search(args: MemorySearchArgs, call: ToolCall):
    scope = memory.scope_of(call.task_id)
    return {"facts": [{"key": m.key[len(scope):], "value": m.value[:2000]}
                      for m in memory.search(scope, args.query, 20)]}


def _memory_write(ctx, args: MemoryWriteArgs):
    ctx.effect("db.upsert", {"table": "agent_memory", "columns": ["key", "value", "task_id", "step_id"],
                             "rows": [[memory.scope_of(ctx.task_id) + args.key, args.body, ctx.task_id,
                                       ctx.step_id]]})
    return {"stored": args.key}


def _email_send(ctx, args: EmailSendArgs):
    return ctx.effect("email.send", {"to": args.to, "subject": args.subject, "body": args.body})


def _http_request(ctx, args: HttpRequestArgs):
    # The egress policy (tools/egress.py): no loopback, private, link-local or metadata address
    # unless ORCH_HTTP_ALLOW lists it; every redirect checked again; sizes and time capped.
    call = {"method": args.method, "url": args.url, "egress": "policy"}
    if args.json_body is not None:
        call["json"] = args.json_body
    return ctx.effect("http.request", call)


def _db_upsert(ctx, args: DbUpsertArgs):
    return ctx.effect("db.upsert", {"table": args.table, "columns": args.columns, "rows": args.rows})


def _shell_run(ctx, args: ShellRunArgs):
    # Always in the sandbox (tools/sandbox.py): no network, no project files, no environment.
    return ctx.effect("shell.run", {"argv": args.argv, "timeout": args.timeout, "sandbox": True})


TOOLS: dict[str, AgentTool] = {t.name: t for t in (
    _db_query, _memory_search, _result_read,
    AgentTool("memory_write", "Store a fact in the long-term memory, under a key.", MemoryWriteArgs, _memory_write,
              effect=IDEMPOTENT),
    AgentTool("db_upsert", "Insert or update rows (by primary key) in one of the tables it may write.", DbUpsertArgs,
              _db_upsert, effect=IDEMPOTENT, reaches_host=True),
    AgentTool("email_send", "Send an email (it cannot be unsent).", EmailSendArgs, _email_send),
    AgentTool("http_request", "Make an HTTP request to a public address.", HttpRequestArgs, _http_request),
    AgentTool("shell_run", "Run a program (no shell) in a sandbox with no network, and return its exit code and "
              "output.", ShellRunArgs, _shell_run, reaches_host=True),
)}

# Tools from elsewhere than this module (ORCH_EXTENSIONS through orchestrator.sdk, MCP servers):
# each source answers a name with its AgentTool (or None) and lists the names it has now.
_SOURCES: list[tuple[Callable[[str], "AgentTool | None"], Callable[[], list[str]]]] = []


def add_source(find: Callable[[str], "AgentTool | None"], names: Callable[[], list[str]]) -> None:
    if (find, names) not in _SOURCES:
        _SOURCES.append((find, names))


# Tools written with orchestrator.sdk's @tool in the modules of ORCH_EXTENSIONS; they may not take a
# built-in's name, and a built-in is found first.
tooldef.reserve(TOOLS)
add_source(tooldef.find, tooldef.names)
# The tools of the MCP servers the installation declares: agent/mcp.py adds itself as a source
# when the package is imported (orchestrator/agent/__init__.py).


def find_tool(name: str) -> "AgentTool | None":
    """The tool called `name`: a built-in, or one a source has now (None: no such tool)."""
    if name in TOOLS:
        return TOOLS[name]
    for find, _ in _SOURCES:
        tool = find(name)
        if tool is not None:
            return tool
    return None


def approval_schema(name: str) -> dict:
    """What an approval keeps of its tool when it opens (in the worker, which has just found
    the tool): the JSON schema of its arguments, and whether a pydantic model of this process
    checks them. The review page and the decision then never need to reach the tool's source
    (an MCP server) from the web process."""
    found = find_tool(name)
    if found is None:
        return {}
    return {"schema": found.parameters_schema(), "schema_from": "model" if found.Args is not None else "json_schema"}


def known_names() -> list[str]:
    """Every tool name an agent may be given now (built-ins first)."""
    found = list(TOOLS)
    for _, names in _SOURCES:
        found += [n for n in names() if n not in found]
    return found


# What an agent created with only a goal may call: reads that reach neither the host nor the outside —
# the built-in ones, and those an extension declares granted_by_default (the demo's contracts tools).
SAFE_DEFAULT = [name for name, t in TOOLS.items()
                if t.effect == READ_ONLY and not t.reaches_host and name not in IMPLICIT]


def safe_default() -> list[str]:
    return [*tooldef.granted_by_default(), *SAFE_DEFAULT]
HOST_TOOLS = [name for name, t in TOOLS.items() if t.reaches_host]
SAFE_HTTP_METHODS = ("GET", "HEAD")


def reaches_host(name: str) -> bool:
    """Whether the tool `name` reaches the worker's host or the database (a built-in, or one a
    source has): an admin's to grant, on an installation that enables it (ORCH_AGENT_HOST_TOOLS)."""
    tool = find_tool(name)
    return tool is not None and tool.reaches_host


def email_allowed(address: str) -> bool:
    """Whether email_send may write to `address` without a reviewer: it matches
    ORCH_AGENT_EMAIL_ALLOW (default: the domain of DEFAULT_FROM_EMAIL)."""
    patterns = settings.ORCH_AGENT_EMAIL_ALLOW or [f"*@{settings.DEFAULT_FROM_EMAIL.rpartition('@')[2]}"]
    return any(fnmatch.fnmatchcase(address.strip().lower(), p.strip().lower()) for p in patterns)


def needs_approval(name: str, arguments: dict | None, *, require: list[str], waived: list[str]) -> str:
    """Why this call must wait for a reviewer ("" when it need not). `require`: the task's
    require_approval; `waived`: tools whose approval an admin waived for the task. An email to a
    recipient outside ORCH_AGENT_EMAIL_ALLOW needs a reviewer even then."""
    tool = find_tool(name)
    if tool is None or arguments is None:
        return ""  # not a call that can run: its error goes back to the model
    if name in require:
        return f"{name} is in the task's require_approval"
    if name == "email_send":
        outside = [a for a in arguments.get("to") or [] if isinstance(a, str) and not email_allowed(a)]
        if outside:
            return f"email to {', '.join(outside[:5])}: outside ORCH_AGENT_EMAIL_ALLOW"
    if name in waived:
        return ""
    if name == "http_request":
        method = str(arguments.get("method", "GET")).upper()
        return "" if method in SAFE_HTTP_METHODS else f"http_request {method} writes"
    if tool.effect == NON_IDEMPOTENT:
        return f"{name} is not idempotent (it cannot be undone or safely repeated)"
    return ""


class ToolCallError(HarnessError):
    """The call could not do what it was asked; the message goes back to the model."""


class ReplayWithKey(HarnessError, RuntimeError):
    """An idempotent or keyed call's outcome is unknown: its step fails, to run again and replay
    the call with its key (the runner's retries)."""


def call(ctx, name: str, raw_arguments: str, allowed: list[str]) -> tuple[bool, Any]:
    """Run the model's call `name(raw_arguments)`: (ok, result). A call the model got wrong
    (an unknown or disallowed tool, arguments that are not JSON or fail the schema, a
    refusal by the tool) is (False, "error: ...") for the model to read and correct."""
    tool = find_tool(name) if name in allowed else None
    if tool is None:
        return False, f"error: there is no tool {name!r}; the tools are: {', '.join(allowed)}"
    try:
        arguments = json.loads(raw_arguments or "{}")
    except ValueError as exc:
        return False, f"error: the arguments are not valid JSON ({exc}); send a JSON object"
    try:
        args = tool.parse(arguments)
    except tooldef.InvalidArguments as exc:
        return False, f"error: invalid arguments for {name}: {exc}"
    try:
        return True, redact(tool.run(ctx, args))
    except (ToolCallError, ToolError) as exc:  # refused before anything was performed
        return False, redact(f"error: {exc}")
    except EffectFailed as exc:
        if isinstance(exc.error, OutcomeUnknown) and tool.effect in (IDEMPOTENT, KEYED):
            # In doubt, and safe to repeat (a non-idempotent one is reviewed instead, never
            # here): the WAL kept the key. The step fails and runs again, replaying the call
            # with the same key, rather than telling the model "it failed": it could ask again,
            # with a new key, and a call that did happen would be done twice.
            raise ReplayWithKey(f"{name}: {exc}; the step runs again and replays it with the same key") from exc
        # The tool reported a failure (an error status, a refusal, a non-zero exit): the model
        # reads it and decides, as it would a refusal; the task does not stop for it.
        return False, redact(f"error: {exc}")


def message_text(result: Any) -> str:
    """A tool's result as text, whole."""
    return result if isinstance(result, str) else json.dumps(result, ensure_ascii=False, default=str)


def as_message_text(result: Any, ref: str | None = None) -> str:
    """What the model is told of a result: all of it, or past ORCH_AGENT_RESULT_INLINE_CHARS its
    head and, for a tool step's result (`ref`, its step id), how to read on (result_read)."""
    text, inline = message_text(result), settings.ORCH_AGENT_RESULT_INLINE_CHARS
    if len(text) <= inline:
        return text
    if ref is None:
        return text[:inline] + f"... [{len(text) - inline} more characters not shown]"
    return (text[:inline] + f"\n[... {len(text) - inline} {SHORTENED_MARK}: read on with "
                            f'result_read(ref="{ref}", offset={inline}).]')
