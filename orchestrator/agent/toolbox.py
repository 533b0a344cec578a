"""The tools an agent may call: each has a pydantic argument model, which is both the JSON
schema the model sees and what validates the model's arguments (a bad call goes back to
the model as an error message, never a crash).

Tools with a side effect run through the WAL (`ctx.effect`, with the call's idempotency
key): `db_upsert`, `email_send`, `http_request`, `shell_run`, `memory_write`. The others only read:
`contracts_list`, `contracts_read`, `db_query` (SELECT only, on the allowed tables, as a read-only
role: tools/dbread.py), `memory_search` (long-term memory, a store of its own, scoped to the task's
owner: never copied into a snapshot).

Least privilege (README "Security model"): each tool declares its effect class and whether it
reaches the host or the database. An agent created with only a goal gets SAFE_DEFAULT (read-only,
nothing of the host); a side-effect tool must be named; a host tool must be enabled by the
installation (ORCH_AGENT_HOST_TOOLS) and granted by an admin; a non-idempotent call waits for a
reviewer unless an admin waived that for the task (`needs_approval`).

Names use `_` because the Chat Completions protocol allows only [a-zA-Z0-9_-] in a
function name.
"""
import fnmatch
import json
from dataclasses import dataclass
from typing import Any, Callable, Literal

from django.conf import settings
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..engine.wal import EffectFailed
from ..models import AgentMemory, Task
from ..primitives.redaction import redact
from ..tools.base import ToolError
from ..tools.dbread import read_only_query
from ..tasktypes.contract_extraction import MalformedContract, list_samples, read_contract

RESULT_CHARACTERS = 20_000  # what a tool message carries to the model (the step keeps all of it)
QUERY_ROWS = 100


class ContractsListArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    limit: int = Field(20, ge=1, le=100, description="how many contracts to list")


class ContractsReadArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    contract: int = Field(..., ge=1, description="the contract's number, from contracts_list")


class DbQueryArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    sql: str = Field(..., min_length=1, max_length=5000, description="one SELECT statement")


class MemorySearchArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    query: str = Field(..., min_length=1, max_length=500)


class MemoryWriteArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    key: str = Field(..., min_length=1, max_length=200, description="what the fact is about")
    body: str = Field(..., min_length=1, max_length=20_000, description="the fact")


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


READ_ONLY, IDEMPOTENT, NON_IDEMPOTENT = "read_only", "idempotent", "non_idempotent"


@dataclass(frozen=True)
class AgentTool:
    name: str
    description: str
    Args: type[BaseModel]
    run: Callable[[Any, BaseModel], Any]  # (step context, validated args) -> JSON-serialisable result
    # read_only: no WAL entry; idempotent: replay is safe; non_idempotent: needs a reviewer by
    # default, and an unknown outcome goes to review. Missing means non_idempotent (fail closed).
    effect: str = NON_IDEMPOTENT
    # Reaches the worker's host or the harness's database: enabled per installation
    # (ORCH_AGENT_HOST_TOOLS) and granted per task by an admin only.
    reaches_host: bool = False

    @property
    def side_effect(self) -> bool:
        return self.effect != READ_ONLY

    def schema(self) -> dict:
        """The tool as offered to the model (Chat Completions `tools` entry)."""
        parameters = self.Args.model_json_schema()
        parameters.pop("title", None)
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": parameters}}


def _contracts_list(ctx, args: ContractsListArgs):
    return {"contracts": [{"contract": i, "file": path.name}
                          for i, path in enumerate(list_samples()[:args.limit], start=1)]}


def _contracts_read(ctx, args: ContractsReadArgs):
    samples = list_samples()
    if args.contract > len(samples):
        raise ToolCallError(f"there is no contract {args.contract}; contracts_list shows {len(samples)}")
    path = samples[args.contract - 1]
    try:
        return {"contract": args.contract, "file": path.name, **read_contract(path)}
    except MalformedContract as exc:
        raise ToolCallError(str(exc)) from None


def _db_query(ctx, args: DbQueryArgs):
    # Only the allowed tables, as a read-only role (PostgreSQL) or under an authorizer (SQLite).
    return read_only_query(args.sql, max_rows=QUERY_ROWS)


def memory_scope(task_id: int) -> str:
    """Whose memory a task reads and writes: its owner's (tasks created by the installation
    itself, from the command line, share one scope). One owner's agents never see another's."""
    owner = Task.objects.filter(pk=task_id).values_list("created_by_id", flat=True).first()
    return f"owner-{owner}/" if owner else "installation/"


def _memory_search(ctx, args: MemorySearchArgs):
    scope = memory_scope(ctx.task_id)
    mine = AgentMemory.objects.filter(key__startswith=scope)
    words = [w for w in args.query.split() if len(w) > 2][:5] or [args.query]
    found = AgentMemory.objects.none()
    for word in words:
        found = found | mine.filter(key__icontains=word) | mine.filter(value__icontains=word)
    return {"facts": [{"key": m.key[len(scope):], "value": m.value[:2000]} for m in found.distinct()[:20]]}


def _memory_write(ctx, args: MemoryWriteArgs):
    ctx.effect("db.upsert", {"table": "agent_memory", "columns": ["key", "value", "task_id"],
                             "rows": [[memory_scope(ctx.task_id) + args.key, args.body, ctx.task_id]]})
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
    AgentTool("contracts_list", "List the contracts there are to read (number and file name).", ContractsListArgs,
              _contracts_list, effect=READ_ONLY),
    AgentTool("contracts_read", "Read one contract: its parties, dates (ISO) and money amounts.", ContractsReadArgs,
              _contracts_read, effect=READ_ONLY),
    AgentTool("db_query", "Run one read-only SELECT on the tables it may read (at most 100 rows come back).",
              DbQueryArgs, _db_query, effect=READ_ONLY, reaches_host=True),
    AgentTool("memory_search", "Search the long-term memory (facts kept across tasks).", MemorySearchArgs,
              _memory_search, effect=READ_ONLY),
    AgentTool("memory_write", "Store a fact in the long-term memory, under a key.", MemoryWriteArgs, _memory_write,
              effect=IDEMPOTENT),
    AgentTool("db_upsert", "Insert or update rows (by primary key) in one of the tables it may write.", DbUpsertArgs,
              _db_upsert, effect=IDEMPOTENT, reaches_host=True),
    AgentTool("email_send", "Send an email (it cannot be unsent).", EmailSendArgs, _email_send),
    AgentTool("http_request", "Make an HTTP request to a public address.", HttpRequestArgs, _http_request),
    AgentTool("shell_run", "Run a program (no shell) in a sandbox with no network, and return its exit code and "
              "output.", ShellRunArgs, _shell_run, reaches_host=True),
)}

# What an agent created with only a goal may call: reads that reach neither the host nor the outside.
SAFE_DEFAULT = [name for name, t in TOOLS.items() if t.effect == READ_ONLY and not t.reaches_host]
HOST_TOOLS = [name for name, t in TOOLS.items() if t.reaches_host]
SAFE_HTTP_METHODS = ("GET", "HEAD")


def email_allowed(address: str) -> bool:
    """Whether email_send may write to `address` without a reviewer: it matches
    ORCH_AGENT_EMAIL_ALLOW (default: the domain of DEFAULT_FROM_EMAIL)."""
    patterns = settings.ORCH_AGENT_EMAIL_ALLOW or [f"*@{settings.DEFAULT_FROM_EMAIL.rpartition('@')[2]}"]
    return any(fnmatch.fnmatchcase(address.strip().lower(), p.strip().lower()) for p in patterns)


def needs_approval(name: str, arguments: dict | None, *, require: list[str], waived: list[str]) -> str:
    """Why this call must wait for a reviewer ("" when it need not). `require`: the task's
    require_approval; `waived`: tools whose approval an admin waived for the task. An email to a
    recipient outside ORCH_AGENT_EMAIL_ALLOW needs a reviewer even then."""
    tool = TOOLS.get(name)
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


class ToolCallError(Exception):
    """The call could not do what it was asked; the message goes back to the model."""


def call(ctx, name: str, raw_arguments: str, allowed: list[str]) -> tuple[bool, Any]:
    """Run the model's call `name(raw_arguments)`: (ok, result). A call the model got wrong
    (an unknown or disallowed tool, arguments that are not JSON or fail the schema, a
    refusal by the tool) is (False, "error: ...") for the model to read and correct."""
    tool = TOOLS.get(name)
    if tool is None or name not in allowed:
        return False, f"error: there is no tool {name!r}; the tools are: {', '.join(allowed)}"
    try:
        arguments = json.loads(raw_arguments or "{}")
    except ValueError as exc:
        return False, f"error: the arguments are not valid JSON ({exc}); send a JSON object"
    try:
        args = tool.Args.model_validate(arguments)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'arguments'}: {e['msg']}" for e in exc.errors()[:5])
        return False, f"error: invalid arguments for {name}: {problems}"
    try:
        return True, redact(tool.run(ctx, args))
    except (ToolCallError, ToolError) as exc:  # refused before anything was performed
        return False, redact(f"error: {exc}")
    except EffectFailed as exc:
        # The tool reported a failure (an error status, a refusal, a non-zero exit): the model
        # reads it and decides, as it would a refusal; the task does not stop for it.
        return False, redact(f"error: {exc}")


def as_message_text(result: Any) -> str:
    text = result if isinstance(result, str) else json.dumps(result, ensure_ascii=False, default=str)
    if len(text) > RESULT_CHARACTERS:
        text = text[:RESULT_CHARACTERS] + f"... [{len(text) - RESULT_CHARACTERS} more characters not shown]"
    return text
