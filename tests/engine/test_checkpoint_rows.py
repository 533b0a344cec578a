"""The step commit is one statement on PostgreSQL and a few on SQLite (engine/commit_statement.py).
The two must not drift: the same checkpoints, run on each database, leave the same rows. The rows
(ids and times left out) are compared with one expected value, the same in both runs of the suite
(CI runs it on SQLite and on PostgreSQL), so a difference on either side fails."""
from datetime import timedelta

import pytest
from django.utils import timezone

from orchestrator.engine import checkpoint, lease as leases, services, snapshots, wal
from orchestrator.models import IdempotencyRecord, Snapshot, Step, Task, TaskEvent, WalEntry
from orchestrator.tasktypes import get_type
from tests.support.helpers import write_intent

pytestmark = pytest.mark.django_db(transaction=True)

TASK_FIELDS = ("status", "checkpoint_version", "event_seq", "steps_done", "steps_total", "tokens_used",
               "active_seconds")


def rows(task_id: int) -> dict:
    """What the commits left, without ids and times."""
    task = Task.objects.values(*TASK_FIELDS).get(pk=task_id)
    task["active_seconds"] = round(task["active_seconds"], 3)
    return {
        "task": task,
        "steps": list(Step.objects.filter(task_id=task_id).order_by("position")
                      .values("step_id", "status", "result", "reads", "attempts", "error")),
        "snapshots": list(Snapshot.objects.filter(task_id=task_id).order_by("version")
                          .values("version", "step_id", "full", "state")),
        "events": [{**e, "payload": {k: v for k, v in e["payload"].items() if k != "seconds"}}  # a duration
                   for e in TaskEvent.objects.filter(task_id=task_id, kind="step_done").order_by("seq")
                   .values("seq", "kind", "payload")],
        "wal": list(WalEntry.objects.filter(task_id=task_id).order_by("call_index")
                    .values("step_id", "call_index", "tool", "status", "result", "error")),
        "idempotency": list(IdempotencyRecord.objects.filter(key__startswith=f"rows-{task_id}-")
                            .order_by("key").values("result")),
    }


def started_migration(rows: int):
    """A demo.migrate_rows task claimed and its plan written: (task, lease, plan)."""
    task = services.task_create(type="demo.migrate_rows", params={"rows": rows, "batch_size": 50, "rate": 1.0})
    lease = leases.claim(task.pk)
    task_type = get_type(task.type)
    plan = checkpoint.ensure_plan(lease=lease, task_type=task_type, params=task_type.Params.model_validate(task.params))
    return task, lease, plan


def commit_done(lease, plan, step_ids) -> None:
    """Each step committed done in turn (result {"step": id}, one token and 0.5 s each)."""
    started = timezone.now() - timedelta(seconds=1)
    for step_id in step_ids:
        checkpoint.commit_step(lease=lease, plan=plan, step_id=step_id, result={"step": step_id}, reads=[],
                               effects=[], started_at=started, tokens_used=1, active_seconds=0.5)


def test_the_same_checkpoints_leave_the_same_rows_on_either_database():
    task, lease, plan = started_migration(rows=100)
    started = timezone.now() - timedelta(seconds=1)
    checkpoint.commit_step(lease=lease, plan=plan, step_id="prepare-source", result={"rows": 100, "note": "é"},
                           reads=["source"], effects=[], started_at=started, tokens_used=7, active_seconds=0.25)
    entry = write_intent(lease=lease, step_id="batch-0001", call_index=0, tool_name="db.upsert",
                         args={"rows": 50}, key=f"rows-{task.pk}-0", idempotent=True)
    checkpoint.commit_step(lease=lease, plan=plan, step_id="batch-0001", result={"copied": 50, "ids": [1, 2]},
                           reads=[], effects=[wal.CompletedEffect(entry.pk, f"rows-{task.pk}-0", "db.upsert",
                                                                  {"upserted": 50})],
                           started_at=started, tokens_used=3, active_seconds=0.5)

    assert rows(task.pk) == EXPECTED
# Taken from a run on SQLite; the PostgreSQL run must leave the very same.
EXPECTED = {'task': {'status': 'running',
          'checkpoint_version': 3,
          'event_seq': 5,
          'steps_done': 2,
          'steps_total': 3,
          'tokens_used': 10,
          'active_seconds': 0.75},
 'steps': [{'step_id': 'prepare-source',
            'status': 'done',
            'result': {'rows': 100, 'note': 'é'},
            'reads': ['source'],
            'attempts': 1,
            'error': ''},
           {'step_id': 'batch-0001',
            'status': 'done',
            'result': {'copied': 50, 'ids': [1, 2]},
            'reads': [],
            'attempts': 1,
            'error': ''},
           {'step_id': 'batch-0002',
            'status': 'pending',
            'result': None,
            'reads': [],
            'attempts': 0,
            'error': ''}],
 'snapshots': [{'version': 1,
                'step_id': '',
                'full': True,
                'state': {'params': {'rows': 100, 'batch_size': 50, 'rate': 1.0},
                          'limits': {'max_steps': 100000,
                                     'max_tokens': 10000000,
                                     'max_seconds': 86400.0,
                                     'max_subtasks': 4},
                          'status': 'running',
                          'steps': {'prepare-source': 'pending',
                                    'batch-0001': 'pending',
                                    'batch-0002': 'pending'},
                          'counters': {'steps_done': 0, 'tokens_used': 0, 'active_seconds': 0.0},
                          'stack': []}},
               {'version': 2,
                'step_id': 'prepare-source',
                'full': False,
                'state': {'steps': {'prepare-source': 'done'},
                          'status': 'running',
                          'counters': {'steps_done': 1, 'tokens_used': 7, 'active_seconds': 0.25}}},
               {'version': 3,
                'step_id': 'batch-0001',
                'full': False,
                'state': {'steps': {'batch-0001': 'done'},
                          'status': 'running',
                          'counters': {'steps_done': 2, 'tokens_used': 10, 'active_seconds': 0.75}}}],
 'events': [{'seq': 4,
             'kind': 'step_done',
             'payload': {'step': 'prepare-source', 'version': 2, 'steps_done': 1, 'steps_total': 3}},
            {'seq': 5,
             'kind': 'step_done',
             'payload': {'step': 'batch-0001', 'version': 3, 'steps_done': 2, 'steps_total': 3}}],
 'wal': [{'step_id': 'batch-0001',
          'call_index': 0,
          'tool': 'db.upsert',
          'status': 'done',
          'result': {'upserted': 50},
          'error': ''}],
 'idempotency': [{'result': {'upserted': 50}}]}


def test_a_commit_that_adds_steps_leaves_the_same_rows_on_either_database_in_one_statement_on_postgresql():
    """Steps a step adds (an agent's tool calls and next turn) are inserted by its commit: on
    PostgreSQL inside the one commit statement (their rows one JSON parameter), on SQLite in its
    transaction; the rows, the snapshot delta and the event are the same."""
    from django.db import connection

    from orchestrator.tasktypes.base import StepSpec

    task, lease, plan = started_migration(rows=100)
    added = [StepSpec("extra-a", title="Extra A", depends_on=("prepare-source",), reads=("rows",), on_failure="skip"),
             StepSpec("extra-b", depends_on=("extra-a",), runs_after_skipped=True)]
    statements = []

    def seen(execute, sql, params, many, context):
        statements.append(sql)
        return execute(sql, params, many, context)

    with connection.execute_wrapper(seen):  # the commit statement's prepared cursor included
        checkpoint.commit_step(lease=lease, plan=plan, step_id="prepare-source", result={"rows": 100}, reads=[],
                               effects=[], started_at=timezone.now(), added=added)
    if connection.vendor == "postgresql":
        assert len(statements) == 1 and "added_steps AS (INSERT INTO orchestrator_step" in statements[0], statements
    assert list(Step.objects.filter(task_id=task.pk, step_id__startswith="extra-").order_by("position").values(
        "step_id", "position", "title", "depends_on", "declared_reads", "on_failure", "runs_after_skipped", "before",
        "added_by", "generation", "status", "attempts", "reads", "result", "error")) == [
        {"step_id": "extra-a", "position": 3, "title": "Extra A", "depends_on": ["prepare-source"],
         "declared_reads": ["rows"], "on_failure": "skip", "runs_after_skipped": False, "before": [],
         "added_by": "prepare-source", "generation": 0, "status": "pending", "attempts": 0, "reads": [],
         "result": None, "error": ""},
        {"step_id": "extra-b", "position": 4, "title": "extra-b", "depends_on": ["extra-a"], "declared_reads": [],
         "on_failure": "", "runs_after_skipped": True, "before": [], "added_by": "prepare-source", "generation": 0,
         "status": "pending", "attempts": 0, "reads": [], "result": None, "error": ""}]
    assert Snapshot.objects.get(task_id=task.pk, version=2).state == {
        "steps": {"prepare-source": "done", "extra-a": "pending", "extra-b": "pending"},
        "added_by": {"extra-a": "prepare-source", "extra-b": "prepare-source"}, "status": "running",
        "counters": {"steps_done": 1, "tokens_used": 0, "active_seconds": 0.0}}
    event = TaskEvent.objects.get(task_id=task.pk, kind="step_done")
    assert event.payload["steps_total"] == Task.objects.get(pk=task.pk).steps_total == 5
    assert list(plan.depends_on["extra-b"]) == ["extra-a"] and plan.status["extra-a"] == "pending"


def test_a_runs_snapshot_compaction_leaves_the_same_rows_on_either_database_in_two_statements_on_postgresql(settings):
    """snapshots.compact at a run's end: the last ORCH_SNAPSHOT_KEEP versions become full rows and
    older ones go — on PostgreSQL a read and one statement for the rewrite and the prune."""
    from django.db import connection, transaction
    from django.test.utils import CaptureQueriesContext

    settings.ORCH_SNAPSHOT_KEEP = 3
    task, lease, plan = started_migration(rows=200)
    commit_done(lease, plan, ("prepare-source", "batch-0001", "batch-0002", "batch-0003", "batch-0004"))
    assert list(Snapshot.objects.filter(task_id=task.pk).order_by("version").values_list("version", "full")) == [
        (1, True), (2, False), (3, False), (4, False), (5, False), (6, False)]
    with transaction.atomic():
        locked = leases.lock_fenced(lease)
        with CaptureQueriesContext(connection) as queries:
            checkpoint.compact_snapshots(locked, plan)
    if connection.vendor == "postgresql":
        assert len(queries.captured_queries) == 2, [q["sql"] for q in queries.captured_queries]
    kept = list(Snapshot.objects.filter(task_id=task.pk).order_by("version").values("version", "full", "state"))
    assert kept == EXPECTED_COMPACTED


def _full_state(done: int) -> dict:
    names = ["prepare-source", "batch-0001", "batch-0002", "batch-0003", "batch-0004"]
    return {"params": {"rows": 200, "batch_size": 50, "rate": 1.0},
            "limits": {"max_steps": 100000, "max_tokens": 10000000, "max_seconds": 86400.0, "max_subtasks": 4},
            "status": "running", "steps": {name: "done" if i < done else "pending" for i, name in enumerate(names)},
            "counters": {"steps_done": done, "tokens_used": done, "active_seconds": 0.5 * done}, "stack": []}


EXPECTED_COMPACTED = [{"version": v, "full": True, "state": _full_state(v - 1)} for v in (4, 5, 6)]


def test_a_compacted_state_keeps_quotes_backslashes_and_other_scripts_exactly(settings):
    """The rewritten versions go to PostgreSQL as one JSON document (engine/snapshots.py): a state
    whose strings hold what JSON and SQL escape reads back as it was written, on either database."""
    settings.ORCH_SNAPSHOT_KEEP = 2
    task, lease, plan = started_migration(rows=200)
    commit_done(lease, plan, ("prepare-source", "batch-0001", "batch-0002"))
    tricky = {"note": 'a "quoted" \\ back\\slash, it\'s {"not": "json"} — ünïcödé 日本 \U0001F600 %s %(x)s',
              "nested": [{"q": '"', "b": "\\", "nl": "line\nbreak\ttab"}], "n": 1.5}
    row = Task.objects.get(pk=task.pk)
    snapshots.compact(row, tricky)
    kept = dict(Snapshot.objects.filter(task_id=task.pk).values_list("version", "state"))
    assert sorted(kept) == [3, 4] and kept[4] == tricky
    assert Snapshot.objects.get(task_id=task.pk, version=3).full


def _step_table_updates(cursor) -> tuple[int, int]:
    """orchestrator_step's (updates, HOT updates) so far, this backend's pending counts flushed."""
    cursor.execute("SELECT pg_stat_force_next_flush()")  # flushed when this backend next goes idle
    cursor.execute("SELECT 1")
    cursor.execute("SELECT pg_stat_clear_snapshot()")
    cursor.execute("SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relname = 'orchestrator_step'")
    return cursor.fetchone()


def test_a_steps_commit_updates_its_row_in_place_on_postgresql():
    """A step's commit changes its row's status: with no index on the status and room on the page
    (migration 0037), PostgreSQL updates the row heap-only (HOT) — no new entry in any of the
    table's indexes. Before, none of these updates was HOT."""
    from django.db import connection

    if connection.vendor != "postgresql":
        pytest.skip("heap-only tuples are PostgreSQL's")
    import psycopg

    # The worst case for HOT: another session holds an older snapshot, so no dead version can be
    # pruned and only the room the fillfactor left takes new ones (a full suite run had such a
    # session: 29 of 40 HOT). Without it, all of them are. Before migration 0037: none, either way.
    with psycopg.connect(**connection.get_connection_params()) as other:
        other.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        other.execute("SELECT count(*) FROM orchestrator_task")
        for holding in (True, False):
            if not holding:
                other.rollback()
            task, lease, plan = started_migration(rows=2000)  # 41 steps, their rows written at plan time
            with connection.cursor() as cursor:
                updates0, hot0 = _step_table_updates(cursor)
                commit_done(lease, plan, plan.order[:40])
                updates1, hot1 = _step_table_updates(cursor)
            assert updates1 - updates0 >= 40
            least = 0.5 if holding else 0.9
            assert hot1 - hot0 >= least * (updates1 - updates0), (holding, updates1 - updates0, hot1 - hot0)


@pytest.mark.task_types("tests.support.testtypes")
def test_a_result_holding_nul_characters_is_stored_with_replacement_characters_on_either_database():
    """PostgreSQL stores no NUL (U+0000) in jsonb: a step whose result (or whose effect's result)
    held one failed its checkpoint on PostgreSQL on every retry, then needed a human. Both
    databases now store U+FFFD in its place."""
    from orchestrator.engine.worker import drive_inline

    task = services.task_create(type="test.nul_results", params={})
    assert drive_inline(task.pk) == "completed", Task.objects.get(pk=task.pk).status_reason
    read = {"text": "PK\x03\x04\ufffd\ufffdheader", "keys": {"a\ufffdb": ["\ufffd"]}}
    assert Step.objects.get(task=task, step_id="read").result == {"read": read, "own": "end\ufffd"}
    assert WalEntry.objects.get(task=task).result == read


@pytest.mark.task_types("tests.support.testtypes")
@pytest.mark.parametrize("params, where", [({"nul_in_arguments": True}, "test.read_binary hold the NUL character (U+0000) in path"),
                                           ({"at_commit": True}, "db.upsert hold the NUL character (U+0000) in rows[0][1]")])
def test_an_effect_whose_arguments_hold_a_nul_character_is_refused_before_its_intent(params, where):
    """A task type's own arguments are not changed: the call is refused, saying where, before
    anything is written or performed (its intent could not be stored on PostgreSQL, where the
    step failed on the database's 'unsupported Unicode escape sequence')."""
    from demo.models import DemoDestination
    from orchestrator.engine.worker import drive_inline

    task = services.task_create(type="test.nul_results", params=params)
    drive_inline(task.pk)
    task.refresh_from_db()
    assert task.status == "needs_human" and where in task.status_reason, task.status_reason
    assert not WalEntry.objects.filter(task=task).exists() and not DemoDestination.objects.filter(pk=910_000).exists()
