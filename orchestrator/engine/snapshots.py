"""Snapshot versions at a cost that does not grow with the plan.

Each checkpoint writes a *delta* row: only what its version changed (the step it finished,
steps it added, the counters, the task status). Every ORCH_SNAPSHOT_FULL_EVERY versions,
and when a run ends (pause, stop, completion, end of a time slice), a *full* row holds the
whole state. A version is read as the newest full row at or below it plus the deltas after
it, so reading any kept version costs at most FULL_EVERY small rows.

Retention: the last ORCH_SNAPSHOT_KEEP versions can always be read (and rolled back to).
Rows are pruned only below a full row, never in a way that leaves a kept delta without
its base; at the end of a run the last KEEP versions are rewritten full and everything
older is deleted, so a task at rest keeps exactly KEEP rows.

The state of a version (what `materialize` returns and the API shows):
    {"params", "limits", "status", "steps": {step_id: status}, "counters": {...},
     "generations": {step_id: n} (only steps re-run after an edit), "added_by": {step_id: adder},
     "stack": [frame, ...] (the task stack, engine/preemption.py; a delta carries it when it changed)}
"""
import json

from django.db import connection
from django.utils import timezone

from ..conf import harness
from ..models import Snapshot, Task

REPLACED_KEYS = ("params", "limits", "status", "counters", "generations", "stack")


def apply_delta(state: dict, delta: dict) -> dict:
    """`state` (a full state, changed in place) moved forward by one delta row."""
    state.setdefault("steps", {}).update(delta.get("steps") or {})
    if delta.get("added_by"):
        state.setdefault("added_by", {}).update(delta["added_by"])
    for key in REPLACED_KEYS:
        if key in delta:
            state[key] = delta[key]
    return state


def materialize(task_id: int, version: int) -> dict | None:
    """The full state of `version`, or None when it is not kept."""
    states = materialize_range(task_id, version, version)
    return states.get(version)


def materialize_range(task_id: int, first: int, last: int) -> dict[int, dict]:
    """Full states of the kept versions between `first` and `last` (inclusive), by version:
    one pass forward from the newest full row at or below `first`."""
    base = (Snapshot.objects.filter(task_id=task_id, full=True, version__lte=first)
            .order_by("-version").values_list("version", flat=True).first())
    if base is None:  # `first` is older than what is kept: start at the oldest kept full row
        base = (Snapshot.objects.filter(task_id=task_id, full=True, version__lte=last)
                .order_by("version").values_list("version", flat=True).first())
        if base is None:
            return {}
    rows = (Snapshot.objects.filter(task_id=task_id, version__gte=base, version__lte=last)
            .order_by("version").values_list("version", "full", "state"))
    return {version: state for version, state in forward(rows) if version >= first}


def forward(rows):
    """(version, full state) for each of `rows` ((version, full, state), by version), a delta
    applied to the state before it; a delta with no full row before it is skipped (nothing to
    build it on). Rows are freshly decoded: a full one is used as it is; the running state is
    copied (its step map) before a delta changes it, so earlier versions keep theirs."""
    state = None
    for version, full, row_state in rows:
        if full:
            state = row_state
        elif state is None:
            continue
        else:
            state = apply_delta(_copy(state), row_state)
        yield version, state


def _copy(state: dict) -> dict:
    copied = dict(state)
    copied["steps"] = dict(state.get("steps") or {})
    if "added_by" in state:
        copied["added_by"] = dict(state["added_by"])
    return copied


def kept_versions(task_id: int) -> list[int]:
    """Every version that can be read (and rolled back to), oldest first."""
    oldest_full = (Snapshot.objects.filter(task_id=task_id, full=True).order_by("version")
                   .values_list("version", flat=True).first())
    if oldest_full is None:
        return []
    return list(Snapshot.objects.filter(task_id=task_id, version__gte=oldest_full).order_by("version")
                .values_list("version", flat=True))


def write_full(task: Task, state: dict, step_id: str = "") -> None:
    """A full row for the task's current checkpoint version (replacing a delta written for it)."""
    Snapshot.objects.update_or_create(task_id=task.pk, version=task.checkpoint_version,
                                      defaults={"step_id": step_id, "state": state, "full": True})
    prune(task.pk, task.checkpoint_version)


def write_first(task: Task, state: dict) -> None:
    """A full row for a version no row can exist for yet (a plan's first version): one
    INSERT, where `write_full` reads first (and prunes)."""
    Snapshot.objects.create(task_id=task.pk, version=task.checkpoint_version, step_id="", state=state, full=True)


def write_delta(task_id: int, version: int, delta: dict, step_id: str = "") -> None:
    """A delta row for `version` (one INSERT, no model instance: it is on the per-step path)."""
    with connection.cursor() as cursor:
        cursor.execute(f'INSERT INTO {Snapshot._meta.db_table} (task_id, version, step_id, "full", state, created_at) '
                       f'VALUES (%s, %s, %s, %s, %s, %s)',
                       [task_id, version, step_id, False, json.dumps(delta),
                        connection.ops.adapt_datetimefield_value(timezone.now())])


def full_due(version: int) -> bool:
    every = max(1, harness.snapshot_full_every)
    return version % every == 0


def prune(task_id: int, version: int) -> None:
    """Delete what is no longer needed to read the last KEEP versions up to `version`:
    everything below the newest full row at or below the oldest kept version."""
    keep = harness.snapshot_keep
    if not keep:
        return
    oldest_kept = version - keep + 1
    base = (Snapshot.objects.filter(task_id=task_id, full=True, version__lte=oldest_kept)
            .order_by("-version").values_list("version", flat=True).first())
    if base is not None:
        Snapshot.objects.filter(task_id=task_id, version__lt=base).delete()


def compact(task: Task, current_state: dict) -> None:
    """At the end of a run: the last KEEP versions become full rows and older rows go, so
    a task at rest holds KEEP small-to-read rows. `current_state` is the state of the
    task's current version (the runner has it in memory)."""
    version, keep = task.checkpoint_version, max(1, harness.snapshot_keep or 1)
    first = max(1, version - keep + 1)
    table = Snapshot._meta.db_table
    # At the end of every run: two statements on PostgreSQL (a read; the rewrite and the prune as
    # one), three on SQLite, where the ORM's were five and the biggest single cost of a short
    # task's run.
    with connection.cursor() as cursor:
        # One read: the kept versions and the full row at or below the oldest one that their
        # deltas build on.
        cursor.execute(f'SELECT id, version, "full", state FROM {table} WHERE task_id = %s AND version <= %s '
                       f'AND version >= COALESCE((SELECT MAX(version) FROM {table} WHERE task_id = %s AND "full" '
                       f'AND version <= %s), %s) ORDER BY version', [task.pk, version, task.pk, first, first])
        rows = cursor.fetchall()
        existing = {row_version: (pk, bool(full)) for pk, row_version, full, _ in rows if row_version >= first}
        decoded = ((row_version, full, json.loads(state) if isinstance(state, (str, bytes)) else state)
                   for _, row_version, full, state in rows)
        states = {v: state for v, state in forward(decoded) if v >= first}
        states[version] = current_state
        # The deltas made full, and the versions older than the kept ones pruned.
        made_full = [(json.dumps(state), True, existing[v][0]) for v, state in states.items()
                     if v in existing and not existing[v][1]]
        prune = f"DELETE FROM {table} WHERE task_id = %s AND version < %s"
        if connection.vendor == "postgresql" and (made_full or harness.snapshot_keep):
            # One round trip: the rows made full and the prune. The rows go as one JSON document, not
            # as a text array: Django's cursors bind on the client, where psycopg escapes every quote
            # of every state in an array with a regular expression (a 500-step task's ten kept states:
            # ~60 ms per run, most of the run's end).
            rewrite = (f'UPDATE {table} AS kept SET state = made.state, "full" = true '
                       f"FROM jsonb_to_recordset(%s::jsonb) AS made(id bigint, state jsonb) WHERE kept.id = made.id")
            parts, values = [], []
            if made_full:
                parts.append(f"rewritten AS ({rewrite})")
                values.append("[" + ",".join(f'{{"id":{pk},"state":{state}}}' for state, _, pk in made_full) + "]")
            if harness.snapshot_keep:
                parts.append(f"pruned AS ({prune})")
                values += [task.pk, first]
            cursor.execute(f"WITH {', '.join(parts)} SELECT 1", values)
        else:
            if made_full:  # psycopg sends them as one pipeline
                cursor.executemany(f'UPDATE {table} SET state = %s, "full" = %s WHERE id = %s', made_full)
            if harness.snapshot_keep:
                cursor.execute(prune, [task.pk, first])
    # The versions without a row (rare: written before deltas existed, or pruned meanwhile).
    Snapshot.objects.bulk_create([Snapshot(task_id=task.pk, version=v, state=state, full=True)
                                  for v, state in states.items() if v not in existing])


def history(task_id: int, limit: int) -> list[tuple[Snapshot, dict]]:
    """The newest `limit` kept versions, newest first, each with its full state."""
    versions = kept_versions(task_id)[-limit:]
    if not versions:
        return []
    states = materialize_range(task_id, versions[0], versions[-1])
    rows = {s.version: s for s in Snapshot.objects.filter(task_id=task_id, version__in=versions)}
    return [(rows[v], states[v]) for v in reversed(versions) if v in states and v in rows]
