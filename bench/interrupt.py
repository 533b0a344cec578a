"""Interruption latency with a real worker cluster.

    .venv/bin/python bench/interrupt.py          # SQLite; DATABASE_URL=postgres://... for PostgreSQL

- Stop -> runner acknowledges: from the operator's request (control_requested_at) to the
  runner's acknowledgement (control_acknowledged_at), both stamped in the database.
- Force-terminate -> all descendants gone: from the request until the executor and every
  process below it (the stage's subprocess) have exited.
Targets: <= 100 ms p50 / <= 250 ms p95; <= 1 s p95. Prints figures, asserts nothing.
"""
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.pop("REDIS_URL", None)
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "15"))
from bench._django import database_label, setup  # noqa: E402
from bench.measure import wait_until  # noqa: E402

setup("interrupt-bench")

from orchestrator.engine import processes, services  # noqa: E402
from orchestrator.models import Task, WalEntry  # noqa: E402


def running_stage() -> Task:
    task = services.task_create(type="demo.pipeline", params={"stages": 1, "seconds_per_stage": 120})
    wait_until(lambda: WalEntry.objects.filter(task=task).exists(), 30, 0.01)
    task = Task.objects.get(pk=task.pk)
    wait_until(lambda: processes.descendants(task.worker_pid), 30, 0.01)  # the stage subprocess runs
    return task


def pct(values, q):
    return statistics.quantiles(values, n=100)[q - 1]


def main():
    cluster = subprocess.Popen([sys.executable, str(ROOT / "manage.py"), "qcluster"], cwd=ROOT,
                               env={**os.environ, "ORCH_WORKERS": "2"}, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        acks = []
        for _ in range(ROUNDS):
            task = running_stage()
            services.task_stop(task_id=task.pk)
            wait_until(lambda: Task.objects.filter(pk=task.pk, control_acknowledged_at__isnull=False).exists(),
                       30, 0.002)
            task = Task.objects.get(pk=task.pk)
            acks.append((task.control_acknowledged_at - task.control_requested_at).total_seconds() * 1000)
            wait_until(lambda: Task.objects.get(pk=task.pk).status == "stopped", 30, 0.002)
        kills = []
        for _ in range(ROUNDS):
            task = running_stage()
            tree = [task.worker_pid, *processes.descendants(task.worker_pid)]
            started = time.monotonic()
            services.task_terminate(task_id=task.pk, reason="bench")
            wait_until(lambda: not any(processes.alive(pid) for pid in tree), 30, 0.001)
            kills.append((time.monotonic() - started) * 1000)
            wait_until(lambda: Task.objects.get(pk=task.pk).status == "terminated", 30, 0.002)
        print(f"database: {database_label()}; {ROUNDS} rounds each, demo.pipeline stage running in a subprocess")
        print(f"Stop -> runner acknowledges:            p50 {pct(acks, 50):6.1f} ms  p95 {pct(acks, 95):6.1f} ms"
              "   (target <= 100 / <= 250 ms)")
        print(f"Force-terminate -> all descendants gone: p50 {pct(kills, 50):6.1f} ms  p95 {pct(kills, 95):6.1f} ms"
              "   (target p95 <= 1000 ms)")
    finally:
        os.killpg(cluster.pid, signal.SIGKILL)
        cluster.wait()


if __name__ == "__main__":
    main()
