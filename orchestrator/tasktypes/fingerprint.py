"""A task type's compatibility fingerprint: what a paused task ran against, to compare on resume.

A flat {key: value} map (engine/compat.py compares it key by key and says what changed):

- "type": the type's name; "version": its declared `version`;
- "plan": the sha256 of its `plan` function's source (its qualified name when the source
  cannot be read);
- "tool:<name>": the sha256 of each tool's argument schema and effect class (the tools a type
  declares in `uses_tools`; an agent's granted tools), "absent" when no such tool is installed;
- an agent's (tasktypes/agent.py): "prompt:system", "prompt:summary" (digests) and "model"
  (the profile and the model it resolves to).

An MCP server's tools are not fingerprinted: the server says what they are at each turn (and
it may not be reachable when a task is resumed). Computed when a run starts and at every
resume; the digests are cached by the function and by the argument model class, so a run's
start pays a dictionary look-up for each.
"""
import hashlib
import inspect
import json
import weakref
from functools import lru_cache

ABSENT = "absent"  # a tool the fingerprint names that is not installed now
_SCHEMAS: "weakref.WeakKeyDictionary[type, str]" = weakref.WeakKeyDictionary()


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
    """{"tool:<name>": digest or ABSENT} for each tool name (an MCP server's are left out)."""
    from ..agent import mcp as mcp_tools, toolbox

    digests = {}
    for name in dict.fromkeys(names):
        if mcp_tools.declared(name):
            continue
        tool = toolbox.find_tool(name)
        digests[f"tool:{name}"] = tool_digest(tool) if tool is not None else ABSENT
    return digests


def base_fingerprint(task_type, params: dict) -> dict[str, str]:
    """What every task type's fingerprint holds: name, declared version, plan digest, its tools."""
    return {"type": task_type.name, "version": str(task_type.version),
            "plan": code_digest(type(task_type).plan), **tool_digests(task_type.uses_tools)}
