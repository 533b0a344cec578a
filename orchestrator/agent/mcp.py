"""The tools of the declared MCP servers, as the agent's tools (a source of the toolbox).

Each tool of server `git` reaches the model as `git__<tool>` with the server's own input
schema (characters a Chat Completions function name cannot hold become `_`); a task's
`tools` may also name `git__*`, every tool the server has at each turn (`expand`). The
listing is the server's session's, cached per process (orchestrator/tools/mcp_client.py)
and listed again when a name is not in it: a tool added since is found, and a tool that
disappeared is not offered at the next turn; a call to it is an error the model reads.

Effect classes (orchestrator/tools/mcp.py, effect_class): a read-only tool is called at once
(no WAL entry); any other goes through the WAL (`mcp.call`, the idempotency key in `_meta`),
and a non-idempotent one waits for a reviewer by default (toolbox.needs_approval). MCP
tools reach outside the harness: only an admin may grant them (tasktypes/agent.py,
authorize); a server being declared by the installation is what enables it.
"""
import logging
import re

from ..tools import mcp
from ..tools.base import ToolError
from . import toolbox

log = logging.getLogger(__name__)

WILDCARD = "*"
FUNCTION_NAME_LENGTH = 64  # what Chat Completions servers accept for a function name


def offered_name(server: str, tool: str) -> str:
    return f"{server}{mcp.SEPARATOR}{re.sub(r'[^A-Za-z0-9_-]', '_', tool)}"


def parse(name: str) -> tuple[str, str] | None:
    """(server, tool part) of `<server>__<tool>` or `<server>__*` naming a declared server."""
    parts = mcp.split_name(name)
    if parts is None or mcp.server(parts[0]) is None:
        return None
    return parts


def declared(name: str) -> bool:
    """Whether `name` is an MCP tool (or `<server>__*`) of a server declared now. Whether the
    tool exists is the server's to say, when asked (`missing`, at creation; each turn)."""
    return parse(name) is not None


def is_wildcard(name: str) -> bool:
    parts = parse(name)
    return parts is not None and parts[1] == WILDCARD


def _listing(config: mcp.ServerConfig, *, refresh: bool = False) -> dict[str, mcp.ListedTool]:
    """{offered name: the server's tool} (ToolError when the server cannot be reached)."""
    found: dict[str, mcp.ListedTool] = {}
    for tool in mcp.list_tools(config, refresh=refresh).values():
        name = offered_name(config.name, tool.name)
        if len(name) > FUNCTION_NAME_LENGTH or name in found:
            log.warning("MCP tool %s of %s left out: its offered name %s is too long or taken", tool.name,
                        config.name, name, extra={"mcp_server": config.name})
            continue
        found[name] = tool
    return found


def tools_of(server: str, *, refresh: bool = False) -> list[str]:
    """The offered names of a server's tools now ([] when it is not declared; ToolError when
    it cannot be reached)."""
    config = mcp.server(server)
    return list(_listing(config, refresh=refresh)) if config else []


def find(name: str) -> toolbox.AgentTool | None:
    """The agent tool `name`, if its server is declared and has it now."""
    parts = parse(name)
    if parts is None or parts[1] == WILDCARD:
        return None
    config = mcp.server(parts[0])
    try:
        listed = _listing(config).get(name)
        if listed is None:  # added since the listing, or gone: ask the server again
            listed = _listing(config, refresh=True).get(name)
    except ToolError as exc:
        log.warning("MCP tool %s unavailable: %s", name, exc, extra={"mcp_server": config.name})
        return None
    if listed is None:
        return None
    return _agent_tool(config, name, listed)


def _agent_tool(config: mcp.ServerConfig, name: str, listed: mcp.ListedTool) -> toolbox.AgentTool:
    effect = mcp.effect_class(listed.annotations, config.effect_override(listed.name))
    description = listed.description or f"{listed.name} (a tool of the MCP server {config.name})"
    return toolbox.AgentTool(name, description, None, _runner(config.name, listed.name, effect), effect=effect,
                             parameters=listed.input_schema)


def agent_tools(server: str, *, refresh: bool = False) -> dict[str, toolbox.AgentTool]:
    """{offered name: agent tool} of every tool a declared server has now ({} when it is not
    declared; ToolError when it cannot be reached): what a task's fingerprint digests
    (tasktypes/fingerprint.py), with the effect class the harness gives each."""
    config = mcp.server(server)
    if config is None:
        return {}
    return {name: _agent_tool(config, name, listed) for name, listed in _listing(config, refresh=refresh).items()}


def names() -> list[str]:
    """Every MCP tool name there is now (servers that cannot be reached are left out)."""
    found: list[str] = []
    for server in mcp.servers():
        try:
            found += tools_of(server)
        except ToolError as exc:
            log.warning("MCP server %s left out of the tool names: %s", server, exc, extra={"mcp_server": server})
    return found


def expand(names_: list[str]) -> list[str]:
    """`names_` with each `<server>__*` replaced by that server's tools now (none when it
    cannot be reached), in order, without repeats."""
    expanded: list[str] = []
    for name in names_:
        if is_wildcard(name):
            try:
                expanded += tools_of(parse(name)[0])
            except ToolError as exc:
                log.warning("MCP tools of %s not offered: %s", name, exc)
        else:
            expanded.append(name)
    return list(dict.fromkeys(expanded))


def covered(name: str, names_: list[str]) -> bool:
    """Whether `names_` (a task's tools) grant `name`: by name, or by its server's `<server>__*`."""
    if name in names_:
        return True
    parts = mcp.split_name(name)
    return parts is not None and f"{parts[0]}{mcp.SEPARATOR}{WILDCARD}" in names_


def missing(names_: list[str]) -> list[str]:
    """Of the MCP names in `names_`, those the servers say they do not have (or that cannot
    be checked: the server is unreachable), each with why."""
    problems, listings = [], {}
    for name in names_:
        parts = parse(name)
        if parts is None:
            continue
        try:
            if parts[0] not in listings:  # each server asked once, afresh
                listings[parts[0]] = tools_of(parts[0], refresh=True)
            have = listings[parts[0]]
        except ToolError as exc:
            problems.append(f"{name}: {exc}")
            continue
        if parts[1] != WILDCARD and name not in have:
            problems.append(f"{name}: the MCP server {parts[0]} has no such tool (it has: "
                            f"{', '.join(have) or 'none'})")
    return problems


def _runner(server: str, tool: str, effect: str):
    def run(ctx, arguments: dict):
        config = mcp.server(server)
        if config is None:
            raise toolbox.ToolCallError(f"the MCP server {server} is no longer declared on this installation")
        if effect == mcp.READ_ONLY:
            result = mcp.call(config, tool, arguments, token=ctx.token)  # nothing to log: it only reads
        else:
            result = ctx.effect("mcp.call", {"server": server, "tool": tool, "arguments": arguments,
                                             "effect": effect})
        return mcp.result_text(result)

    return run


toolbox.add_source(find, names)
