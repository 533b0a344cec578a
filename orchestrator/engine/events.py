"""The durable progress log: append inside a transaction, publish only after commit.

`seq` rises by one per task with no gaps: it is taken from Task.event_seq while the task
row is locked by the writing transaction. Channel messages are only hints to wake
listeners; readers fetch events from the database by seq.
"""
import json
import logging
from datetime import datetime

from django.db import connection, transaction
from django.db.models import F
from django.utils import timezone

from ..models import AuditEntry, Task, TaskEvent
from . import row_changes

log = logging.getLogger(__name__)


def task_group(task_id: int) -> str:
    return f"task-{task_id}"


TASK_LIST_GROUP = "tasks"


def append_event(task: Task, kind: str, payload: dict) -> None:
    """Append one event to `task`'s log in the current transaction."""
    task.event_seq, task.updated_at = _reserve(task.pk, 1)  # the copy stays what the row says
    create_event(task, task.event_seq, kind, payload)


# --- the seq: Task.event_seq is written here and nowhere else (tests/engine/test_one_writer.py) ---

def reserve(task_id: int, n: int = 1) -> int:
    """Reserve the next `n` seqs of task `task_id` in the current transaction, whatever the
    caller's copy of the row says; returns the last. The row stays locked until the
    transaction ends, so the seqs are taken in order, without gaps."""
    return _reserve(task_id, n)[0]


def _reserve(task_id: int, n: int) -> tuple[int, datetime]:
    """`reserve`, with the task's new `updated_at`."""
    # updated_at moves too: the web process's tailer finds changed tasks by it.
    now = timezone.now()
    if connection.features.can_return_columns_from_insert:  # PostgreSQL; SQLite 3.35+
        # One round trip instead of an UPDATE and a SELECT (every status change, every task created).
        with connection.cursor() as cursor:
            cursor.execute(f"UPDATE {Task._meta.db_table} SET event_seq = event_seq + %s, updated_at = %s "
                           f"WHERE id = %s RETURNING event_seq",
                           [n, connection.ops.adapt_datetimefield_value(now), task_id])
            row = cursor.fetchone()
        if row is None:
            raise Task.DoesNotExist(f"task {task_id} does not exist")
        return row[0], now
    Task.objects.filter(pk=task_id).update(event_seq=F("event_seq") + n, updated_at=now)
    return Task.objects.values_list("event_seq", flat=True).get(pk=task_id), now


def reserve_locked(task: Task, n: int = 1, *, saving=()) -> int:
    """Reserve the next `n` seqs of `task`, whose row the caller's transaction locked and read
    (lock_fenced, lock_task): one UPDATE saves them with `saving`, the other columns the
    caller changed on `task` (no extra round trip). Returns the last seq reserved."""
    task.event_seq += n
    task.save(update_fields=[*saving, "event_seq", "updated_at"])
    return task.event_seq


def save_with_events(task: Task, appended: list[tuple[str, dict]], *, always=(), audit: dict | None = None) -> None:
    """Save `task` (locked and read by the caller's transaction, then changed) and append
    `appended` ((kind, payload) in order), their seqs reserved by that same UPDATE: one
    statement fewer than a save then `append_event` (every status change). The copy's seq is
    the row's (the row is locked). Saved: the `always` columns and those the copy changed
    since lock_task read it (row_changes); the whole row when it was read otherwise."""
    first = task.event_seq + 1
    task.event_seq += len(appended)
    changed = row_changes.changed(task)
    if changed is None:
        task.save()
    else:
        task.save(update_fields={*always, *changed, "event_seq", "updated_at"})
        row_changes.remember(task)  # a second change in the same transaction compares with this one
    create_events(task, first, appended, audit=audit)


def reserve_for_new(task: Task) -> int:
    """The first seq of a task about to be inserted (the INSERT saves it): its first event
    needs no UPDATE of the row (every task created)."""
    task.event_seq = 1
    return task.event_seq


def reserve_sql() -> str:
    """The reservation of one seq as a SET item of the UPDATE of the task row in a commit
    written as SQL (engine/checkpoint.py); the statement returns event_seq, the seq reserved."""
    return "event_seq = event_seq + 1"


NOTIFY_CHANNEL = "orchestrator_tasks"


def create_event(task: Task, seq: int, kind: str, payload: dict) -> None:
    """Insert an event whose seq the caller already reserved on the locked task row."""
    create_events(task, seq, [(kind, payload)])


def create_events(task: Task, first_seq: int, appended: list[tuple[str, dict]], *, audit: dict | None = None) -> None:
    """Insert events whose seqs, from `first_seq` on, the caller already reserved on the
    locked task row; listeners are woken once, for the last. One statement on PostgreSQL (the
    rows and the NOTIFY; written as SQL: the ORM's create cost more than the database's work
    on every status change) — with `audit` (an AuditEntry's fields: a status change's entry),
    that row too, where it was a statement of its own twice in every task's life."""
    seq = first_seq + len(appended) - 1
    created_at = connection.ops.adapt_datetimefield_value(timezone.now())
    rows = ", ".join(["(%s, %s, %s, %s, %s)"] * len(appended))
    params = [value for i, (kind, payload) in enumerate(appended)
              for value in (task.pk, first_seq + i, kind, json.dumps(payload), created_at)]
    insert = (f"INSERT INTO {TaskEvent._meta.db_table} (task_id, seq, kind, payload, created_at) VALUES {rows}")
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            # NOTIFY is delivered by PostgreSQL at commit (never for a rolled-back transaction):
            # it wakes the web processes' LISTEN at once, with or without Redis. A data-modifying
            # WITH runs whether or not the query reads it.
            audited, audit_params = _audit_cte(audit) if audit is not None else ("", [])
            cursor.execute(f"WITH inserted AS ({insert}){audited} SELECT pg_notify(%s, %s)",
                           [*params, *audit_params, NOTIFY_CHANNEL,
                            f"{task.pk}:{seq}:{task.status}:{task.steps_done}:{task.steps_total}"])
        else:
            cursor.execute(insert, params)
            if audit is not None:
                AuditEntry.objects.create(**audit)
    transaction.on_commit(lambda: publish_hint(task.pk, seq, task.status, task.steps_done, task.steps_total))


_AUDIT_FIELDS = ("actor", "actor_name", "at", "ip", "action", "task", "before", "after", "reason")


def _audit_cte(audit: dict) -> tuple[str, list]:
    """An AuditEntry's INSERT as a common table expression of create_events' statement: its
    values prepared by the model's fields, as the ORM's create would."""
    entry = AuditEntry(**{"at": timezone.now(), **audit})
    fields = [AuditEntry._meta.get_field(name) for name in _AUDIT_FIELDS]
    columns = ", ".join(connection.ops.quote_name(field.column) for field in fields)
    values = [field.get_db_prep_save(getattr(entry, field.attname), connection) for field in fields]
    return (f", audited AS (INSERT INTO {AuditEntry._meta.db_table} ({columns}) "
            f"VALUES ({', '.join(['%s'] * len(fields))}))", values)


def publish_hint(task_id: int, seq: int, status: str, steps_done: int, steps_total: int) -> None:
    """Tell listeners that task `task_id` has events up to `seq`. Best effort.

    Only a cross-process layer (Redis) can carry it from a worker; the in-memory layer
    would reach nobody, so publishing there is skipped (it costs ~1 ms per step).
    """
    layer = cross_process_layer()
    if layer is None:
        return
    message = {"type": "task.changed", "task_id": task_id, "seq": seq, "status": status,
               "steps_done": steps_done, "steps_total": steps_total}

    async def send():
        await layer.group_send(task_group(task_id), message)
        await layer.group_send(TASK_LIST_GROUP, message)

    try:
        from asgiref.sync import async_to_sync

        async_to_sync(send)()
    except Exception:  # a lost hint is harmless: the database is the truth
        log.debug("could not publish hint", exc_info=True, extra={"task_id": task_id, "event_id": seq})


def cross_process_layer():
    from channels.layers import InMemoryChannelLayer, get_channel_layer

    layer = get_channel_layer()
    return None if layer is None or isinstance(layer, InMemoryChannelLayer) else layer
