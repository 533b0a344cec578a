"""What both sides of the harness's MCP code use: a server's configuration, a tool as a server
lists it, a call's result as the model reads it, the `_meta` key the idempotency key travels
in. tools/mcp.py (the configuration and the mcp.call tool) and tools/mcp_client.py (the sessions,
on the SDK) import it; the first loads the second only on first use (the SDK's import is slow),
and neither imports the other's module for these."""
import json
from dataclasses import dataclass, field
from typing import Any

# A _meta key of our own (the spec's naming rule: a reverse-DNS prefix that is not
# modelcontextprotocol's or mcp's, a slash, a name).
IDEMPOTENCY_META_KEY = "io.orchestrator/idempotency-key"


@dataclass(frozen=True)
class ServerConfig:
    """One MCP server: a stdio command or a streamable-HTTP url. `env` and `headers` are
    secrets (orchestrator/redaction_sources.py redacts their values everywhere)."""

    name: str
    command: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    url: str = ""
    headers: tuple[tuple[str, str], ...] = ()
    tool_effects: tuple[tuple[str, str], ...] = ()
    origin: str = "ORCH_MCP_SERVERS"
    timeout: float = field(default=60.0, compare=False)

    @property
    def transport(self) -> str:
        return "stdio" if self.command else "streamable-http"

    @property
    def connection(self) -> tuple:
        """What a session depends on: a change of any of it opens a new session."""
        return (self.command, self.env, self.url, self.headers)

    def effect_override(self, tool: str) -> str | None:
        return dict(self.tool_effects).get(tool)


@dataclass(frozen=True)
class ListedTool:
    """A tool as the server lists it (tools/list), in plain values."""

    name: str
    description: str
    input_schema: dict
    annotations: dict


def result_text(result: Any) -> str:
    """A call's result as the model reads it: the text parts, else the structured content,
    and a line for each part that is not text."""
    if not isinstance(result, dict) or "content" not in result:  # e.g. a reviewer's {"confirmed_by_reviewer": true}
        return result if isinstance(result, str) else json.dumps(result, ensure_ascii=False, default=str)
    parts = []
    for part in result.get("content") or []:
        if part.get("type") == "text":
            parts.append(part.get("text") or "")
        elif part.get("type") in ("resource_link", "resource"):
            parts.append(f"[{part['type']}: {part.get('uri', '')}]")
        else:
            parts.append(f"[{part.get('type', 'content')}: {part.get('mime_type') or ''} not shown]")
    text = "\n".join(p for p in parts if p)
    structured = result.get("structured_content")
    if structured is not None and not text:
        text = json.dumps(structured, ensure_ascii=False, default=str)
    return text or "(no content)"
