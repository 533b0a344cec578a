"""The step commit as SQL: on PostgreSQL one statement (one round trip: the task row fenced on
lease and version, the step row, a snapshot delta, the step_done event, the WAL rows the step
completed, the notification), and the same commit as a few statements on SQLite, in the
caller's transaction. engine/checkpoint.py chooses between them and writes the rest."""
import json
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.db import connection

from ..conf import harness
from ..models import IdempotencyRecord, Snapshot, Step, Task, TaskEvent, WalEntry
from . import at_commit, events, rows_at_commit, step_rows, wal
from .events import NOTIFY_CHANNEL
from .lease import Lease
from .plan_state import PlanState
from .prepared import prepared_cursor


@dataclass
class StepCommit:
    """What one finished step commits."""

    step_id: str
    result: Any
    reads: list[str]
    effects: list[wal.CompletedEffect]
    started_at: datetime
    tokens_used: int = 0
    active_seconds: float = 0.0
    added: list = field(default_factory=list)  # StepSpecs the step added to the plan
    consumed: dict = field(default_factory=dict)  # inbox event id -> outcome (taken by ctx.wait_for)
    ends_wait: bool = False  # the step had waited: its entry leaves Task.waiting_for
    at_commit: list = field(default_factory=list)  # effects written by this commit (engine/at_commit.py)
    rows: list = field(default_factory=list)  # the step's own rows written by it (engine/rows_at_commit.py)


TABLES = {name: model._meta.db_table for name, model in (
    ("task", Task), ("step", Step), ("snapshot", Snapshot), ("event", TaskEvent), ("wal", WalEntry),
    ("idempotency", IdempotencyRecord))}

# The task row's update leaves heartbeat_at to the supervisor's heartbeat (engine/supervisor.py):
# heartbeat_at is indexed (the sweeper's stale scan), so writing it here made every step commit a
# new version of the row in each of the task's indexes; without it PostgreSQL updates the row in
# place (HOT; tests/engine/test_step_commit_writes.py).
_POSTGRESQL_COMMIT = """
WITH t AS (
    UPDATE {task} SET checkpoint_version = checkpoint_version + 1, {reserve_seq},
        steps_done = %(steps_done)s, steps_total = steps_total + %(added)s, tokens_used = tokens_used + %(tokens)s,
        active_seconds = active_seconds + %(active)s, updated_at = %(now)s
    WHERE id = %(task_id)s AND lease_epoch = %(epoch)s AND lease_owner = %(owner)s
        AND checkpoint_version = %(expected_version)s
    RETURNING checkpoint_version, event_seq, status, steps_total, tokens_used, active_seconds
), s AS (
    UPDATE {step} SET status = 'done', result = %(result)s::jsonb, reads = %(reads)s::jsonb,
        attempts = %(attempts)s, error = '', started_at = %(started_at)s, finished_at = %(now)s
    WHERE task_id = %(task_id)s AND step_id = %(step_id)s AND EXISTS (SELECT 1 FROM t)
), snap AS (
    INSERT INTO {snapshot} (task_id, version, step_id, "full", state, created_at)
    SELECT %(task_id)s, t.checkpoint_version, %(step_id)s, false,
        jsonb_build_object('steps', jsonb_build_object(%(step_id)s::text, 'done') || %(pending)s::jsonb,
            'status', t.status,
            'counters', jsonb_build_object('steps_done', %(steps_done)s::int, 'tokens_used', t.tokens_used,
                                           'active_seconds', round(t.active_seconds::numeric, 3)))
            || %(added_by)s::jsonb,
        %(now)s
    FROM t WHERE %(delta)s
), ev AS (
    INSERT INTO {event} (task_id, seq, kind, payload, created_at)
    SELECT %(task_id)s, t.event_seq, 'step_done',
        jsonb_build_object('step', %(step_id)s::text, 'version', t.checkpoint_version,
                           'steps_done', %(steps_done)s::int, 'steps_total', t.steps_total,
                           'seconds', %(seconds)s::float8),
        %(now)s
    FROM t
){effects_done}
SELECT checkpoint_version, event_seq, status, steps_total, tokens_used, active_seconds,
    pg_notify(%(channel)s, %(task_id)s::text || ':' || event_seq || ':' || status || ':' || %(steps_done)s::text
              || ':' || steps_total),
    set_config('synchronous_commit', %(sync)s, true)
FROM t
""".format(**TABLES, reserve_seq=events.reserve_sql(), effects_done=wal.done_sql())
# On one line: psycopg converts a statement's %(name)s placeholders once and caches the result
# only for statements of at most 4,096 bytes (and 50 parameters); indented, this one with an
# agent's dialog row (rows_at_commit) was 4,336 bytes and was converted again on every step
# (~0.6 ms of Python). Its string literals hold no whitespace, so nothing else changes.
_POSTGRESQL_COMMIT = " ".join(_POSTGRESQL_COMMIT.split())

ROW_FIELDS = ("checkpoint_version", "event_seq", "status", "steps_total", "tokens_used", "active_seconds")


def _commit_parameters(lease: Lease, plan: PlanState, commit: StepCommit, encoded_result, now) -> dict:
    return {
        "task_id": lease.task_id, "epoch": lease.epoch, "owner": lease.owner, "now": now,
        "expected_version": plan.version,
        "steps_done": plan.done_count() + 1, "added": len(commit.added), "tokens": commit.tokens_used,
        "active": commit.active_seconds, "result": encoded_result,
        "reads": json.dumps(commit.reads) if commit.reads else "[]",
        "attempts": plan.attempts.get(commit.step_id, 0) + 1, "started_at": commit.started_at,
        "step_id": commit.step_id, "seconds": round((now - commit.started_at).total_seconds(), 3),
        "effects": wal.done_parameter(commit.effects),
        # The snapshot delta's steps the commit adds (pending) and who added them.
        "pending": json.dumps({spec.id: "pending" for spec in commit.added}) if commit.added else "{}",
        "added_by": json.dumps({"added_by": {spec.id: commit.step_id for spec in commit.added}})
        if commit.added else "{}",
    }


_VERSION_FENCE = "AND checkpoint_version = %(expected_version)s"
_HEAD, _TAIL = _POSTGRESQL_COMMIT.split(" SELECT checkpoint_version, event_seq", 1)
# With effects at commit: the fence also refuses a key an earlier execution recorded
# (at_commit.RecordedEarlier).
_HEAD_AT_COMMIT = _HEAD.replace(_VERSION_FENCE, _VERSION_FENCE + f" AND NOT EXISTS (SELECT 1 FROM {TABLES['wal']} "
                                f"WHERE idempotency_key = ANY(%(at_commit_keys)s::text[]))", 1)


def postgresql(lease, plan, commit, encoded_result, now, *, delta: bool, at_commit_sql: bool = True) -> dict | None:
    """The commit statement; with `at_commit_sql`, the effects of commit.at_commit and the rows of
    commit.rows written by it too (otherwise the caller writes them in this transaction); None
    when the fence fails."""
    parameters = _commit_parameters(lease, plan, commit, encoded_result, now)
    parameters.update(delta=delta, channel=NOTIFY_CHANNEL,
                      # An effect recorded only by this commit needs it on disk; a step whose
                      # effects committed in their own transactions is recomputed like a pure one.
                      sync="on" if commit.at_commit or any(not e.committed for e in commit.effects)
                      or harness.pure_step_sync_commit else "off")
    statement = _POSTGRESQL_COMMIT
    parameters["worker"] = f"{lease.host}:{lease.pid}"  # of WAL entries the statement writes
    head, more = _HEAD, ""
    if commit.at_commit and at_commit_sql:
        more, values = at_commit.sql(commit.at_commit)
        values["effects"] = wal.done_parameter(commit.effects, at_commit.records(commit.at_commit))
        head = _HEAD_AT_COMMIT
        values["at_commit_keys"] = [e.key for e in commit.at_commit]
        parameters.update(values)
    if commit.rows and at_commit_sql:
        rows, values = rows_at_commit.sql(commit.rows)
        more += rows
        parameters.update(values)
    if commit.added and at_commit_sql:  # the Step rows of the steps it adds (positions after the plan's last)
        added, defaults = step_rows.added_sql()
        more += added
        generation = plan.generations.get(commit.step_id, 0)  # as checkpoint.additions: the adder's
        parameters.update(defaults, step_rows=step_rows.step_rows_json(
            [(spec, commit.step_id, generation) for spec in commit.added], plan.next_position()))
    if more:
        statement = head + more + " SELECT checkpoint_version, event_seq" + _TAIL
    with prepared_cursor() as cursor:
        cursor.execute(statement, parameters)
        row = cursor.fetchone()
    return dict(zip(ROW_FIELDS, row)) if row else None


def sqlite(lease, plan, commit, encoded_result, now) -> dict | None:
    """The same commit as the PostgreSQL statement, as a few statements in the caller's
    transaction; None when the fence (lease and version) does not hold."""
    p = _commit_parameters(lease, plan, commit, encoded_result, now)
    now, started_at = (connection.ops.adapt_datetimefield_value(value) for value in (now, commit.started_at))
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {TABLES['task']} SET checkpoint_version = checkpoint_version + 1, {events.reserve_sql()}, "
            f"steps_done = %s, steps_total = steps_total + %s, tokens_used = tokens_used + %s, "
            f"active_seconds = active_seconds + %s, updated_at = %s "
            f"WHERE id = %s AND lease_epoch = %s AND lease_owner = %s AND checkpoint_version = %s "
            f"RETURNING {', '.join(ROW_FIELDS)}",
            [p["steps_done"], p["added"], p["tokens"], p["active"], now, p["task_id"], p["epoch"], p["owner"],
             p["expected_version"]])
        found = cursor.fetchone()
        if found is None:
            return None
        row = dict(zip(ROW_FIELDS, found))
        cursor.execute(
            f"UPDATE {TABLES['step']} SET status = 'done', result = %s, reads = %s, attempts = %s, error = '', "
            f"started_at = %s, finished_at = %s WHERE task_id = %s AND step_id = %s",
            [encoded_result if encoded_result is not None else "null", p["reads"], p["attempts"],
             started_at, now, p["task_id"], commit.step_id])
        cursor.execute(
            f"INSERT INTO {TABLES['event']} (task_id, seq, kind, payload, created_at) VALUES (%s, %s, %s, %s, %s)",
            [p["task_id"], row["event_seq"], "step_done",
             json.dumps({"step": commit.step_id, "version": row["checkpoint_version"], "steps_done": p["steps_done"],
                         "steps_total": row["steps_total"], "seconds": p["seconds"]}), now])
    wal.mark_done(commit.effects)
    return row
