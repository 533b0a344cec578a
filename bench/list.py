"""Pages and the API at a year's scale on PostgreSQL: 1,000,000 tasks, 10,000,000 WAL rows and
idempotency records, 50,000,000 progress events (and 11,000,000 steps, 1,000,000 inbox events,
1,000,000 audit entries, 20,000 review items). Prints p50/p95 per page; asserts nothing.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/bench_list .venv/bin/python bench/list.py
    BENCH_TASKS=100000 ...     # a tenth of the data set (the per-task counts stay)
    BENCH_RUNS=30 ...          # requests per page (default 20)

The data set is built once and kept (a second run only measures; BENCH_REBUILD=1 starts over):
- one real task (demo.migrate_rows, run in this process) is the template: 11 steps, 11 WAL rows,
  15 progress events and its snapshot, as the engine wrote them;
- the tasks are streamed with COPY (types, titles a person would search, a status mix of a year:
  mostly finished, a few thousand running, queued, paused, in review);
- every other table is filled from the template by set-based INSERT … SELECT in the server, one
  chunk of tasks per statement (no row crosses the wire, which beats a client-side COPY of the
  60,000,000 child rows); keys get each task's own id (`t<id>:<step>:<n>`), times are shifted
  to the task's, and 35 progress events per task are added to reach 50.
Requests go through the Django test client in this process (middleware, templates, the ORM, no
network), logged in as a superuser; the admin's changelists are measured the same way.
"""
import json
import os
import random
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/bench_list")
TASKS = int(os.environ.get("BENCH_TASKS", "1000000"))
RUNS = int(os.environ.get("BENCH_RUNS", "20"))
EVENTS_PER_TASK, WAL_PER_TASK, INBOX_PER_TASK = 50, 10, 1
REVIEWS, OPEN_REVIEWS = 20_000, 500
CHUNK = 20_000  # tasks per INSERT … SELECT

from bench.measure import PgServer  # noqa: E402

if not os.environ["DATABASE_URL"].startswith("postgres"):
    sys.exit("bench/list.py measures PostgreSQL (the production database): set DATABASE_URL=postgres://…")
_server = PgServer(os.environ["DATABASE_URL"])
if os.environ.get("BENCH_REBUILD"):
    with _server.connect() as admin_conn:
        admin_conn.autocommit = True
        admin_conn.execute(f'DROP DATABASE IF EXISTS "{_server.database}" WITH (FORCE)')
_server.ensure_database(_server.database)

from bench._django import setup  # noqa: E402

setup("list-bench")
from django.contrib.auth import get_user_model  # noqa: E402
from django.db import connection  # noqa: E402
from django.test import Client  # noqa: E402
from django.utils import timezone  # noqa: E402

from orchestrator.engine import services  # noqa: E402
from orchestrator.engine.worker import drive_inline  # noqa: E402
from orchestrator.models import Task  # noqa: E402
from review.models import ReviewItem  # noqa: E402

TEMPLATE_TITLE = "bench template: a real migrate_rows run"
TYPES = ["demo.migrate_rows", "demo.pipeline", "demo.notify", "demo.contracts", "agent.plan_execute",
         "demo.payment", "demo.report", "demo.sync"]
VERBS = ["migrate", "sync", "notify", "summarise", "reconcile", "export", "review", "backfill"]
NOUNS = ["customers", "invoices", "contracts", "orders", "ledger", "accounts", "shipments", "tickets"]
REGIONS = ["eu-west", "us-east", "ap-south", "eu-north"]
# A year of tasks: mostly finished; a few thousand live at any moment.
STATUS_MIX = [("completed", 0.85), ("failed", 0.05), ("stopped", 0.03), ("terminated", 0.01),
              ("queued", 0.02), ("running", 0.003), ("paused", 0.015), ("waiting", 0.005),
              ("needs_human", 0.0015), ("awaiting_review", 0.0005)]
TERMINAL = {"completed", "failed", "stopped", "terminated"}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def sql(statement: str, params=None) -> int:
    with connection.cursor() as cursor:
        cursor.execute(statement, params)
        return cursor.rowcount


def template_task() -> Task:
    found = Task.objects.filter(title=TEMPLATE_TITLE).first()
    if found:
        return found
    task = services.task_create(type="demo.migrate_rows", params={"rows": 1000, "batch_size": 100},
                                title=TEMPLATE_TITLE)
    assert drive_inline(task.pk) == "completed"
    return Task.objects.get(pk=task.pk)


def copy_tasks(template: Task, count: int) -> None:
    """COPY `count` tasks, created over the last year, oldest first."""
    rng = random.Random(14)
    statuses = [s for s, _ in STATUS_MIX]
    weights = [w for _, w in STATUS_MIX]
    now = timezone.now()
    span = timedelta(days=365).total_seconds()
    params, limits = json.dumps(template.params), json.dumps({})
    columns = ("type, title, params, limits, status, status_reason, error, steps_total, steps_done, tokens_used, "
               "active_seconds, recovery_attempts, checkpoint_version, event_seq, lease_owner, lease_epoch, "
               "worker_host, control, created_at, updated_at, started_at, finished_at, activities, paused_by_limit, "
               "inbox_pending, inbox_seq, waiting_for, stack, heartbeat_at")
    with connection.cursor() as cursor, cursor.cursor.copy(f"COPY orchestrator_task ({columns}) FROM STDIN") as copy:
        for i in range(count):
            status = rng.choices(statuses, weights)[0]
            created = now - timedelta(seconds=span * (count - i) / count)
            finished = created + timedelta(seconds=rng.uniform(5, 900)) if status in TERMINAL else None
            done = 11 if status == "completed" else rng.randint(0, 10)
            title = (f"{rng.choice(VERBS)} {rng.choice(NOUNS)} {rng.choice(REGIONS)} batch {i}"
                     if i % 3 else f"{rng.choice(VERBS)} {rng.choice(NOUNS)} for client {i % 7919}")
            running = status == "running"
            copy.write_row((
                TYPES[i % len(TYPES)], title, params, limits, status, "", "step failed: timeout" if status == "failed" else "",
                11, done, rng.randint(0, 50_000) if i % 8 == 4 else 0, rng.uniform(1, 900), 0,
                template.checkpoint_version, EVENTS_PER_TASK, "host-1:123:abc" if running else "", 1,
                "host-1" if running else "", "", created, finished or created, created, finished, "[]", "",
                0, INBOX_PER_TASK, "[]", "[]", now if running else None))
            if i and i % 200_000 == 0:
                log(f"  tasks: {i:,} copied")


def fill_children(template: Task, first: int, last: int) -> None:
    """Every child table for tasks first..last, copied from the template's rows."""
    t0 = template.pk
    shift = "(t.created_at - tt.created_at)"
    base = f"FROM orchestrator_task t CROSS JOIN orchestrator_task tt WHERE tt.id = {t0} AND t.id BETWEEN %s AND %s"
    key = f"'t' || t.id || substr(%s, length('t{t0}') + 1)"
    sql(f"""INSERT INTO orchestrator_step (task_id, step_id, position, title, depends_on, declared_reads, reads, status,
              attempts, result, error, started_at, finished_at, failure_fingerprint, generation, on_failure,
              runs_after_skipped, added_by, result_bytes, result_stored_apart, before)
            SELECT t.id, s.step_id, s.position, s.title, s.depends_on, s.declared_reads, s.reads,
                   CASE WHEN t.steps_done > s.position OR t.status = 'completed' THEN s.status ELSE 'pending' END,
                   s.attempts, s.result, s.error, s.started_at + {shift}, s.finished_at + {shift},
                   s.failure_fingerprint, s.generation, s.on_failure, s.runs_after_skipped, s.added_by, s.result_bytes,
                   s.result_stored_apart, s.before
            {base.replace('WHERE', 'CROSS JOIN orchestrator_step s WHERE s.task_id = tt.id AND')}
            ORDER BY t.id, s.position""", [first, last])
    wal_template = f"(SELECT * FROM orchestrator_walentry WHERE task_id = {t0} ORDER BY id LIMIT {WAL_PER_TASK})"
    sql(f"""INSERT INTO orchestrator_walentry (task_id, step_id, call_index, tool, args, idempotency_key, idempotent,
              status, result, error, lease_epoch, worker, created_at, completed_at)
            SELECT t.id, w.step_id, w.call_index, w.tool, w.args, {key.replace('%s', 'w.idempotency_key')},
                   w.idempotent, w.status, w.result, w.error, 1, w.worker, w.created_at + {shift},
                   w.completed_at + {shift}
            {base.replace('WHERE', f'CROSS JOIN {wal_template} w WHERE')} ORDER BY t.id, w.id""", [first, last])
    sql(f"""INSERT INTO orchestrator_idempotencyrecord (key, tool, result, created_at)
            SELECT {key.replace('%s', 'w.idempotency_key')}, w.tool, w.result, w.completed_at + {shift}
            {base.replace('WHERE', f'CROSS JOIN {wal_template} w WHERE')} ORDER BY t.id, w.id""", [first, last])
    sql(f"""INSERT INTO orchestrator_taskevent (task_id, seq, kind, payload, created_at)
            SELECT t.id, e.seq, e.kind, e.payload, e.created_at + {shift}
            {base.replace('WHERE', 'CROSS JOIN orchestrator_taskevent e WHERE e.task_id = tt.id AND')}
            UNION ALL
            SELECT t.id, n, 'progress', jsonb_build_object('message', 'copied batch ' || n || ' of 50', 'done', n),
                   t.created_at + n * interval '1 second'
            {base.replace('WHERE', f'CROSS JOIN generate_series((SELECT max(seq) + 1 FROM orchestrator_taskevent WHERE task_id = {t0}), {EVENTS_PER_TASK}) n WHERE')}
            ORDER BY 1, 2""", [first, last, first, last])
    sql(f"""INSERT INTO orchestrator_snapshot (task_id, version, step_id, state, created_at, "full")
            SELECT t.id, s.version, s.step_id, s.state, s.created_at + {shift}, true
            {base.replace('WHERE', f'CROSS JOIN (SELECT * FROM orchestrator_snapshot WHERE task_id = {t0} ORDER BY version DESC LIMIT 1) s WHERE')}
            ORDER BY t.id""", [first, last])
    sql(f"""INSERT INTO orchestrator_inboundevent (task_id, seq, type, priority, source, actor_name, source_event_id,
              payload, payload_sha256, merge_key, state, outcome, occurred_at, visible_at, consumed_at,
              consumed_in_version, created_at)
            SELECT t.id, 1, 'message', 1, 'webhook:crm', '', 'crm-' || t.id,
                   jsonb_build_object('text', 'customer replied about ' || t.title), md5(t.title) || md5(t.title), '',
                   'consumed', 'recorded', t.created_at, t.created_at, t.created_at + interval '2 seconds', 3,
                   t.created_at
            {base} ORDER BY t.id""", [first, last])
    sql("""INSERT INTO orchestrator_auditentry (actor_name, at, ip, action, task_id, before, after, reason)
           SELECT 'bench', t.created_at, '10.0.0.7', 'create', t.id, NULL, jsonb_build_object('type', t.type), ''
           FROM orchestrator_task t WHERE t.id BETWEEN %s AND %s ORDER BY t.id""", [first, last])


def add_reviews() -> None:
    """REVIEWS items, OPEN_REVIEWS of them open (on the tasks in review), on a WAL row each."""
    sql(f"""INSERT INTO review_reviewitem (task_id, wal_entry_id, kind, status, reason, dead_worker, detected_at, evidence,
              decision, decision_result, note, decided_at, proposal, step_id, tool)
            SELECT t.id, (SELECT min(w.id) FROM orchestrator_walentry w WHERE w.task_id = t.id), 'effect',
                   CASE WHEN t.status = 'awaiting_review' THEN 'open' ELSE 'decided' END,
                   'the worker died after sending; whether the effect happened is unknown', 'host-2:77:dead',
                   t.created_at, '{{}}'::jsonb,
                   CASE WHEN t.status = 'awaiting_review' THEN '' ELSE 'happened' END, NULL::jsonb, '',
                   CASE WHEN t.status = 'awaiting_review' THEN NULL ELSE t.finished_at END, NULL::jsonb, 'batch-0001',
                   'db.upsert'
            FROM (SELECT * FROM orchestrator_task WHERE status = 'awaiting_review' ORDER BY id LIMIT {OPEN_REVIEWS}) t
            UNION ALL
            SELECT t.id, (SELECT min(w.id) FROM orchestrator_walentry w WHERE w.task_id = t.id), 'effect', 'decided',
                   'the worker died after sending; whether the effect happened is unknown', 'host-2:77:dead',
                   t.created_at, '{{}}'::jsonb, 'happened', NULL::jsonb, 'checked with the provider', t.finished_at, NULL::jsonb,
                   'batch-0001', 'db.upsert'
            FROM (SELECT * FROM orchestrator_task WHERE status = 'completed' AND id % 43 = 0 ORDER BY id
                  LIMIT {REVIEWS - OPEN_REVIEWS}) t""")


def build() -> Task:
    template = template_task()
    have = Task.objects.count() - 1
    if have >= TASKS:
        if not ReviewItem.objects.exists():  # a build stopped after the tasks and their rows
            add_reviews()
            sql("ANALYZE")
        return template
    if have:
        sys.exit(f"bench_list holds {have:,} tasks of {TASKS:,}: run with BENCH_REBUILD=1 to build it again")
    started = time.monotonic()
    log(f"building the data set: {TASKS:,} tasks with COPY")
    copy_tasks(template, TASKS)
    first, last = Task.objects.exclude(pk=template.pk).order_by("id").values_list("id", flat=True)[:1][0], \
        Task.objects.order_by("-id").values_list("id", flat=True)[0]
    for lo in range(first, last + 1, CHUNK):
        fill_children(template, lo, min(lo + CHUNK - 1, last))
        done = min(lo + CHUNK - 1, last) - first + 1
        elapsed = time.monotonic() - started
        log(f"  child rows for {done:,}/{TASKS:,} tasks ({elapsed / 60:.1f} min, "
            f"about {elapsed * (TASKS - done) / done / 60:.0f} min left)")
    log("ANALYZE")
    sql("ANALYZE")  # before the reviews: their per-task lookups need the planner to know the WAL is big
    add_reviews()
    sql("ANALYZE")
    log(f"built in {(time.monotonic() - started) / 60:.1f} min")
    return template


def counts() -> str:
    with connection.cursor() as cursor:
        cursor.execute("""SELECT relname, reltuples::bigint FROM pg_class WHERE relname IN
                          ('orchestrator_task', 'orchestrator_walentry', 'orchestrator_taskevent', 'orchestrator_step',
                           'orchestrator_idempotencyrecord', 'orchestrator_inboundevent', 'review_reviewitem',
                           'orchestrator_auditentry') ORDER BY relname""")
        rows = cursor.fetchall()
        cursor.execute("SELECT pg_size_pretty(pg_database_size(current_database()))")
        size = cursor.fetchone()[0]
    return ", ".join(f"{name.split('_', 1)[1]} {n:,}" for name, n in rows) + f" (about; {size} on disk)"


def timed(client: Client, url: str) -> tuple[float, float]:
    client.get(url)  # warm: the first request of a URL compiles templates, fills caches
    times = []
    for _ in range(RUNS):
        started = time.perf_counter()
        response = client.get(url)
        times.append((time.perf_counter() - started) * 1000)
        if response.status_code != 200:
            raise SystemExit(f"{url}: HTTP {response.status_code}")
    return statistics.median(times), statistics.quantiles(times, n=20)[18] if len(times) > 1 else times[0]


def pages(template: Task) -> list[tuple[str, str, str]]:
    """(section, label, url) of everything measured."""
    ids = Task.objects.order_by("id").values_list("id", flat=True)
    deep = ids[TASKS // 2]
    middle = Task.objects.filter(pk__gte=deep, status="completed").order_by("id").values_list("id", flat=True)[0]
    in_review = Task.objects.filter(status="awaiting_review").order_by("-id").values_list("id", flat=True).first()
    running = Task.objects.filter(status="running").order_by("-id").values_list("id", flat=True).first()
    rows = [("list", "first page", "/"), ("list", "deep page (keyset, half-way)", f"/?before={deep}")]
    rows += [("list", f"status={s}", f"/?status={s}") for s, _ in STATUS_MIX]
    rows += [("list", "status=running,paused,waiting", "/?status=running,paused,waiting"),
             ("list", "type=demo.notify", "/?type=demo.notify"),
             ("list", "type + status (rare pair)", "/?type=demo.notify&status=needs_human"),
             ("list", "search a common word", "/?q=invoices"),
             ("list", "search a rare title", f"/?q=batch+{TASKS // 3 * 3 - 1}"),
             ("list", "search a word no title has", "/?q=zanzibar"),
             ("list", "search by #id", f"/?q=%23{middle}"),
             ("list", "search + status + type", "/?q=ledger&status=failed&type=demo.sync"),
             ("task page", "a finished task of the year", f"/tasks/{middle}/"),
             ("task page", "the real template task", f"/tasks/{template.pk}/"),
             ("task page", "a task in review", f"/tasks/{in_review}/"),
             ("task page", "a running task", f"/tasks/{running}/"),
             ("review", "queue (open)", "/review/"),
             ("review", "queue (decided)", "/review/?status=decided"),
             ("review", "queue, one task", f"/review/?task={in_review}"),
             ("review", "queue, one tool", "/review/?status=decided&tool=db.upsert"),
             ("inbox", "API inbox of a task", f"/api/tasks/{middle}/inbox"),
             ("inbox", "API progress events of a task", f"/api/tasks/{middle}/events"),
             ("API", "GET /api/tasks", "/api/tasks"),
             ("API", "GET /api/tasks deep page", f"/api/tasks?before={deep}"),
             ("API", "GET /api/tasks?status=paused", "/api/tasks?status=paused"),
             ("API", "GET /api/tasks?type=…&status=…", "/api/tasks?type=demo.notify&status=failed"),
             ("API", "GET /api/tasks?q=…", "/api/tasks?q=reconcile"),
             ("API", "GET /api/tasks/{id}", f"/api/tasks/{middle}"),
             ("API", "GET /api/reviews", "/api/reviews")]
    for model in ("task", "step", "walentry", "taskevent", "idempotencyrecord", "inboundevent", "snapshot",
                  "auditentry"):
        rows.append(("admin", f"{model} list", f"/admin/orchestrator/{model}/"))
    rows += [("admin", "task list, status filter", "/admin/orchestrator/task/?status__exact=failed"),
             ("admin", "task list, search", "/admin/orchestrator/task/?q=reconcile"),
             ("admin", "WAL of one task", f"/admin/orchestrator/walentry/?task__id__exact={middle}"),
             ("admin", "events of one task", f"/admin/orchestrator/taskevent/?task__id__exact={middle}"),
             ("admin", "idempotency key search", f"/admin/orchestrator/idempotencyrecord/?q=t{middle}:batch-0002:0"),
             ("admin", "review items", "/admin/review/reviewitem/"),
             ("admin", "review items of a tool", "/admin/review/reviewitem/?tool=db.upsert"),
             ("admin", "task change page", f"/admin/orchestrator/task/{middle}/change/")]
    return rows


def main():
    template = build()
    user = (get_user_model().objects.filter(username="bench").first()
            or get_user_model().objects.create_superuser("bench", "b@x.org", "pw"))
    client = Client()
    client.force_login(user)
    print(f"\nPostgreSQL: {counts()}")
    print(f"p50 / p95 of {RUNS} requests each, in-process (Django test client, no network); target p95 <= 150 ms\n")
    missed = []
    for section, label, url in pages(template):
        p50, p95 = timed(client, url)
        flag = "" if p95 <= 150 else "  <-- over 150 ms"
        if flag:
            missed.append(label)
        print(f"  {section:>9} | {label:<34} {p50:7.1f} {p95:7.1f} ms{flag}")
    print(f"\n{len(missed)} page(s) over the target" + (f": {', '.join(missed)}" if missed else ""))


if __name__ == "__main__":
    main()
