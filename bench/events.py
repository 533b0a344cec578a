"""Events into tasks, with a real web server (daphne), one `manage.py qcluster` and the sweeper:

    make bench-events        # or: .venv/bin/python bench/events.py

DATABASE_URL (default postgres://postgres@127.0.0.1:5432/bench_events; created if missing).
- Accepted events/s: `POST /api/tasks/{id}/events` over HTTP from BENCH_CLIENTS (8) concurrent
  clients, P1 `user.message` events each with its own `source_event_id` (so the dedupe look-up
  is paid), into one task and spread over 100 tasks. The target tasks are paused, so the
  figure is the inbox's door alone (nothing consumes meanwhile); every answer must be 202.
- Event -> consumed, per priority: `consumed_at - created_at` (both stamped by the database
  writer) of events sent one at a time (engine `inbox.send`, this process) into a running
  bench.listener task whose steps take 20 ms. P3/P4 types are mergeable: by design they are
  visible only ORCH_INBOX_MERGE_SECONDS after they arrive (each has its own merge key here, so
  none merges), and their figure includes that wait.
- P0 pause -> the runner's acknowledgement: `Task.control_acknowledged_at - control_requested_at`
  for a pause of that running task (resumed between rounds).
- P0 preempt -> the running step interrupted: the frame's `interrupted_after_ms` (the event's
  created_at to the runner cancelling the steps in flight), demo.contracts pacing 2 s each.
Prints figures, asserts nothing.
"""
import json
import os
import secrets
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DEFAULT_DATABASE_URL = "postgres://postgres@127.0.0.1:5432/bench_events"


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "").strip()
    return int(value) if value else default


def post_event(base: str, token: str, task_id: int, body: dict) -> int:
    request = urllib.request.Request(f"{base}/api/tasks/{task_id}/events", data=json.dumps(body).encode(),
                                     method="POST", headers={"Authorization": f"Bearer {token}",
                                                             "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            response.read()
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def throughput(base: str, token: str, task_ids: list[int], count: int, clients: int, label: str) -> tuple[float, dict]:
    """Events accepted per second sending `count` events round-robin over `task_ids`; and the
    answers by status."""
    run = secrets.token_hex(4)
    answers: dict[int, int] = {}
    lock = threading.Lock()

    def send(i: int) -> None:
        status = post_event(base, token, task_ids[i % len(task_ids)], {
            "type": "user.message", "payload": {"text": f"message {i}"}, "source_event_id": f"{label}-{run}-{i}"})
        with lock:
            answers[status] = answers.get(status, 0) + 1

    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(send, range(count)))
    elapsed = time.perf_counter() - started
    return answers.get(202, 0) / elapsed, answers


def main() -> int:
    os.environ.setdefault("DATABASE_URL", DEFAULT_DATABASE_URL)
    if not os.environ["DATABASE_URL"].startswith(("postgres://", "postgresql://")):
        print(f"bench/events.py measures PostgreSQL; DATABASE_URL is {os.environ['DATABASE_URL']!r}")
        return 2
    os.environ.pop("REDIS_URL", None)  # the ORM broker, as `make run` without Redis
    from bench.measure import PgServer

    pg = PgServer(os.environ["DATABASE_URL"])
    created = pg.ensure_database(pg.database)
    from bench._django import setup

    setup("events-bench")
    from django.conf import settings
    from django.contrib.auth import get_user_model
    from django.db.models import F

    from bench.compare import Stack, free_port, pct, wait_until
    from orchestrator.auth import token_issue
    from orchestrator.engine import inbox, services
    from orchestrator.engine.states import TERMINAL
    from orchestrator.models import InboundEvent, Task

    events_one = env_int("BENCH_EVENTS_ONE_TASK", 2000)
    events_many = env_int("BENCH_EVENTS_MANY_TASKS", 2000)
    clients = env_int("BENCH_CLIENTS", 8)
    per_priority = env_int("BENCH_LATENCY_EVENTS", 30)
    rounds = env_int("BENCH_ROUNDS", 15)

    for task_id in Task.objects.exclude(status__in=TERMINAL).values_list("pk", flat=True):
        services.task_terminate(task_id=task_id, reason="bench: left over from an earlier run")
    from django_q.models import OrmQ

    OrmQ.objects.all().delete()
    user, _ = get_user_model().objects.get_or_create(username="bench", defaults={"is_superuser": True,
                                                                                "is_staff": True})
    token = token_issue(user=user, expires_in_days=1)
    # The throughput targets: paused before any worker runs (so nothing consumes meanwhile).
    targets = [services.task_create(type="bench.listener", params={"steps": 1}).pk for _ in range(101)]
    for task_id in targets:
        services.task_pause(task_id=task_id, reason="bench: an inbox target")
    OrmQ.objects.all().delete()

    with pg.connect() as conn:
        version = conn.execute("SHOW server_version").fetchone()[0]
    print(f"PostgreSQL {version}, database {pg.database}{' (created)' if created else ''}; {os.cpu_count()} CPUs; "
          f"one qcluster with {settings.ORCH_WORKERS} workers (ORM broker), daphne, the sweeper; "
          f"control poll {settings.ORCH_CONTROL_POLL_SECONDS:g} s, "
          f"merge window {settings.ORCH_INBOX_MERGE_SECONDS:g} s")
    logs = Path(tempfile.mkdtemp(prefix="bench-events-"))
    port = free_port()
    stack = Stack(port, logs)
    base = f"http://127.0.0.1:{port}"
    try:
        def web_up() -> bool:
            try:
                return post_event(base, token, targets[0], {"type": "progress.external", "payload": {}}) == 202
            except OSError:
                return False

        wait_until(web_up, 60, 0.2, stack)
        print(f"\n== Accepted events/s: POST /api/tasks/{{id}}/events over HTTP, {clients} concurrent clients, "
              "P1 user.message, each with its own source_event_id ==")
        rate_one, answers_one = throughput(base, token, targets[:1], events_one, clients, "one")
        rate_many, answers_many = throughput(base, token, targets[1:], events_many, clients, "many")
        print(f"  {'into one task':<24} {events_one:>6} events  {rate_one:>7.0f} accepted/s   answers {answers_one}")
        print(f"  {'across 100 tasks':<24} {events_many:>6} events  {rate_many:>7.0f} accepted/s   "
              f"answers {answers_many}")

        # Latency: a running task with short steps.
        task = services.task_create(type="bench.listener", params={"steps": 100_000, "sleep_ms": 20})
        wait_until(lambda: Task.objects.filter(pk=task.pk, status="running").exclude(lease_owner="").exists(),
                   60, 0.02, stack)
        sent: dict[int, list[int]] = {1: [], 3: [], 4: []}
        kinds = {1: ("user.message", {"text": "hello"}), 3: ("upstream.ready", {"resource": "r"}),
                 4: ("progress.external", {"message": "m"})}
        for i in range(per_priority):
            for priority, (type_name, payload) in kinds.items():
                event = inbox.send(task_id=task.pk, type=type_name, payload=payload, merge_key=f"k{i}",
                                   source_event_id=f"latency-{priority}-{i}").event
                sent[priority].append(event.pk)
                time.sleep(0.03)  # one at a time: a latency, not a backlog
        every = [pk for pks in sent.values() for pk in pks]
        wait_until(lambda: not InboundEvent.objects.filter(pk__in=every, state="pending").exists(), 120, 0.1, stack)
        latency = {}
        for priority, pks in sent.items():
            rows = InboundEvent.objects.filter(pk__in=pks).values_list("state", "created_at", "consumed_at")
            latency[priority] = [(c - a).total_seconds() * 1000 for s, a, c in rows if s == "consumed"]

        # P0: pause -> the runner acknowledges; resumed between rounds.
        acks = []
        for _ in range(rounds):
            wait_until(lambda: Task.objects.filter(pk=task.pk, status="running").exclude(lease_owner="").exists(),
                       60, 0.01, stack)
            time.sleep(0.1)  # a step in flight, as in real use
            services.task_pause(task_id=task.pk, reason="bench")
            # The stamps of earlier rounds stay: this round's acknowledgement comes after its request.
            acknowledged = Task.objects.filter(pk=task.pk, control_acknowledged_at__gte=F("control_requested_at"))
            row = wait_until(lambda: acknowledged.values_list("control_requested_at", "control_acknowledged_at")
                             .first(), 30, 0.005, stack)
            acks.append((row[1] - row[0]).total_seconds() * 1000)
            wait_until(lambda: Task.objects.get(pk=task.pk).status == "paused", 30, 0.01, stack)
            services.task_resume(task_id=task.pk)
        services.task_terminate(task_id=task.pk, reason="bench: done")

        # P0 preempt -> the steps in flight interrupted (the frame records how long after the
        # event arrived the runner cancelled them): demo.contracts pacing 2 s per contract.
        batch = services.task_create(type="demo.contracts", params={"count": 20, "pace_seconds": 2.0},
                                     limits={"max_subtasks": 1})
        interrupts = []
        for i in range(min(rounds, 8)):
            wait_until(lambda: any(a.get("label", "").startswith("contract-")
                                   for a in Task.objects.get(pk=batch.pk).activities or [])
                       and not Task.objects.get(pk=batch.pk).stack, 60, 0.01, stack)
            time.sleep(0.3)  # well inside the contract's 2 s
            seq = inbox.send(task_id=batch.pk, type="preempt",
                             payload={"subtask": "reparse", "args": {"contract": 1 + i}}).event.seq
            frame = wait_until(lambda: next((f for f in Task.objects.get(pk=batch.pk).stack if f["event"] == seq),
                                            None), 30, 0.005, stack)
            if frame.get("interrupted_after_ms") is not None:
                interrupts.append(frame["interrupted_after_ms"])
        services.task_terminate(task_id=batch.pk, reason="bench: done")

        print(f"\n== Latency on a running task (bench.listener, 20 ms steps), {per_priority} events per priority "
              f"sent one at a time (engine inbox.send) ==")
        print(f"  {'what':<44} {'n':>4} {'p50 ms':>9} {'p95 ms':>9}")
        names = {1: "P1 user.message -> consumed", 3: "P3 upstream.ready -> consumed (merge wait)",
                 4: "P4 progress.external -> consumed (merge wait)"}
        for priority, values in latency.items():
            print(f"  {names[priority]:<44} {len(values):>4} {pct(values, 50):>9.1f} {pct(values, 95):>9.1f}")
        print(f"  {'P0 pause -> runner acknowledged':<44} {len(acks):>4} {pct(acks, 50):>9.1f} {pct(acks, 95):>9.1f}")
        print(f"  {'P0 preempt -> running step interrupted':<44} {len(interrupts):>4} {pct(interrupts, 50):>9.1f} "
              f"{pct(interrupts, 95):>9.1f}")
    finally:
        stack.stop()
        for task_id in targets:
            services.task_terminate(task_id=task_id, reason="bench: done")
    print(f"  (logs of the web server, workers and sweeper: {logs})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
