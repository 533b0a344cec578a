"""Values PostgreSQL can store: no NUL character (U+0000) in any string.

PostgreSQL refuses NUL in text and in jsonb; SQLite keeps it. What the harness stores but did
not read from a request — a model's answer, a tool's result, a step's result — may hold one (a
document with binary bytes, a model told to emit one): the write that stored it failed on
PostgreSQL only, and the step with it, again on every retry. Here NUL becomes U+FFFD (the
replacement character, shown where it was) on both databases. Requests are refused instead
(primitives/jsonlimits.py, nul_characters.py): a person can remove the character and send again.
"""
import json
import re
from typing import Any

NUL = "\x00"
REPLACEMENT = "\ufffd"
# A \u0000 escape in JSON text: the backslash before it is not itself escaped (an even run before it).
_ESCAPED_NUL = re.compile(r"(?<!\\)((?:\\\\)*)\\u0000")


def text(s: str) -> str:
    return s.replace(NUL, REPLACEMENT) if NUL in s else s


def json_text(s: str) -> str:
    """JSON text whose strings, once parsed, hold no NUL (escaped or raw)."""
    if "\\u0000" in s:
        s = _ESCAPED_NUL.sub(lambda m: m.group(1) + "\\ufffd", s)
    return text(s)


def value(v: Any) -> Any:
    """`v` (JSON-like: dicts, lists, strings, ...) with NUL replaced in every string and key;
    `v` itself when it holds none."""
    if isinstance(v, str):
        return text(v)
    if isinstance(v, dict):
        return {text(k) if isinstance(k, str) else k: value(item) for k, item in v.items()}
    if isinstance(v, (list, tuple)):
        return [value(item) for item in v]
    return v


def encoded(v: Any) -> tuple[str, Any]:
    """(the JSON text of `v`, `v`) with no NUL in either; one json.dumps and a scan when there is none."""
    encoded_text = json.dumps(v)
    if "\\u0000" not in encoded_text:  # json.dumps escapes every NUL (ensure_ascii)
        return encoded_text, v
    v = value(v)
    return json.dumps(v), v
