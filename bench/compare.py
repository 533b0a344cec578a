"""Side by side, on one PostgreSQL: our durable steps, DBOS and LangGraph; then our engine at
scale, and the latency and throughput of many tasks on real workers.

    make bench                                           # installs the `bench` extra, runs everything
    .venv/bin/python bench/compare.py [--only ours,dbos,langgraph,scale,latency] [--skip ...] [--write-docs]

Each system's figures are taken BENCH_RUNS times and summed up as min/median/max beside the
floor (one INSERT committed per step on the same server), with the ratios of the medians and
issue 24's targets, met or missed. LangGraph runs in both durability modes, each labelled with
whether it is durable. --write-docs puts that summary, with the date and the machine, into
docs/benchmarks.md and the README (generated: edit this script, not those blocks).

DATABASE_URL (default postgres://postgres@127.0.0.1:5432/bench_compare) is the database of our
engine; it is created if missing. DBOS's system database (<name>_dbos_sys) and LangGraph's
checkpoint tables (<name>_langgraph) live on the same server, each in a database of its own, so
that each system's commits can be told apart. Environment:
    BENCH_ONLY / BENCH_SKIP    like --only / --skip
    BENCH_RUNS                 runs of the side-by-side and the latency sections (default 3): min/median/max
    BENCH_STEPS                steps per run in the side-by-side section (default 500)
    BENCH_MAX_STEPS            caps every step count (the side-by-side runs and 100/1,000/10,000)
    BENCH_LANGGRAPH_SHAPE      loop (default: one node looping via a conditional edge) or linear
    BENCH_LATENCY_TASKS        tasks created one at a time for the latency figures (default 50)
    BENCH_INFLIGHT_TASKS       tasks in flight at once for the throughput figure (default 1000)
    BENCH_CLIENTS              concurrent HTTP clients creating those (default 8)
    REDIS_URL                  use the Redis broker for the workers (default: django-q2's ORM broker)

How each figure is taken (the same for all systems):
- ms/step: wall time of the whole run (creating/starting it included) / steps.
- commits/step: PostgreSQL transactions committed in the system's database(s), from
  pg_stat_database.xact_commit deltas read once the counters have settled; read-only transactions
  and background work during the run (heartbeats, pollers) count. For ours, Django's own commits
  (BaseDatabaseWrapper.commit) are shown too.
- bytes/step: growth of pg_total_relation_size (heap, indexes, TOAST) of the tables the system
  writes: ours orchestrator_step, _snapshot, _taskevent, _walentry, _idempotencyrecord (the task
  row itself is shown apart); DBOS every table of its `dbos` schema; LangGraph its checkpoint tables.
  Dead row versions (our pruned snapshots, updated rows) count until a vacuum reuses the space.
Prints figures, asserts nothing.
"""
import argparse
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.measure import stop_process_groups, wait_until  # noqa: E402
from bench.report import Report  # noqa: E402

SECTIONS = ("ours", "dbos", "langgraph", "latency", "scale")  # in the order they run
DEFAULT_DATABASE_URL = "postgres://postgres@127.0.0.1:5432/bench_compare"
OUR_TABLES = ["orchestrator_step", "orchestrator_snapshot", "orchestrator_taskevent", "orchestrator_walentry",
              "orchestrator_idempotencyrecord"]
OUR_OTHER_TABLES = ["orchestrator_task"]
LANGGRAPH_TABLES = ["checkpoints", "checkpoint_blobs", "checkpoint_writes", "checkpoint_migrations"]
INSTALL_HINT = "pip install -e '.[bench]'  (or: make bench)"


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "").strip()
    return int(value) if value else default


def kib(n: float) -> str:
    return f"{n / 1024:+.0f} KiB" if abs(n) >= 1024 else f"{n:+.0f} B"


@dataclass
class Figures:
    label: str
    steps: int
    seconds: float
    xacts: int
    tables: dict  # table -> bytes grown
    counted: list  # the tables in bytes/step
    django_commits: int | None = None
    statements: int | None = None
    extra: dict = field(default_factory=dict)

    @property
    def ms(self) -> float:
        return 1000 * self.seconds / self.steps

    @property
    def commits(self) -> float:
        return self.xacts / self.steps

    @property
    def bytes(self) -> float:
        return sum(self.tables.get(t, 0) for t in self.counted) / self.steps

    def line(self) -> str:
        text = (f"  {self.label:<34} {self.steps:>6} {self.ms:>9.2f} {self.commits:>13.2f} {self.bytes:>11.0f}"
                f" {self.seconds:>9.1f}")
        return text

    def details(self) -> str:
        parts = []
        if self.django_commits is not None:
            parts.append(f"Django commits {self.django_commits / self.steps:.2f}/step, "
                         f"SQL statements {self.statements / self.steps:.1f}/step")
        parts += list(self.extra.values())
        grown = [f"{t} {kib(b)}" for t, b in sorted(self.tables.items(), key=lambda kv: -kv[1]) if b]
        if grown:
            parts.append("tables: " + ", ".join(grown))
        return "      " + "; ".join(parts) if parts else ""


HEADER = (f"  {'system':<34} {'steps':>6} {'ms/step':>9} {'commits/step':>13} {'bytes/step':>11} {'total s':>9}")


class Bench:
    def __init__(self, pg, counters):
        self.pg, self.counters = pg, counters

    def measure(self, label: str, steps: int, databases: list[str], sizes: list[tuple[str, dict]],
                counted: list[str] | None, run, *, close=None, background: bool = False,
                django: bool = False) -> Figures:
        """Run `run()` once, timed, with the PostgreSQL figures taken around it. `close()` (not
        timed) closes the system's connections, so that their statistics are reported at once.
        With `background`, the system commits while idle too (pollers): that rate is measured for
        3 s before the run and subtracted."""
        def table_sizes():
            total = {}
            for database, spec in sizes:
                total.update(self.pg.table_bytes(database, **spec))
            return total

        before_sizes = table_sizes()
        rate = 0.0
        if background:
            first, since = self.pg.xact_commits_now(databases), time.monotonic()
            time.sleep(3)
            before = self.pg.xact_commits_now(databases)
            rate = (before - first) / (time.monotonic() - since)
        else:
            before = self.pg.xact_commits(databases)
        window_start = time.monotonic()
        commits0, statements0 = self.counters.read()
        start = time.perf_counter()
        run()
        seconds = time.perf_counter() - start
        commits1, statements1 = self.counters.read()
        if close is not None:
            close()
        subtracted = round(rate * (time.monotonic() - window_start))
        after = self.pg.xact_commits(databases)
        after_sizes = table_sizes()
        grown = {t: after_sizes.get(t, 0) - before_sizes.get(t, 0) for t in after_sizes}
        figures = Figures(label, steps, seconds, after - before - subtracted, grown,
                          counted if counted is not None else list(grown),
                          django_commits=(commits1 - commits0) if django else None,
                          statements=(statements1 - statements0) if django else None)
        if background:
            figures.extra["background"] = f"idle background {rate:.1f} commits/s, {subtracted} subtracted"
        return figures


def close_django_connections():
    from django.db import connections

    connections.close_all()


# --- Ours --------------------------------------------------------------------------------

def ours(bench: Bench, steps: int, effect: bool, label: str | None = None, at_commit: bool = False) -> Figures:
    from bench.measure import run_task

    default = ("ours, side-effect chain" + (" at commit" if at_commit else "")) if effect else "ours, pure chain"
    db = bench.pg.database
    return bench.measure(label or default, steps, [db],
                         [(db, {"tables": OUR_TABLES + OUR_OTHER_TABLES})], OUR_TABLES,
                         lambda: run_task("bench.chain", {"steps": steps, "effect": effect, "at_commit": at_commit}),
                         close=close_django_connections, django=True)


def section_ours(bench: Bench, steps: int) -> list[Figures]:
    """A pure step; a step with one db.upsert performed in place (its own transaction, then the
    checkpoint), and the same written with the step's checkpoint (ctx.effect(..., at_commit=True))."""
    from bench.measure import run_task

    run_task("bench.chain", {"steps": 20})  # warm-up
    run_task("bench.chain", {"steps": 20, "effect": True})
    run_task("bench.chain", {"steps": 20, "effect": True, "at_commit": True})
    return [ours(bench, steps, False), ours(bench, steps, True), ours(bench, steps, True, at_commit=True)]


# --- DBOS --------------------------------------------------------------------------------

def dbos_database(pg) -> str:
    return os.environ.get("BENCH_DBOS_DATABASE", f"{pg.database}_dbos_sys")


def langgraph_database(pg) -> str:
    return os.environ.get("BENCH_LANGGRAPH_DATABASE", f"{pg.database}_langgraph")


def section_dbos(bench: Bench, steps: int) -> Figures | None:
    try:
        from dbos import DBOS
    except ImportError:
        print(f"DBOS: skipped, the bench extra is not installed: {INSTALL_HINT}")
        return None
    database = dbos_database(bench.pg)
    bench.pg.ensure_database(database)

    @DBOS.step()
    def bench_step(i: int) -> dict:
        return {"i": i, "sum": i * (i + 1) // 2}

    @DBOS.workflow()
    def bench_workflow(n: int) -> dict:
        last = {}
        for i in range(n):
            last = bench_step(i)
        return last

    DBOS(config={"name": "orchestrator-bench", "system_database_url": bench.pg.url_for(database),
                 "log_level": "WARNING"})
    DBOS.launch()
    destroyed = False

    def destroy():
        nonlocal destroyed
        if not destroyed:
            DBOS.destroy(destroy_registry=True)
            destroyed = True

    try:
        bench_workflow(20)  # warm-up (and DBOS's migrations are done by now)
        return bench.measure(f"DBOS {metadata.version('dbos')}", steps, [database], [(database, {"schema": "dbos"})],
                             None, lambda: bench_workflow(steps), close=destroy, background=True)
    finally:
        destroy()


# --- LangGraph ---------------------------------------------------------------------------

def langgraph_graph(shape: str, n: int, checkpointer):
    from typing import TypedDict

    from langgraph.graph import END, START, StateGraph

    class State(TypedDict):
        i: int
        n: int
        last: dict

    def work(i: int) -> dict:
        return {"i": i, "last": {"i": i, "sum": i * (i + 1) // 2}}

    graph = StateGraph(State)
    if shape == "linear":  # n distinct nodes in a row
        previous = START
        for i in range(n):
            graph.add_node(f"n{i:05d}", lambda state, i=i: work(i))
            graph.add_edge(previous, f"n{i:05d}")
            previous = f"n{i:05d}"
        graph.add_edge(previous, END)
    else:  # one node looping, as an agent loop does
        graph.add_node("step", lambda state: work(state["i"] + 1))
        graph.add_edge(START, "step")
        graph.add_conditional_edges("step", lambda state: "step" if state["i"] + 1 < state["n"] else END)
    return graph.compile(checkpointer=checkpointer)


LANGGRAPH_DURABILITY = {
    "sync": "durable: each step's checkpoint is committed before the next step starts",
    "async": "its default; not durable: a step's checkpoint is written in the background while the next runs, "
             "and lost if the process dies",
}


def section_langgraph(bench: Bench, steps: int, durability: str) -> Figures | None:
    try:
        from langgraph.checkpoint.postgres import PostgresSaver
    except ImportError:
        print(f"LangGraph: skipped, the bench extra is not installed: {INSTALL_HINT}")
        return None
    shape = os.environ.get("BENCH_LANGGRAPH_SHAPE", "loop")
    database = langgraph_database(bench.pg)
    bench.pg.ensure_database(database)

    def invoke(graph, n):
        config = {"configurable": {"thread_id": str(uuid.uuid4())}, "recursion_limit": n + 10}
        out = graph.invoke({"i": -1, "n": n, "last": {}}, config=config, durability=durability)
        if out["i"] != n - 1:
            raise RuntimeError(f"LangGraph ran {out['i'] + 1} of {n} steps")

    with PostgresSaver.from_conn_string(bench.pg.url_for(database)) as saver:
        saver.setup()
        invoke(langgraph_graph(shape, 20, saver), 20)  # warm-up
    # The measured run has a connection of its own, closed at the end (its statistics then count at once).
    with ExitStack() as connection:
        graph = langgraph_graph(shape, steps, connection.enter_context(
            PostgresSaver.from_conn_string(bench.pg.url_for(database))))
        figures = bench.measure(f"LangGraph {metadata.version('langgraph')} ({durability})", steps,
                             [database], [(database, {"tables": LANGGRAPH_TABLES})], None,
                                lambda: invoke(graph, steps), close=connection.close)
    figures.extra["durability"] = (f"PostgresSaver, {shape} graph; durability={durability!r}: "
                                   f"{LANGGRAPH_DURABILITY[durability]}")
    return figures


# --- The floor: one row, one commit ------------------------------------------------------

def section_floor(bench: Bench, steps: int) -> Figures:
    """What no durable step can beat on this server: one INSERT of a small row, committed,
    per step (a round trip and a WAL flush), on one connection."""
    with bench.pg.connect(bench.pg.database) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS bench_floor (id bigserial PRIMARY KEY, v jsonb)")

    def run():
        with bench.pg.connect(bench.pg.database) as conn:
            for i in range(steps):
                conn.execute("INSERT INTO bench_floor (v) VALUES (%s)", (json.dumps({"i": i}),))
    db = bench.pg.database
    return bench.measure("floor: one-row commit", steps, [db], [(db, {"tables": ["bench_floor"]})], None, run)


# --- Scale -------------------------------------------------------------------------------

def section_scale(bench: Bench, sizes: list[int]) -> None:
    from bench.measure import peak_rss_kib, rss_kib, run_task

    print("\n== Our engine at scale (pure chain, driven in this process) ==")
    if not sizes:
        print("  skipped: BENCH_MAX_STEPS is below 100")
        return
    run_task("bench.chain", {"steps": 20})  # warm-up
    print(HEADER)
    results = []
    for n in sizes:
        largest = n == sizes[-1]
        rss_before = rss_kib()
        figures = ours(bench, n, False, label=f"ours, pure chain, {n:,} steps")
        rss_after = rss_kib()
        results.append(figures)
        print(figures.line())
        print(figures.details())
        if largest:
            print(f"      executor (this process) RSS: {rss_before / 1024:.1f} MiB before, {rss_after / 1024:.1f} MiB "
                  f"after the {n:,}-step run ({(rss_after - rss_before) / 1024:+.1f} MiB); peak {peak_rss_kib() / 1024:.1f} MiB")
    if len(results) > 1:
        first, last = results[0], results[-1]
        print(f"  cost per step, {last.steps:,} vs {first.steps:,} steps: time x{last.ms / first.ms:.2f}, "
              f"commits x{last.commits / first.commits:.2f}, bytes x{last.bytes / first.bytes:.2f} "
              "(1.00 = constant per-step cost)")


# --- Latency and throughput on real workers ----------------------------------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def pct(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


class Stack:
    """daphne (the web server), one `qcluster` and the sweeper, as `make run` starts them."""

    def __init__(self, port: int, logs: Path):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
        self.logs = logs
        commands = {
            "web": [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port), "orchestrator.asgi:application"],
            "workers": [sys.executable, str(ROOT / "manage.py"), "qcluster"],
            "sweeper": [sys.executable, str(ROOT / "manage.py"), "recover", "--loop"],
        }
        self.procs = {}
        for name, argv in commands.items():
            log = open(logs / f"{name}.log", "w")
            self.procs[name] = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                                start_new_session=True)

    def check(self):
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}; see {self.logs / (name + '.log')}")

    def stop(self):
        stop_process_groups(self.procs.values())


class Api:
    def __init__(self, port: int, token: str):
        self.base, self.token = f"http://127.0.0.1:{port}", token

    def create(self, body: dict) -> tuple[int, dict]:
        import urllib.error
        import urllib.request

        request = urllib.request.Request(f"{self.base}/api/tasks", data=json.dumps(body).encode(), method="POST",
                                         headers={"Authorization": f"Bearer {self.token}",
                                                  "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, {"error": exc.read().decode(errors="replace")[:300]}


def section_latency() -> dict:
    """POST -> first step on real workers, then many tasks in flight; returns the figures."""
    from django.contrib.auth import get_user_model
    from django.db import close_old_connections

    from orchestrator.auth import token_issue
    from orchestrator.engine.states import TERMINAL
    from orchestrator.models import Step, Task

    n_latency = env_int("BENCH_LATENCY_TASKS", 50)
    n_inflight = env_int("BENCH_INFLIGHT_TASKS", 1000)
    clients = env_int("BENCH_CLIENTS", 8)
    timeout = float(env_int("BENCH_TIMEOUT", 1800))
    redis = os.environ.get("REDIS_URL")
    broker = f"Redis ({redis})" if redis else "django-q2 ORM broker (the PostgreSQL database above)"
    from django.conf import settings

    print("\n== Many tasks on real workers: POST /api/tasks over HTTP (daphne), one `manage.py qcluster` "
          f"with {settings.ORCH_WORKERS} workers, the sweeper ==")
    print(f"  broker: {broker}")
    user, _ = get_user_model().objects.get_or_create(username="bench", defaults={"is_superuser": True,
                                                                                "is_staff": True})
    if not user.is_superuser:
        user.is_superuser = True
        user.save(update_fields=["is_superuser"])
    token = token_issue(user=user, expires_in_days=1)
    from orchestrator.engine import services

    for task_id in Task.objects.exclude(status__in=TERMINAL).values_list("pk", flat=True):
        services.task_terminate(task_id=task_id, reason="bench: left over from an earlier run")
    if not redis:
        from django_q.models import OrmQ

        OrmQ.objects.all().delete()  # messages for the tasks driven in this process above
    logs = Path(tempfile.mkdtemp(prefix="bench-compare-"))
    port = free_port()
    stack = Stack(port, logs)
    api = Api(port, token)
    body = {"type": "bench.chain", "params": {"steps": env_int("BENCH_INFLIGHT_STEPS", 3)}}

    def finished(task_id):
        return Task.objects.filter(pk=task_id, status__in=TERMINAL).values_list("status", flat=True).first()

    try:
        def web_up():
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                return True
            except OSError:
                return False

        wait_until(web_up, 60, 0.1, check=stack.check)
        status, task = api.create(body)  # warm-up: the stack answers and the workers run tasks
        if status != 201:
            raise RuntimeError(f"POST /api/tasks answered {status}: {task}")
        wait_until(lambda: finished(task["id"]), 120, 0.05, check=stack.check)

        # 1. One at a time: the API response -> the task's first step running.
        to_claim, to_step, from_post, round_trips = [], [], [], []
        for _ in range(n_latency):
            sent = time.time()
            status, task = api.create(body)
            answered = time.time()
            if status != 201:
                raise RuntimeError(f"POST /api/tasks answered {status}: {task}")
            round_trips.append(answered - sent)
            started = wait_until(lambda: Step.objects.filter(task_id=task["id"], position=0, started_at__isnull=False)
                                 .values_list("started_at", flat=True).first(), 60, 0.005, check=stack.check)
            claimed = Task.objects.filter(pk=task["id"]).values_list("started_at", flat=True).first()
            to_step.append(started.timestamp() - answered)
            from_post.append(started.timestamp() - sent)
            to_claim.append(claimed.timestamp() - answered)
            wait_until(lambda: finished(task["id"]), 60, 0.02, check=stack.check)
        print(f"  {n_latency} tasks created one at a time (bench.chain, {body['params']['steps']} steps), "
              "each finished before the next:")
        print(f"    POST /api/tasks round trip         p50 {1000 * pct(round_trips, 50):7.1f} ms   "
              f"p95 {1000 * pct(round_trips, 95):7.1f} ms")
        print(f"    response -> task running (claimed) p50 {1000 * pct(to_claim, 50):7.1f} ms   "
              f"p95 {1000 * pct(to_claim, 95):7.1f} ms")
        print(f"    response -> first step running     p50 {1000 * pct(to_step, 50):7.1f} ms   "
              f"p95 {1000 * pct(to_step, 95):7.1f} ms   (the step's started_at)")
        print(f"    POST sent -> first step running    p50 {1000 * pct(from_post, 50):7.1f} ms   "
              f"p95 {1000 * pct(from_post, 95):7.1f} ms   (issue 24's target)")

        # 2. Many at once.
        errors: list[str] = []
        lock = threading.Lock()

        def create(_):
            try:
                status, task = api.create(body)
            except Exception as exc:  # a refused or timed-out request is an error, not a crash
                with lock:
                    errors.append(f"POST failed: {exc!r}")
                return None
            finally:
                close_old_connections()
            if status != 201:
                with lock:
                    errors.append(f"POST answered {status}: {task}")
                return None
            return task["id"]

        first_post = time.time()
        with ThreadPoolExecutor(clients) as pool:
            ids = [i for i in pool.map(create, range(n_inflight)) if i is not None]
        created_in = time.time() - first_post
        in_flight_at_end_of_creation = Task.objects.filter(pk__in=ids).exclude(status__in=TERMINAL).count()

        def all_done():
            return not Task.objects.filter(pk__in=ids).exclude(status__in=TERMINAL).exists()

        try:
            wait_until(all_done, timeout, 0.5, check=stack.check)
        except TimeoutError:
            errors.append(f"not finished after {timeout:.0f} s: "
                          f"{Task.objects.filter(pk__in=ids).exclude(status__in=TERMINAL).count()} tasks")
        rows = list(Task.objects.filter(pk__in=ids).values_list("status", "finished_at"))
        completed = [f for s, f in rows if s == "completed"]
        failed = {}
        for s, _ in rows:
            if s != "completed":
                failed[s] = failed.get(s, 0) + 1
        errors += [f"{count} tasks ended {s}" for s, count in failed.items()]
        span = (max(completed).timestamp() - first_post) if completed else float("nan")
        print(f"  {n_inflight} tasks (bench.chain, {body['params']['steps']} steps) created by {clients} concurrent "
              f"clients in {created_in:.1f} s ({len(ids) / created_in:.0f}/s); {in_flight_at_end_of_creation} "
              "still in flight when the last was created")
        print(f"    {len(completed)} completed in {span:.1f} s from the first POST: {len(completed) / span:.1f} tasks/s; "
              f"errors: {len(errors)}")
        for error in errors[:10]:
            print(f"      {error}")
        return {"post_to_first_step_p50_ms": 1000 * pct(from_post, 50),
                "post_to_first_step_p95_ms": 1000 * pct(from_post, 95),
                "tasks_per_second": len(completed) / span if completed else 0.0, "errors": len(errors),
                "inflight_tasks": n_inflight}
    finally:
        stack.stop()
    print(f"  (logs of the web server, workers and sweeper: {logs})")


# --- Main --------------------------------------------------------------------------------

def parse_args(argv) -> tuple[list[str], bool]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default=os.environ.get("BENCH_ONLY", ""),
                        help=f"comma-separated sections to run: {', '.join(SECTIONS)}")
    parser.add_argument("--skip", default=os.environ.get("BENCH_SKIP", ""), help="comma-separated sections to skip")
    parser.add_argument("--write-docs", action="store_true",
                        help="write the summary into docs/benchmarks.md and the README (between their markers)")
    args = parser.parse_args(argv)
    names = lambda text: [s.strip() for s in text.split(",") if s.strip()]  # noqa: E731
    for name in names(args.only) + names(args.skip):
        if name not in SECTIONS:
            parser.error(f"unknown section {name!r}; sections: {', '.join(SECTIONS)}")
    chosen = names(args.only) or list(SECTIONS)
    return [s for s in SECTIONS if s in chosen and s not in names(args.skip)], args.write_docs


def machine_line(pg_version: str) -> str:
    """Where the figures were taken: the CPU, its cores, memory, PostgreSQL."""
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), "unknown CPU") if Path("/proc/cpuinfo").exists() else "unknown CPU"
    memory = next((int(line.split()[1]) // (1024 * 1024) for line in Path("/proc/meminfo").read_text().splitlines()
                   if line.startswith("MemTotal")), 0) if Path("/proc/meminfo").exists() else 0
    return f"{os.cpu_count()} cores ({model}), {memory} GiB, PostgreSQL {pg_version}, Python {sys.version.split()[0]}"


def main(argv=None):
    sections, write_docs = parse_args(argv)
    os.environ.setdefault("DATABASE_URL", DEFAULT_DATABASE_URL)
    if not os.environ["DATABASE_URL"].startswith(("postgres://", "postgresql://")):
        print(f"bench/compare.py measures PostgreSQL; DATABASE_URL is {os.environ['DATABASE_URL']!r}")
        return 2
    # Production-like: no per-query bookkeeping of DEBUG (its query log, in the executor's RSS).
    os.environ.setdefault("DEBUG", "false")
    if os.environ["DEBUG"].lower() in ("0", "false", "no", "off"):
        os.environ.setdefault("SECRET_KEY", secrets.token_urlsafe(50))
    from bench.measure import DjangoCounters, PgServer

    pg = PgServer(os.environ["DATABASE_URL"])
    created = pg.ensure_database(pg.database)
    from bench._django import setup

    setup("compare-bench")
    from django.conf import settings

    counters = DjangoCounters().install()
    bench = Bench(pg, counters)
    with pg.connect() as conn:
        version = conn.execute("SHOW server_version").fetchone()[0]
    cap = env_int("BENCH_MAX_STEPS", 0)
    steps = env_int("BENCH_STEPS", 500)
    steps = min(steps, cap) if cap else steps
    print(f"PostgreSQL {version}, database {pg.database}{' (created)' if created else ''}; DEBUG={settings.DEBUG}; "
          f"heartbeat {settings.ORCH_HEARTBEAT_SECONDS:g} s, control poll {settings.ORCH_CONTROL_POLL_SECONDS:g} s, "
          f"snapshot retention {settings.ORCH_SNAPSHOT_KEEP}; {os.cpu_count()} CPUs; sections: {', '.join(sections)}")

    runs = max(1, env_int("BENCH_RUNS", 3))
    side = [s for s in ("ours", "dbos", "langgraph") if s in sections]
    report = Report(runs=runs, steps=steps, machine=machine_line(version))
    databases = [pg.database, dbos_database(pg), langgraph_database(pg)]
    for run in range(1, runs + 1):
        if pg.vacuum_when_autovacuum_is_off(databases):
            print(f"\n(run {run}: this server runs no autovacuum; VACUUM ANALYZE of {', '.join(databases)} first, "
                  "as autovacuum would have done)")
        if side:
            print(f"\n== Side by side, run {run} of {runs}: {steps} trivial steps in one workflow/graph/task, "
                  "run in this process ==")
            print("  (commits = PostgreSQL transactions, pg_stat_database.xact_commit; "
                  "bytes = pg_total_relation_size growth)")
            results: list[Figures] = [section_floor(bench, steps)]
            if "ours" in sections:
                results += section_ours(bench, steps)
            if "dbos" in sections:
                results.append(section_dbos(bench, steps))
            if "langgraph" in sections:
                results += [section_langgraph(bench, steps, "sync"), section_langgraph(bench, steps, "async")]
            print(HEADER)
            for figures in filter(None, results):
                print(figures.line())
                print(figures.details())
                report.add_step_figures(figures)
        if "latency" in sections:
            report.add_latency(section_latency())
    print()
    print(report.text())
    if write_docs:
        for path in report.write_docs(ROOT):
            print(f"  written: {path.relative_to(ROOT)}")
    if "scale" in sections:  # last: its 10,000-step run is the longest
        sizes = [n for n in (100, 1_000, 10_000) if not cap or n <= cap]
        section_scale(bench, sizes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
