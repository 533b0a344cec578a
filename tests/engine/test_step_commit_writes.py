"""What a step commit costs the database beyond its rows: a new version of the task row in each of
its indexes, and an index entry per row. The commit leaves heartbeat_at (indexed, for the sweeper)
to the supervisor, so PostgreSQL updates the task row in place (a HOT update: no index entries);
the per-task tables keep one composite index that starts with task_id and no one-column twin."""
import pytest
from django.apps import apps
from django.db import connection

from orchestrator.engine import services
from orchestrator.engine.worker import drive_inline
from orchestrator.models import Task

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.task_types("tests.support.testtypes")]


def _task_updates() -> tuple[int, int]:
    """(updates, of which HOT) of the task table so far, this backend's pending counts flushed."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_force_next_flush()")
        cursor.execute("SELECT 1")  # the flush happens when the backend next goes idle
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute("SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relname = %s",
                       [Task._meta.db_table])
        return cursor.fetchone()


def test_each_step_commit_updates_the_task_row_in_place_on_postgresql():
    if connection.vendor != "postgresql":
        pytest.skip("HOT updates are PostgreSQL's")
    steps = 200
    task = services.task_create(type="test.long", params={"steps": steps})
    updates_before, hot_before = _task_updates()
    assert drive_inline(task.pk) == "completed"
    updates, hot = (after - before for after, before in zip(_task_updates(), (updates_before, hot_before)))
    # Writing heartbeat_at in the commit makes every one of them a new version in all ~12 indexes
    # (0 HOT); the claim, the status changes and the supervisor's heartbeats are the non-HOT rest.
    # HOT is PostgreSQL's best effort: the new version must fit in the row's page, whose dead
    # versions are pruned only once no snapshot can see them — a read in flight beside the commits
    # (the supervisor's) can leave the page full for one update (seen once in 200, CI of stop 38).
    assert hot >= steps * 0.95, f"{hot} of {updates} task row updates were HOT for {steps} step commits"


def _per_task_models():
    for model in apps.get_app_config("orchestrator").get_models():
        for field in model._meta.concrete_fields:
            if field.is_relation and field.related_model is Task and not field.null:
                yield model, field


def test_each_per_task_table_is_found_by_task_through_one_index_that_starts_with_task_id():
    found = []
    with connection.cursor() as cursor:
        for model, field in _per_task_models():
            indexes = [c["columns"] for c in connection.introspection.get_constraints(
                cursor, model._meta.db_table).values() if c["index"] or c["unique"]]
            led = [columns for columns in indexes if columns and columns[0] == field.column]
            # Lookups and cascades by task need an index led by task_id ...
            assert led, f"{model.__name__}: no index starts with {field.column}: {indexes}"
            # ... and a one-column one beside a composite one only costs a write per row.
            if any(len(columns) > 1 for columns in led):
                assert [field.column] not in led, f"{model.__name__}: redundant index on {field.column}"
            found.append(model.__name__)
    assert {"Step", "Snapshot", "TaskEvent", "WalEntry", "InboundEvent", "AgentMessage"} <= set(found)
