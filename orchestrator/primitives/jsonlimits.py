"""JSON from outside (API and webhook bodies, the send form, websocket messages) read with a
bound on nesting and without the NUL character.

Nesting: Python's json raises RecursionError (not ValueError) past ~1000 levels, which every
caller let through as a 500 or a websocket close 1011; and a payload a little under that
parses, is stored, then breaks whatever renders it recursively (the task page's indented JSON).
Real events nest a few levels; MAX_DEPTH leaves room for more.

NUL: PostgreSQL stores no U+0000 in text or jsonb; a string holding one (`"\\u0000"`, legal
JSON) failed the write that stored it with a 500 (a task's title, a pause's reason, a webhook's
payload). It is refused on both databases, saying where it is."""
import json
from .errors import HarnessError

MAX_DEPTH = 64


class Unreadable(HarnessError, ValueError):
    """JSON from outside that is refused (its message says why and what to send instead)."""


class TooDeep(Unreadable):
    def __init__(self, limit: int = MAX_DEPTH):
        super().__init__(f"the JSON is nested more than {limit} levels deep: send a flatter document")


class HoldsNul(Unreadable):
    def __init__(self, where: str):
        super().__init__(f"the JSON holds the NUL character (\\u0000) in {where}, which cannot be stored: "
                         f"remove it")


def _holds_nul(value) -> bool:
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, dict):
            if any("\x00" in key for key in item if isinstance(key, str)):
                return True
            children = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            children = (item,)
        for child in children:  # strings checked here, containers later: a row of scalars is one loop
            if isinstance(child, str):
                if "\x00" in child:
                    return True
            elif isinstance(child, (dict, list, tuple)):
                pending.append(child)
    return False


def nul_at(value, path: str = "") -> str | None:
    """Where (a dotted path, `[i]` for list items) the first string or key holding NUL is; None if none."""
    if not _holds_nul(value):  # the common case, without building a path per item
        return None
    pending = [(value, path)]
    while pending:
        item, where = pending.pop()
        if isinstance(item, str):
            if "\x00" in item:
                return where or "the document"
        elif isinstance(item, dict):
            for key, child in item.items():
                inner = f"{where}.{key}" if where else str(key)
                if "\x00" in key:
                    return f"the key {inner.replace(chr(0), '')!r}"  # its children are never walked
                pending.append((child, inner))
        elif isinstance(item, (list, tuple)):
            pending.extend((child, f"{where}[{i}]") for i, child in enumerate(item))
    return None


def check_depth(value, limit: int = MAX_DEPTH):
    """`value` itself if no list or object in it is nested deeper than `limit`; else TooDeep."""
    pending = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        if depth > limit:
            raise TooDeep(limit)
        pending.extend((child, depth + 1) for child in children)
    return value


def loads(text: str | bytes, limit: int = MAX_DEPTH):
    """json.loads with a bound on nesting (TooDeep, a ValueError, instead of a RecursionError)
    and no NUL in any string or key (HoldsNul)."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise TooDeep(limit) from None
    check_depth(value, limit)
    # Strict JSON has no raw control character in a string: a NUL can only come escaped.
    if ("\\u0000" in text) if isinstance(text, str) else (b"\\u0000" in text):
        where = nul_at(value)
        if where is not None:
            raise HoldsNul(where)
    return value
