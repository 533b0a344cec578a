"""A task type's compatibility fingerprint: what a paused task ran against, to compare on resume.

A flat {key: value} map (engine/compat.py compares it key by key and says what changed):

- "type": the type's name; "version": its declared `version`;
- "plan": the sha256 of its `plan` function's source (its qualified name when the source
  cannot be read);
- "tool:<name>": the sha256 of each tool's argument schema and effect class (the tools a type
  declares in `uses_tools`; an agent's granted tools), "absent" when no such tool is installed;
- an agent's (tasktypes/agent.py): "prompt:system", "prompt:summary" (digests) and "model"
  (the profile and the model it resolves to).

An MCP server's tools (`<server>__<tool>`, or every tool of `<server>__*`) are "tool:<offered
name>" entries too, digested from the schema the server lists and the effect class the harness
gives the tool: the tools the agent is offered. Recording (a run's start) reads the session's
listing (the one the run's turns offer); a comparison (compat.check: a resume, its preview, the
gate at a run's start) asks the server afresh (`asking_afresh`), since a process's cached listing
may be older than the server. A server that cannot be reached is "mcp:<server>": "unknown" and
its tools are compared with nothing (`comparable`); recording keeps the digests last seen for
it (`carry_unknown`), so a later check, with the server back, compares with the code the task
ran on. Computed when a run starts and at every resume; the digests of local tools are cached
by the function and by the argument model class, so a run's start pays a dictionary look-up for
each (and one tools/list per MCP server the task names).
"""
import contextvars
import hashlib
import inspect
import json
import weakref
from contextlib import contextmanager
from functools import lru_cache

ABSENT = "absent"  # a tool the fingerprint names that is not installed now
UNKNOWN = "unknown"  # an MCP server that could not be asked: its tools are compared with nothing
_SCHEMAS: "weakref.WeakKeyDictionary[type, str]" = weakref.WeakKeyDictionary()
_AFRESH = contextvars.ContextVar("fingerprint_asks_mcp_servers_afresh", default=False)


@contextmanager
def asking_afresh():
    """Within it, MCP servers are asked for their tools again rather than read from a session's
    cached listing (a comparison must see the server as it is now)."""
    reset = _AFRESH.set(True)
    try:
        yield
    finally:
        _AFRESH.reset(reset)


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


@lru_cache(maxsize=1024)
def code_digest(fn) -> str:
    """The sha256 of `fn`'s source (of its qualified name when there is no source to read)."""
    target = inspect.unwrap(getattr(fn, "__func__", fn))
    try:
        source = inspect.getsource(target)
    except (OSError, TypeError):
        source = f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', repr(target))}"
    return sha256(source)


def _schema_text(tool) -> str:
    if tool.parameters is not None:
        return json.dumps(tool.parameters, sort_keys=True, default=str)
    model = tool.Args
    text = _SCHEMAS.get(model)
    if text is None:
        text = json.dumps(tool.parameters_schema(), sort_keys=True, default=str)
        _SCHEMAS[model] = text
    return text


def tool_digest(tool) -> str:
    """An agent tool's signature: its argument schema and its effect class (not its description)."""
    return sha256(f"{tool.effect}\n{_schema_text(tool)}")


def tool_digests(names) -> dict[str, str]:
    """{"tool:<name>": digest or ABSENT} for each tool name; a declared MCP server's tools as
    `mcp_digests` says."""
    from ..agent import mcp as mcp_tools, toolbox

    digests, mcp_names = {}, []
    for name in dict.fromkeys(names):
        if mcp_tools.declared(name):
            mcp_names.append(name)
            continue
        tool = toolbox.find_tool(name)
        digests[f"tool:{name}"] = tool_digest(tool) if tool is not None else ABSENT
    return {**digests, **mcp_digests(mcp_names)}


def mcp_digests(names) -> dict[str, str]:
    """The MCP tools `names` name (`<server>__<tool>`, `<server>__*`), each server asked once
    (afresh within `asking_afresh`): {"tool:<offered name>": digest, or ABSENT when the server has no such tool}; for a
    server that cannot be reached, {"mcp:<server>": UNKNOWN}."""
    from ..agent import mcp as mcp_tools
    from ..tools.base import ToolError

    by_server: dict[str, list[str]] = {}
    for name in names:
        by_server.setdefault(mcp_tools.parse(name)[0], []).append(name)
    digests = {}
    for server, named in by_server.items():
        try:
            listed = mcp_tools.agent_tools(server, refresh=_AFRESH.get())
        except ToolError:
            digests[f"mcp:{server}"] = UNKNOWN
            continue
        for name in named:
            if mcp_tools.is_wildcard(name):
                digests.update({f"tool:{offered}": tool_digest(tool) for offered, tool in sorted(listed.items())})
            else:
                digests[f"tool:{name}"] = tool_digest(listed[name]) if name in listed else ABSENT
    return digests


def _server_of(key: str) -> str | None:
    """The MCP server a fingerprint key belongs to ("mcp:git", "tool:git__status"), or None."""
    from ..tools import mcp

    if key.startswith("mcp:"):
        return key[len("mcp:"):]
    parts = mcp.split_name(key[len("tool:"):]) if key.startswith("tool:") else None
    return parts[0] if parts else None


def unknown_servers(*fingerprints: dict) -> set[str]:
    return {key[len("mcp:"):] for fp in fingerprints for key, value in (fp or {}).items()
            if key.startswith("mcp:") and value == UNKNOWN}


def comparable(key: str, unknown: set[str]) -> bool:
    """Whether a key is compared: not a server's reachability, nor a tool of a server that could
    not be asked on either side."""
    return not key.startswith("mcp:") and (not unknown or _server_of(key) not in unknown)


def carry_unknown(recorded: dict, current: dict) -> dict:
    """`current`, with the entries `recorded` holds for each MCP server `current` could not ask:
    what the task last ran against stays the reference until the server can be asked again."""
    unknown = unknown_servers(current)
    if not unknown or not recorded:
        return current
    kept = {key: value for key, value in recorded.items() if _server_of(key) in unknown}
    cleared = {key: value for key, value in current.items()
               if not (key.startswith("mcp:") and key[len("mcp:"):] in {_server_of(k) for k in kept})}
    return {**cleared, **kept}


def base_fingerprint(task_type, params: dict) -> dict[str, str]:
    """What every task type's fingerprint holds: name, declared version, plan digest, its tools."""
    return {"type": task_type.name, "version": str(task_type.version),
            "plan": code_digest(type(task_type).plan), **tool_digests(task_type.uses_tools)}
