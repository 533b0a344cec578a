"""Which columns of a locked task row its copy changed since it was read.

A status change used to save the whole row: some 45 columns, the JSON ones (params, limits,
compat, the stack, ...) encoded and quoted on every save, though a transition changes a
handful. The row is read under its lock (states.lock_task), so nothing but the holder's own
transaction can change it until it commits: the columns whose value differs from what was
read are exactly those to write. JSON columns are compared by their encoding, so a value
changed in place (task.stack.append(...)) counts as changed.
"""
import json

from django.db import models

from ..models import Task

_FIELDS = [f for f in Task._meta.concrete_fields if not f.primary_key]
_JSON = tuple(f.attname for f in _FIELDS if isinstance(f, models.JSONField))
_PLAIN = tuple(f.attname for f in _FIELDS if not isinstance(f, models.JSONField))


def _encoded(value) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def remember(task: Task) -> None:
    """Note the row as read (or as just saved): the base `changed` compares with."""
    values = task.__dict__
    task._as_read = (tuple(values[name] for name in _PLAIN), tuple(_encoded(values[name]) for name in _JSON))


def changed(task: Task) -> list[str] | None:
    """The columns whose value on `task` differs from the row as remembered; None when the
    row was not read through `remember` (the caller saves the whole row)."""
    read = task.__dict__.get("_as_read")
    if read is None:
        return None
    values = task.__dict__
    plain, encoded = read
    found = [name for name, before in zip(_PLAIN, plain) if values[name] != before]
    found += [name for name, before in zip(_JSON, encoded) if _encoded(values[name]) != before]
    return found
