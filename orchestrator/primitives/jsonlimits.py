"""JSON from outside (webhook bodies, the send form, websocket messages) read with a bound
on nesting. Python's json raises RecursionError (not ValueError) past ~1000 levels, which
every caller let through as a 500 or a websocket close 1011; and a payload a little under
that parses, is stored, then breaks whatever renders it recursively (the task page's
indented JSON). Real events nest a few levels; MAX_DEPTH leaves room for more."""
import json
from .errors import HarnessError

MAX_DEPTH = 64


class TooDeep(HarnessError, ValueError):
    def __init__(self, limit: int = MAX_DEPTH):
        super().__init__(f"the JSON is nested more than {limit} levels deep: send a flatter document")


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
    """json.loads with a bound on nesting: TooDeep (a ValueError) instead of a RecursionError."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise TooDeep(limit) from None
    return check_depth(value, limit)
