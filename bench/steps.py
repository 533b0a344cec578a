"""Per-step cost of the durable protocol: time, commits and stored bytes.

    .venv/bin/python bench/steps.py                      # SQLite (a throwaway file)
    DATABASE_URL=postgres://postgres@127.0.0.1:5432/orchestrator_bench .venv/bin/python bench/steps.py

Prints figures, asserts nothing. Commits are Django's (BaseDatabaseWrapper.commit), bytes an
estimate of the JSON payloads kept; for exact PostgreSQL figures (xact_commit, on-disk table
sizes) side by side with DBOS and LangGraph on the same server, run `make bench` (bench/compare.py).
"""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._django import setup  # noqa: E402

setup("steps-bench")
from django.conf import settings  # noqa: E402
from django.db import connection  # noqa: E402

from bench.measure import DjangoCounters, json_payload_bytes, run_task  # noqa: E402

counters = DjangoCounters()


def run(steps: int, effect: bool) -> dict:
    return measure("bench.chain", {"steps": steps, "effect": effect}, steps)


def measure(type_name: str, params: dict, steps: int) -> dict:
    commits0, statements0 = counters.read()
    task, elapsed = run_task(type_name, params)
    commits1, statements1 = counters.read()
    return {"ms_per_step": 1000 * elapsed / steps, "commits_per_step": (commits1 - commits0) / steps,
            "statements_per_step": (statements1 - statements0) / steps,
            "bytes_per_step": json_payload_bytes(task) / steps}


def main():
    counters.install()
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
    print("peers (DBOS, LangGraph + PostgresSaver) on the same PostgreSQL: `make bench`")


if __name__ == "__main__":
    main()
