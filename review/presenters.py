"""How a tool call reads to a person: the review page shows a proposed call (or an effect in
doubt) the way its reader thinks of it, not as JSON with `\\n` escapes.

- an email: To / Cc / Subject / Body (the body as text, its line breaks kept);
- an HTTP request: method, URL, headers and the body (pretty JSON);
- a command: its argv, one argument per line, and the line a shell would show;
- an MCP call (`<server>__<tool>`): the server, the tool and its arguments;
- any other tool: its arguments as a definition list.
A tool is recognised by its name (the agent's and the harness's names), else by the shape of
its arguments (an extension's own mail tool reads as an email too).

Values are shown as given: the caller passes arguments already redacted (review/views.py is
the page's redaction boundary), and the template escapes them.
"""
import json
import shlex
from dataclasses import dataclass, field

from orchestrator.models import AgentMessage

EMAIL_TOOLS = {"email_send", "email.send"}
HTTP_TOOLS = {"http_request", "http.request"}
SHELL_TOOLS = {"shell_run", "shell.run"}
MCP_SEPARATOR = "__"  # how an MCP server's tools reach the model: <server>__<tool>
# Arguments the harness's own tools carry for themselves, not for the reader.
INTERNAL_ARGUMENTS = {"egress", "sandbox"}


@dataclass
class Argument:
    name: str
    text: str  # a string as is; anything else as pretty JSON
    structured: bool = False  # shown as code (JSON), not prose


@dataclass
class CallView:
    kind: str  # email | http | shell | mcp | arguments
    tool: str
    heading: str
    # email
    to: list[str] = field(default_factory=list)
    cc: list[str] = field(default_factory=list)
    subject: str = ""
    body: str = ""
    # http
    method: str = ""
    url: str = ""
    body_is_json: bool = False
    # shell
    argv: list[str] = field(default_factory=list)
    command_line: str = ""
    # mcp
    server: str = ""
    mcp_tool: str = ""
    # what the kind's own fields do not show (and every argument of a plain tool)
    arguments: list[Argument] = field(default_factory=list)


def _pretty(value) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True, default=str)


def _argument(name: str, value) -> Argument:
    if isinstance(value, str):
        return Argument(name, value)
    return Argument(name, _pretty(value), structured=True)


def _addresses(value) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    if isinstance(value, (list, tuple)):
        return [str(v) for v in value]
    return [str(value)]


def _rest(arguments: dict, shown: set[str]) -> list[Argument]:
    return [_argument(k, v) for k, v in arguments.items() if k not in shown and k not in INTERNAL_ARGUMENTS]


def _looks_like_email(arguments: dict) -> bool:
    return {"to", "subject", "body"} <= set(arguments)


def _looks_like_http(arguments: dict) -> bool:
    return isinstance(arguments.get("url"), str) and "method" in arguments


def _looks_like_command(arguments: dict) -> bool:
    return isinstance(arguments.get("argv"), list)


def present_call(tool: str, arguments) -> CallView:
    """`tool(arguments)` as a person reads it."""
    if not isinstance(arguments, dict):
        return CallView("arguments", tool, f"Call of {tool}", arguments=[_argument("arguments", arguments)])
    if tool in EMAIL_TOOLS or _looks_like_email(arguments):
        return CallView("email", tool, "Email", to=_addresses(arguments.get("to")), cc=_addresses(arguments.get("cc")),
                        subject=str(arguments.get("subject", "")), body=str(arguments.get("body", "")),
                        arguments=_rest(arguments, {"to", "cc", "subject", "body"}))
    if tool in HTTP_TOOLS or _looks_like_http(arguments):
        # The agent's tool calls it json_body; the harness's http.request, json (or body).
        body_key = next((k for k in ("json_body", "json", "body", "data") if arguments.get(k) is not None), None)
        body = arguments.get(body_key) if body_key else None
        return CallView("http", tool, "HTTP request", method=str(arguments.get("method", "GET")).upper(),
                        url=str(arguments.get("url", "")),
                        body="" if body is None else (body if isinstance(body, str) else _pretty(body)),
                        body_is_json=body is not None and not isinstance(body, str),
                        arguments=_rest(arguments, {"method", "url", "json_body", "json", "body", "data"}))
    if tool in SHELL_TOOLS or _looks_like_command(arguments):
        argv = [str(a) for a in arguments.get("argv") or []]
        return CallView("shell", tool, "Command", argv=argv, command_line=shlex.join(argv),
                        arguments=_rest(arguments, {"argv"}))
    if MCP_SEPARATOR in tool:
        server, _, name = tool.partition(MCP_SEPARATOR)
        return CallView("mcp", tool, "MCP tool call", server=server, mcp_tool=name,
                        arguments=[_argument(k, v) for k, v in arguments.items()])
    return CallView("arguments", tool, f"Call of {tool}", arguments=[_argument(k, v) for k, v in arguments.items()])


@dataclass
class Reasoning:
    text: str  # what the model said in the turn that made the call
    thinking: str = ""  # its reasoning stream, where the server sends one
    turn: int | None = None
    other_calls: list[str] = field(default_factory=list)  # the turn's other tool calls, by name


def turn_of(step_id: str) -> int | None:
    """The agent turn whose answer proposed the call of tool step `tool-TTT-I`."""
    parts = step_id.split("-")
    if len(parts) == 3 and parts[0] == "tool" and parts[1].isdigit():
        return int(parts[1])
    return None


def reasoning_for(task_id: int, step_id: str, call_id: str, fallback: str = "") -> Reasoning:
    """The model's words that led to a proposed call: the assistant message of the turn that
    made it (the dialog is stored as it happens, orchestrator/agent/history.py), its newest
    complete generation; else `fallback` (the text the step recorded when it asked)."""
    turn = turn_of(step_id)
    message = None
    if turn is not None:
        message = (AgentMessage.objects.filter(task_id=task_id, role=AgentMessage.Role.ASSISTANT, turn=turn,
                                               interrupted=False)
                   .order_by("-generation", "-id").first())
    if message is None:
        return Reasoning(text=fallback, turn=turn)
    others = [c.get("name", "") for c in message.tool_calls or [] if c.get("id") != call_id]
    return Reasoning(text=message.content or fallback, thinking=getattr(message, "reasoning", "") or "", turn=turn,
                     other_calls=others)
