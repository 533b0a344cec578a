"""The task list at 100,000 tasks: first page, a deep page (keyset), a status filter, a
text search — through the API and the HTML page.

    .venv/bin/python bench/list.py        # SQLite; DATABASE_URL=postgres://... for PostgreSQL
"""
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
TASKS = int(os.environ.get("BENCH_TASKS", "100000"))
from bench._django import setup  # noqa: E402

setup("list-bench")
from django.contrib.auth.models import User  # noqa: E402
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
