"""The tools an agent may call: each has a pydantic argument model, which is both the JSON
schema the model sees and what validates the model's arguments (a bad call goes back to
the model as an error message, never a crash).

Tools with a side effect run through the WAL (`ctx.effect`, with the call's idempotency
key): `db_upsert`, `email_send`, `http_request`, `shell_run`, `memory_write`. The others only read:
`contracts_list`, `contracts_read`, `db_query` (SELECT only, in a read-only transaction),
`memory_search` (long-term memory, a store of its own: never copied into a snapshot).

Names use `_` because the Chat Completions protocol allows only [a-zA-Z0-9_-] in a
function name.
"""
import json
from dataclasses import dataclass
from typing import Any, Callable, Literal

from django.db import connection, transaction
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..models import AgentMemory
from ..tools.base import ToolError
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


@dataclass(frozen=True)
class AgentTool:
    name: str
    description: str
    Args: type[BaseModel]
    run: Callable[[Any, BaseModel], Any]  # (step context, validated args) -> JSON-serialisable result
    side_effect: bool = False

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
    sql = args.sql.strip().rstrip(";")
    if ";" in sql or not sql.split(None, 1)[0].upper() in ("SELECT", "WITH"):
        raise ToolCallError("db_query runs one SELECT statement (no ';', nothing that writes)")
    with transaction.atomic(), connection.cursor() as cursor:
        # The database refuses any write, whatever the statement hides.
        cursor.execute("SET TRANSACTION READ ONLY" if connection.vendor == "postgresql" else "PRAGMA query_only = ON")
        try:
            cursor.execute(sql)
            columns = [c[0] for c in cursor.description or ()]
            rows = cursor.fetchmany(QUERY_ROWS + 1)
        except Exception as exc:  # the model's SQL: its error goes back to it
            raise ToolCallError(f"the query failed: {exc}") from None
        finally:
            if connection.vendor != "postgresql":
                cursor.execute("PRAGMA query_only = OFF")
    return {"columns": columns, "rows": [list(r) for r in rows[:QUERY_ROWS]], "truncated": len(rows) > QUERY_ROWS}


def _memory_search(ctx, args: MemorySearchArgs):
    words = [w for w in args.query.split() if len(w) > 2][:5] or [args.query]
    found = AgentMemory.objects.none()
    for word in words:
        found = found | AgentMemory.objects.filter(key__icontains=word) | AgentMemory.objects.filter(
            value__icontains=word)
    return {"facts": [{"key": m.key, "value": m.value[:2000]} for m in found.distinct()[:20]]}


def _memory_write(ctx, args: MemoryWriteArgs):
    ctx.effect("db.upsert", {"table": "agent_memory", "columns": ["key", "value", "task_id"],
                             "rows": [[args.key, args.body, ctx.task_id]]})
    return {"stored": args.key}


def _email_send(ctx, args: EmailSendArgs):
    return ctx.effect("email.send", {"to": args.to, "subject": args.subject, "body": args.body})


def _http_request(ctx, args: HttpRequestArgs):
    call = {"method": args.method, "url": args.url}
    if args.json_body is not None:
        call["json"] = args.json_body
    return ctx.effect("http.request", call)


def _db_upsert(ctx, args: DbUpsertArgs):
    return ctx.effect("db.upsert", {"table": args.table, "columns": args.columns, "rows": args.rows})


def _shell_run(ctx, args: ShellRunArgs):
    return ctx.effect("shell.run", {"argv": args.argv, "timeout": args.timeout})


TOOLS: dict[str, AgentTool] = {t.name: t for t in (
    AgentTool("contracts_list", "List the contracts there are to read (number and file name).", ContractsListArgs,
              _contracts_list),
    AgentTool("contracts_read", "Read one contract: its parties, dates (ISO) and money amounts.", ContractsReadArgs,
              _contracts_read),
    AgentTool("db_query", "Run one read-only SELECT on the database (at most 100 rows come back).", DbQueryArgs,
              _db_query),
    AgentTool("memory_search", "Search the long-term memory (facts kept across tasks).", MemorySearchArgs,
              _memory_search),
    AgentTool("memory_write", "Store a fact in the long-term memory, under a key.", MemoryWriteArgs, _memory_write,
              side_effect=True),
    AgentTool("db_upsert", "Insert or update rows (by primary key) in one of the tables it may write.", DbUpsertArgs,
              _db_upsert, side_effect=True),
    AgentTool("email_send", "Send an email (it cannot be unsent).", EmailSendArgs, _email_send, side_effect=True),
    AgentTool("http_request", "Make an HTTP request.", HttpRequestArgs, _http_request, side_effect=True),
    AgentTool("shell_run", "Run a program (no shell) and return its exit code and output.", ShellRunArgs,
              _shell_run, side_effect=True),
)}


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
        return True, tool.run(ctx, args)
    except (ToolCallError, ToolError) as exc:  # refused before anything was performed
        return False, f"error: {exc}"


def as_message_text(result: Any) -> str:
    text = result if isinstance(result, str) else json.dumps(result, ensure_ascii=False, default=str)
    if len(text) > RESULT_CHARACTERS:
        text = text[:RESULT_CHARACTERS] + f"... [{len(text) - RESULT_CHARACTERS} more characters not shown]"
    return text
