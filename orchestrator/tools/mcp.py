"""MCP servers as tool sources: which servers there are, what class each tool's effect is,
and `mcp.call`, the WAL tool every MCP call with a side effect goes through.

Servers come from ORCH_MCP_SERVERS (JSON: `{"git": {"command": [...], "env": {...}},
"files": {"url": "http://…/mcp", "headers": {...}}}`, each may add `"tool_effects"`) and from
the admin (McpServer rows, enabled ones); the environment's wins on a name clash. A server
whose declaration is wrong (a bad name, both or neither of command and url, a value that is
not a string) is left out and reported (`problems()`, a system check and a log line).

Effect classes come from the tool's annotations (`effect_class`): `readOnlyHint: true` is
read_only, `idempotentHint: true` idempotent, anything else non_idempotent (the MCP spec's
own default is a destructive tool); a server's `tool_effects` overrides a tool's class.

The client itself (sessions, the event loop, the SDK) is orchestrator/tools/mcp_client.py,
imported on first use: the `mcp` package takes a second or more to import, which a process
with no MCP server never pays.

How a call's failure reads (tools/base.py): the server unreachable, or its session gone
before the request was written, is *not performed* (ToolError); a transport failure, a
timeout or a cancellation after the request was written is *outcome unknown* (a
non-idempotent call goes to review); a JSON-RPC error answer or a result with
`isError: true` is the server's refusal or failure (ToolError: the model reads it). The
idempotency key travels in the request's `_meta` as IDEMPOTENCY_META_KEY.
"""
import logging
import re
import threading
import time

from django.conf import settings
from django.core.signals import setting_changed
from django.db import DatabaseError

from .base import Tool, ToolError, register
# What the client module shares with this one; imported from here by the rest of the harness.
from .mcp_protocol import IDEMPOTENCY_META_KEY, ListedTool, ServerConfig, result_text  # noqa: F401
from ..primitives.errors import HarnessError

log = logging.getLogger(__name__)

READ_ONLY, IDEMPOTENT, KEYED, NON_IDEMPOTENT = "read_only", "idempotent", "keyed", "non_idempotent"
EFFECTS = (READ_ONLY, IDEMPOTENT, KEYED, NON_IDEMPOTENT)
# `<server>__<tool>`: a server's name has no "__" and does not end with "_", so the first
# "__" of an offered name is where the server's name ends.
SERVER_NAME = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9-]|_(?!_))*$")
SEPARATOR = "__"
CONFIG_TTL_SECONDS = 2.0  # admin changes made by another process are seen this soon


class ConfigError(HarnessError, ValueError):
    pass


def _strings(value, what: str) -> tuple[tuple[str, str], ...]:
    if value in (None, ""):
        return ()
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise ConfigError(f"{what} must be an object of strings")
    return tuple(sorted(value.items()))


def parse_server(name: str, spec, *, origin: str) -> ServerConfig:
    """A server's declaration (ORCH_MCP_SERVERS' value for `name`, or an admin row's fields)."""
    if not isinstance(name, str) or not SERVER_NAME.match(name) or len(name) > 40:
        raise ConfigError(f"{name!r} is not a server name: letters, digits, - and _, no '__', not ending with _")
    if not isinstance(spec, dict):
        raise ConfigError(f"{name}: expected an object with command or url")
    unknown = sorted(set(spec) - {"command", "env", "url", "headers", "tool_effects"})
    if unknown:
        raise ConfigError(f"{name}: unknown keys {unknown} (command, env, url, headers, tool_effects)")
    command, url = spec.get("command") or [], spec.get("url") or ""
    if bool(command) == bool(url):
        raise ConfigError(f"{name}: give exactly one of command (a stdio server) or url (streamable HTTP)")
    if command and (not isinstance(command, list) or not all(isinstance(a, str) and a for a in command)):
        raise ConfigError(f"{name}: command must be a list of strings (the argv)")
    if url and (not isinstance(url, str) or not re.match(r"^https?://", url)):
        raise ConfigError(f"{name}: url must be an http(s) address")
    if command and spec.get("headers"):
        raise ConfigError(f"{name}: headers are for a url; a stdio server takes env")
    if url and spec.get("env"):
        raise ConfigError(f"{name}: env is for a command; an HTTP server takes headers")
    effects = _strings(spec.get("tool_effects"), f"{name}: tool_effects")
    wrong = [f"{tool}={effect}" for tool, effect in effects if effect not in EFFECTS]
    if wrong:
        raise ConfigError(f"{name}: tool_effects {', '.join(wrong)}: the classes are {', '.join(EFFECTS)}")
    return ServerConfig(name=name, command=tuple(command), env=_strings(spec.get("env"), f"{name}: env"),
                        url=url, headers=_strings(spec.get("headers"), f"{name}: headers"), tool_effects=effects,
                        origin=origin, timeout=float(settings.ORCH_MCP_CALL_TIMEOUT_SECONDS))


class _Configured:
    """The servers declared now, read at most every CONFIG_TTL_SECONDS (and at once when a
    setting or an McpServer row changes in this process)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._expires = 0.0
        self._servers: dict[str, ServerConfig] = {}
        self._problems: list[str] = []

    def clear(self, **kwargs) -> None:
        self._expires = 0.0

    def get(self) -> tuple[dict[str, ServerConfig], list[str]]:
        with self._lock:
            if time.monotonic() >= self._expires:
                self._servers, self._problems = _read_configuration()
                self._expires = time.monotonic() + CONFIG_TTL_SECONDS
            return self._servers, self._problems


def _read_configuration() -> tuple[dict[str, ServerConfig], list[str]]:
    from ..models import McpServer

    servers: dict[str, ServerConfig] = {}
    problems: list[str] = []
    try:
        rows = list(McpServer.objects.filter(enabled=True).values("name", "command", "env", "url", "headers",
                                                                  "tool_effects"))
    except DatabaseError:  # not migrated yet, or away: the environment's servers still work
        rows = []
    for row in rows:
        name = row.pop("name")
        spec = {k: v for k, v in row.items() if v not in (None, "", [], {})}
        try:
            servers[name] = parse_server(name, spec, origin="admin")
        except ConfigError as exc:
            problems.append(f"MCP server {name} (admin): {exc}")
    declared = settings.ORCH_MCP_SERVERS or {}
    for name, spec in (declared.items() if isinstance(declared, dict) else ()):
        try:
            servers[name] = parse_server(name, spec, origin="ORCH_MCP_SERVERS")  # the environment wins
        except ConfigError as exc:
            problems.append(f"ORCH_MCP_SERVERS: {exc}")
            servers.pop(name, None)  # a broken declaration is not replaced by the admin's row of that name
    for problem in problems:
        log.error("MCP server left out: %s", problem)
    return servers, problems


_CONFIGURED = _Configured()
setting_changed.connect(_CONFIGURED.clear, dispatch_uid="orchestrator.tools.mcp.configured")


def servers() -> dict[str, ServerConfig]:
    return _CONFIGURED.get()[0]


def server(name: str) -> ServerConfig | None:
    return servers().get(name)


def problems() -> list[str]:
    return list(_CONFIGURED.get()[1])


def configuration_changed(**kwargs) -> None:
    """An McpServer row was saved or deleted here: read the servers again at the next use."""
    _CONFIGURED.clear()


def split_name(offered: str) -> tuple[str, str] | None:
    """`<server>__<tool>` → (server, tool); None for a name that is not an MCP tool's."""
    server_name, sep, tool = offered.partition(SEPARATOR)
    if not sep or not tool or not SERVER_NAME.match(server_name):
        return None
    return server_name, tool


def effect_class(annotations: dict | None, override: str | None = None) -> str:
    """The effect class of a tool with these MCP annotations (readOnlyHint, idempotentHint...),
    unless the installation overrides it. Missing or unknown: non_idempotent (fail closed)."""
    if override in EFFECTS:
        return override
    annotations = annotations or {}
    if annotations.get("readOnlyHint") is True:
        return READ_ONLY
    if annotations.get("idempotentHint") is True:
        return IDEMPOTENT
    return NON_IDEMPOTENT


def client():
    """The client module (imports the SDK on first use)."""
    from . import mcp_client

    return mcp_client


def preload() -> None:
    """Import the client now when servers are declared: in a worker, before it forks its
    executors, so that each executor does not pay the SDK's import before its first MCP call.
    (Importing starts no thread: the event loop starts at the first use, in the executor.)"""
    if servers():
        client()


def list_tools(config: ServerConfig, *, refresh: bool = False) -> dict[str, ListedTool]:
    """The server's tools (its session's cached listing; `refresh`: ask the server again).
    ToolError when it cannot be reached."""
    return client().list_tools(config, refresh=refresh)


def call(config: ServerConfig, tool: str, arguments: dict, *, token, key: str | None = None) -> dict:
    """Call `tool`; the result as plain values ({"content": [...], "structured_content": ...}).
    `key`: the idempotency key, sent in `_meta` (calls with a side effect). Raises ToolError,
    OutcomeUnknown or Cancelled as the module's docstring says."""
    return client().call(config, tool, arguments, token=token, key=key)


def close_all() -> None:
    """Close this process's sessions (their stdio servers exit), if the client was ever used."""
    import sys

    module = sys.modules.get(f"{__package__}.mcp_client")
    if module is not None:
        module.close_all()


@register
class McpCall(Tool):
    name = "mcp.call"
    description = ("Call a tool of an MCP server: {server, tool, arguments, effect}; the idempotency key travels in "
                   "the request's _meta.")

    def is_idempotent(self, args: dict) -> bool:
        return args.get("effect") in (IDEMPOTENT, KEYED)

    def validate(self, args: dict) -> None:
        if not isinstance(args.get("tool"), str) or not isinstance(args.get("arguments"), dict):
            raise ToolError(f"mcp.call needs a tool name and arguments (an object); got {args!r}")
        if args.get("effect") not in EFFECTS:
            raise ToolError(f"mcp.call: effect must be one of {', '.join(EFFECTS)}")
        if server(args.get("server") or "") is None:
            raise ToolError(f"there is no MCP server {args.get('server')!r} on this installation (now)")

    def perform(self, args: dict, *, key: str, token) -> dict:
        config = server(args["server"])
        if config is None:
            raise ToolError(f"the MCP server {args['server']!r} is no longer declared; nothing was sent")
        return call(config, args["tool"], args["arguments"], token=token, key=key)

    def repeat_consequence(self, args: dict, *, idempotent: bool) -> str:
        if idempotent:
            return f"calls {args.get('server')}__{args.get('tool')} again (idempotent, same key in _meta)"
        return f"calls {args.get('server')}__{args.get('tool')} again: it may act twice"
