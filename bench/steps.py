"""Per-step cost of the durable protocol: time, commits and stored bytes.

    .venv/bin/python bench/steps.py                      # SQLite (a throwaway file)
    DATABASE_URL=postgres://postgres@127.0.0.1:5432/orchestrator_bench .venv/bin/python bench/steps.py

Prints figures, asserts nothing. Peers measured on this 2-core machine on PostgreSQL 15: DBOS ~3.7 ms
per durable step (2 commits); LangGraph's Postgres checkpointer ~2.1-2.6 ms and ~3.7 KB per node.
"""
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._django import setup  # noqa: E402

setup("steps-bench")
from django.conf import settings  # noqa: E402
from django.db import connection  # noqa: E402
from django.db.backends.base.base import BaseDatabaseWrapper  # noqa: E402

from orchestrator.engine import services  # noqa: E402
from orchestrator.engine.worker import drive_inline  # noqa: E402
from orchestrator.models import Snapshot, Step, TaskEvent, WalEntry  # noqa: E402

commits = 0
_lock = threading.Lock()
_original_commit = BaseDatabaseWrapper.commit


statements = 0


def count_statement(execute, sql, params, many, context):
    global statements
    with _lock:
        statements += 1
    return execute(sql, params, many, context)


def counting_commit(self):
    global commits
    with _lock:
        commits += 1
    return _original_commit(self)


def stored_bytes(task) -> int:
    """JSON payload bytes the task keeps (results, snapshots, events, WAL), after pruning."""
    total = 0
    for model, fields in ((Step, ("result", "reads", "depends_on", "declared_reads")), (Snapshot, ("state",)),
                          (TaskEvent, ("payload",)), (WalEntry, ("args", "result"))):
        for row in model.objects.filter(task=task).values(*fields):
            total += sum(len(str(v)) for v in row.values()) + 64  # + a rough per-row overhead
    return total


def run(steps: int, effect: bool) -> dict:
    return measure("bench.chain", {"steps": steps, "effect": effect}, steps)


def measure(type_name: str, params: dict, steps: int) -> dict:
    global commits, statements
    task = services.task_create(type=type_name, params=params, limits={"max_subtasks": 1})
    commits = statements = 0
    start = time.perf_counter()
    BaseDatabaseWrapper.commit = counting_commit
    try:
        outcome = drive_inline(task.pk)
    finally:
        BaseDatabaseWrapper.commit = _original_commit
    elapsed = time.perf_counter() - start
    assert outcome == "completed", outcome
    return {"ms_per_step": 1000 * elapsed / steps, "commits_per_step": commits / steps,
            "statements_per_step": statements / steps,
            "bytes_per_step": stored_bytes(task) / steps}


def main():
    from django.db.backends.signals import connection_created

    def wrap(connection, **kwargs):
        if count_statement not in connection.execute_wrappers:
            connection.execute_wrappers.append(count_statement)

    # Every connection, in every thread (runner, step threads, supervisor), counts.
    connection_created.connect(lambda sender, connection, **kw: wrap(connection))
    wrap(connection)
    vendor = connection.vendor
    steps = int(os.environ.get("BENCH_STEPS", "500"))
    print(f"database: {vendor}; {steps} steps per run; snapshot retention {settings.ORCH_SNAPSHOT_KEEP}")
    run(20, False)  # warm-up
    for effect in (False, True):
        figures = run(steps, effect)
        label = "side-effect step" if effect else "pure step       "
        print(f"{label}: {figures['ms_per_step']:.2f} ms/step, {figures['commits_per_step']:.2f} commits/step, "
              f"{figures['statements_per_step']:.1f} statements/step (incl. heartbeats, control polls), {figures['bytes_per_step']:.0f} B stored/step")
    rows, batch = 20000, 250
    figures = measure("demo.migrate_rows", {"rows": rows, "batch_size": batch, "rate": 1.0}, rows // batch + 1)
    print(f"demo.migrate_rows {rows} rows / batch {batch}: {figures['ms_per_step']:.2f} ms/step, "
          f"{figures['bytes_per_step']:.0f} B stored/step (target <= 1500 B)")
    print("peers: DBOS ~3.7 ms/step; LangGraph+Postgres ~2.1-2.6 ms and ~3700 B per node")


if __name__ == "__main__":
    main()
