"""kill -9 -> the task runs again on a worker, at a 1 s heartbeat.

    .venv/bin/python bench/recovery.py        # SQLite; DATABASE_URL=postgres://... for PostgreSQL

Two crashes, with two worker clusters and a sweeper (`recover --loop`) running:
- the executor (worker.pid in the API) is SIGKILLed: its watchdog hands the task over at once;
- the whole worker host (cluster, watchdog, executor) is SIGKILLed: the sweeper notices the
  stale heartbeat (ORCH_STALE_AFTER_SECONDS = 3 heartbeats) and the other cluster continues.
"Running again" = a new lease epoch with a live executor. Target: <= 5 s p95.
"""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.pop("REDIS_URL", None)
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "8"))
from bench._django import database_label, setup  # noqa: E402
from bench.measure import host_of, pct, wait_until  # noqa: E402

setup("recovery-bench", ORCH_HEARTBEAT_SECONDS="1", ORCH_STALE_AFTER_SECONDS="3", ORCH_MAX_RECOVERY_ATTEMPTS="1000")

from orchestrator.engine import processes, services  # noqa: E402
from orchestrator.models import Task  # noqa: E402


def spawn(*args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(ROOT / "manage.py"), *args], cwd=ROOT,
                            env={**os.environ, "ORCH_WORKERS": "1"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


def running(task_id: int, after_epoch: int):
    t = Task.objects.get(pk=task_id)
    return t if (t.status == "running" and t.lease_epoch > after_epoch and t.lease_owner and t.worker_pid
                 and processes.alive(t.worker_pid) and t.worker_pid != getattr(running, "old", None)) else None


def cluster_of(executor: int, clusters: list[subprocess.Popen]) -> subprocess.Popen:
    cluster = host_of(executor, clusters)
    if cluster is None:
        raise LookupError(executor)
    return cluster


def main():
    clusters = [spawn("qcluster"), spawn("qcluster")]
    sweeper = spawn("recover", "--loop", "--interval", "0.5")
    task = services.task_create(type="demo.pipeline", params={"stages": 100, "seconds_per_stage": 60})
    executor_kills, host_kills = [], []
    try:
        current = wait_until(lambda: running(task.pk, 0), 60, 0.005)
        for _ in range(ROUNDS):
            running.old = current.worker_pid
            killed_at = time.monotonic()
            os.kill(current.worker_pid, signal.SIGKILL)
            current = wait_until(lambda: running(task.pk, current.lease_epoch), 60, 0.005)
            executor_kills.append(time.monotonic() - killed_at)
        for _ in range(ROUNDS):
            running.old = current.worker_pid
            victim = cluster_of(current.worker_pid, clusters)
            killed_at = time.monotonic()
            os.killpg(victim.pid, signal.SIGKILL)
            victim.wait()
            current = wait_until(lambda: running(task.pk, current.lease_epoch), 60, 0.005)
            host_kills.append(time.monotonic() - killed_at)
            clusters = [c for c in clusters if c is not victim] + [spawn("qcluster")]  # the host comes back
            time.sleep(2)  # let the new cluster start before the next crash
        print(f"database: {database_label()}; heartbeat 1 s, stale after 3 s; {ROUNDS} crashes each")
        print(f"kill -9 executor (worker.pid) -> running again: p50 {pct(executor_kills, 50):5.2f} s  "
              f"p95 {pct(executor_kills, 95):5.2f} s")
        print(f"kill -9 whole worker host     -> running again: p50 {pct(host_kills, 50):5.2f} s  "
              f"p95 {pct(host_kills, 95):5.2f} s   (target p95 <= 5 s)")
    finally:
        services.task_terminate(task_id=task.pk, reason="bench over")
        for proc in [*clusters, sweeper]:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


if __name__ == "__main__":
    main()
