"""The task list at 100,000 tasks: first page, a deep page (keyset), a status filter, a
text search — through the API and the HTML page.

    .venv/bin/python bench/list.py        # SQLite; DATABASE_URL=postgres://... for PostgreSQL
"""
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "orchestrator.settings")
if "DATABASE_URL" not in os.environ:
    os.environ["DATABASE_URL"] = f"sqlite:///{tempfile.mkdtemp()}/list-bench.sqlite3"
os.environ.setdefault("ORCH_LOG_LEVEL", "WARNING")
TASKS = int(os.environ.get("BENCH_TASKS", "100000"))

import django  # noqa: E402

django.setup()

from django.contrib.auth.models import User  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django.test import Client  # noqa: E402

from orchestrator.models import Task  # noqa: E402

STATUSES = ["completed", "completed", "completed", "failed", "paused", "running", "queued", "stopped"]


def timed(client, url, runs=7) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        response = client.get(url)
        times.append((time.perf_counter() - start) * 1000)
        assert response.status_code == 200, (url, response.status_code)
    return statistics.median(times)


def main():
    call_command("migrate", verbosity=0)
    if Task.objects.count() < TASKS:
        batch = [Task(type=["demo.migrate_rows", "demo.pipeline", "demo.notify"][i % 3], title=f"job {i}",
                      status=STATUSES[i % len(STATUSES)], steps_total=10, steps_done=i % 11, params={}, limits={})
                 for i in range(TASKS - Task.objects.count())]
        Task.objects.bulk_create(batch, batch_size=5000)
    user = User.objects.filter(username="bench").first() or User.objects.create_superuser("bench", "b@x.org", "pw")
    client = Client()
    client.force_login(user)
    deep = Task.objects.order_by("id").values_list("id", flat=True)[TASKS // 100]
    print(f"{Task.objects.count()} tasks; median of 7 requests, in-process (no network)")
    for label, url in [("first page", "/"), ("deep page (keyset)", f"/?before={deep}"),
                       ("status=paused", "/?status=paused"), ("type + status", "/?type=demo.notify&status=failed"),
                       ("text search", "/?q=job%2099999"),
                       ("API first page", "/api/tasks"), ("API deep page", f"/api/tasks?before={deep}"),
                       ("API status filter", "/api/tasks?status=paused")]:
        print(f"{label:>20}: {timed(client, url):7.1f} ms")


if __name__ == "__main__":
    main()
