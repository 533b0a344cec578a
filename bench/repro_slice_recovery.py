"""Reproduces an engine bug the soak found (figures only, nothing asserted):

    .venv/bin/python bench/repro_slice_recovery.py      # ~1-2 minutes, its own SQLite file

No fault at all: one worker, three demo.pipeline tasks, slices of 1 s (ORCH_SLICE_SECONDS),
stale after 1.5 s. A sliced task keeps status `running` with no lease holder while its
message waits in the queue behind the other tasks; once that wait is longer than
ORCH_STALE_AFTER_SECONDS the sweeper "recovers" it (a recovery event with no dead worker)
and counts an attempt, so after ORCH_MAX_RECOVERY_ATTEMPTS (3) a healthy task becomes
needs_human ("recovery attempts exhausted"). The same happens with the defaults (60 s
slices, stale after 6 s) whenever every worker is busy for more than 6 s when a task slices.
"""
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    var = tempfile.mkdtemp(prefix="orch-repro-")
    env = {**os.environ, "DATABASE_URL": f"sqlite:///{var}/db.sqlite3", "ORCH_VAR_DIR": var, "ORCH_WORKERS": "1",
           "ORCH_HEARTBEAT_SECONDS": "0.5", "ORCH_STALE_AFTER_SECONDS": "1.5", "ORCH_SLICE_SECONDS": "1",
           "ORCH_MAX_RECOVERY_ATTEMPTS": "3", "ORCH_LOG_LEVEL": "WARNING",
           "DJANGO_SETTINGS_MODULE": "orchestrator.settings"}
    env.pop("REDIS_URL", None)
    os.environ.update(env)
    sys.path.insert(0, str(ROOT))
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0)
    from orchestrator.engine import services
    from orchestrator.models import Task, TaskEvent

    procs = [subprocess.Popen([sys.executable, str(ROOT / "manage.py"), *args], cwd=ROOT, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
             for args in (["qcluster"], ["recover", "--loop", "--interval", "0.5"])]
    try:
        ids = [services.task_create(type="demo.pipeline", params={"stages": 24, "seconds_per_stage": 0.4}).pk
               for _ in range(3)]
        deadline = time.time() + 150
        while time.time() < deadline and Task.objects.filter(pk__in=ids, status__in=["queued", "running"]).exists():
            time.sleep(1)
        for task in Task.objects.filter(pk__in=ids).order_by("pk"):
            dead = [e.payload.get("dead_worker") or "(no lease holder)"
                    for e in TaskEvent.objects.filter(task=task, kind="recovery")]
            print(f"task {task.pk}: {task.status} ({task.status_reason[:70]}); recoveries: {len(dead)}, "
                  f"dead workers: {sorted(set(dead))}")
    finally:
        for proc in procs:
            os.killpg(proc.pid, 9)


if __name__ == "__main__":
    main()
