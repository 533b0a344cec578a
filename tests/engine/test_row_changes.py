"""A status change saves the columns that changed, not the whole row (engine/row_changes.py):
what the caller changed on its copy of the locked row lands, in place or not; what the same
transaction wrote to the row by other statements is not overwritten with the copy's stale value;
a row read some other way is still saved whole."""
import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

from orchestrator.engine import services, states
from orchestrator.models import Task, TaskStatus as S

pytestmark = pytest.mark.django_db(transaction=True)


def new_task() -> Task:
    return services.task_create(type="demo.migrate_rows", params={"rows": 10, "batch_size": 5, "rate": 1.0})


def test_the_changes_made_on_the_copy_before_a_transition_are_saved_in_place_changes_too():
    task = new_task()
    with transaction.atomic():
        locked = states.lock_task(task.pk)
        locked.title = "renamed before the change"
        locked.stack.append({"frame": "kept"})  # changed in place: no assignment to the field
        locked.params["rate"] = 3.0
        states.transition(locked, S.PAUSED, reason="held")
    row = Task.objects.get(pk=task.pk)
    assert (row.status, row.status_reason, row.title) == (S.PAUSED, "held", "renamed before the change")
    assert row.stack == [{"frame": "kept"}]
    assert row.params["rate"] == 3.0
    assert row.event_seq == task.event_seq + 1  # the status event's seq, saved with the row


def test_a_transition_writes_only_the_columns_that_changed():
    task = new_task()
    with transaction.atomic():
        locked = states.lock_task(task.pk)
        # Another statement of the same transaction writes a column the copy still holds stale.
        Task.objects.filter(pk=task.pk).update(tokens_used=42)
        with CaptureQueriesContext(connection) as queries:
            states.transition(locked, S.PAUSED, reason="held")
    update = next(q["sql"] for q in queries.captured_queries if q["sql"].startswith("UPDATE"))
    assert "tokens_used" not in update and '"params"' not in update and '"compat"' not in update
    assert Task.objects.get(pk=task.pk).tokens_used == 42  # not overwritten with the copy's 0


def test_two_changes_in_one_transaction_each_save_what_they_changed():
    task = new_task()
    with transaction.atomic():
        locked = states.lock_task(task.pk)
        states.transition(locked, S.PAUSED, reason="first")
        locked.title = "between the two"
        states.transition(locked, S.QUEUED, reason="second")
    row = Task.objects.get(pk=task.pk)
    assert (row.status, row.status_reason, row.title) == (S.QUEUED, "second", "between the two")
    assert row.event_seq == task.event_seq + 2


def test_a_row_read_without_lock_task_is_saved_whole():
    task = new_task()
    with transaction.atomic():
        locked = Task.objects.select_for_update().get(pk=task.pk)
        locked.title = "read by the ORM"
        states.transition(locked, S.PAUSED, reason="held")
    row = Task.objects.get(pk=task.pk)
    assert (row.status, row.title) == (S.PAUSED, "read by the ORM")


def test_a_status_changes_audit_entry_is_written_with_its_events_alike_on_either_database(make_user):
    """states.transition's audit entry: on PostgreSQL a CTE of the events' statement (the change
    is the row's UPDATE and one more statement), on SQLite the ORM's INSERT — the same row."""
    from orchestrator.models import AuditEntry

    olga = make_user("olga", "operator")
    task = new_task()
    with transaction.atomic():
        locked = states.lock_task(task.pk)
        with CaptureQueriesContext(connection) as queries:
            states.transition(locked, S.PAUSED, reason="held for the audit", actor=olga, ip="203.0.113.9",
                              action="task.pause")
        states.transition(locked, S.QUEUED, reason="")  # no actor: the system's
    written = [q["sql"] for q in queries.captured_queries]
    if connection.vendor == "postgresql":
        assert len(written) == 2 and "orchestrator_auditentry" in written[1], written
    entries = list(AuditEntry.objects.filter(task=task).exclude(action="task.create").order_by("id")
                   .values("actor_id", "actor_name", "ip", "action", "before", "after", "reason", "at"))
    first, second = entries
    assert {k: v for k, v in first.items() if k != "at"} == {
        "actor_id": olga.pk, "actor_name": "olga", "ip": "203.0.113.9", "action": "task.pause",
        "before": {"status": "queued"}, "after": {"status": "paused", "reason": "held for the audit"},
        "reason": "held for the audit"}
    assert {k: v for k, v in second.items() if k != "at"} == {
        "actor_id": None, "actor_name": "system", "ip": None, "action": "status:queued",
        "before": {"status": "paused"}, "after": {"status": "queued"}, "reason": ""}
    assert first["at"] is not None and first["at"] <= second["at"]


def test_a_task_creations_audit_entry_is_written_with_its_event_alike_on_either_database(make_user):
    """services.task_create: the creation's audit entry is a CTE of its `created` event's statement
    on PostgreSQL (no INSERT of its own), the ORM's INSERT after the event on SQLite — the same row."""
    from orchestrator.models import AuditEntry, TaskEvent

    olga = make_user("olga", "operator")
    with CaptureQueriesContext(connection) as queries:
        task = services.task_create(type="demo.migrate_rows", params={"rows": 10, "batch_size": 5, "rate": 1.0},
                                    actor=olga, ip="203.0.113.9")
    written = [q["sql"] for q in queries.captured_queries]
    if connection.vendor == "postgresql":
        assert not any(sql.startswith('INSERT INTO "orchestrator_auditentry"') for sql in written), written
        assert [sql for sql in written if "orchestrator_auditentry" in sql and "orchestrator_taskevent" in sql], written
    (entry,) = AuditEntry.objects.filter(task=task).values("actor_id", "actor_name", "ip", "action", "after", "at")
    assert {k: v for k, v in entry.items() if k != "at"} == {
        "actor_id": olga.pk, "actor_name": "olga", "ip": "203.0.113.9", "action": "task.create",
        "after": {"type": "demo.migrate_rows", "params": task.params, "limits": task.limits}}
    assert entry["at"] is not None
    assert list(TaskEvent.objects.filter(task=task).values_list("seq", "kind")) == [(1, "created")]
