"""The tools by name: the built-in ones (each module registers its classes with
tools/base.py's `register` when imported) and those an extension registered. Apart from base.py so
that the built-in tools import base and this module imports them, not the reverse."""
from .base import _TOOLS, Tool, ToolError


def get_tool(name: str) -> Tool:
    _load_builtin()
    try:
        return _TOOLS[name]
    except KeyError:
        raise ToolError(f"Unknown tool {name!r}; known tools: {', '.join(sorted(_TOOLS))}") from None


def all_tools() -> dict[str, Tool]:
    _load_builtin()
    return dict(_TOOLS)


_builtin_loaded = False


def _load_builtin() -> None:
    # Once per process: an import statement is a lookup per module even when imported, and this
    # runs on every effect.
    global _builtin_loaded
    if _builtin_loaded:
        return
    from . import db, email, http, mcp, shell  # noqa: F401  (each registers itself)
    _builtin_loaded = True
