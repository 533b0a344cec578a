"""Memory over a long life: the RSS of a web process serving websockets under a compressed
day of churn, and of a worker that runs 100,000 steps.

    make bench-memory                  # PostgreSQL + Redis, the production shape
    BENCH_WEB_MINUTES=2 BENCH_WORKER_STEPS=20000 .venv/bin/python bench/memory.py   # quick
    .venv/bin/python bench/memory.py --only worker          # or --only web

DATABASE_URL (default postgres://postgres@127.0.0.1:5432/bench_memory, created if missing) and
BENCH_REDIS_URL (default redis://127.0.0.1:6379/6: the channel layer and the workers' broker,
set as REDIS_URL for every process it starts; the bench EMPTIES that Redis database first, so
it never takes REDIS_URL from the environment) are passed to every process it starts.

1. Web: a real daphne (as `make run` starts it) and a `qcluster` running `bench.chain` tasks
   that emit events. For BENCH_WEB_MINUTES (default 10) BENCH_WEB_CLIENTS (default 16)
   clients open task pages' and the list's websockets, read the live messages (state,
   events, fragments), drop the connection abruptly or close it, reconnect with
   `?resume_from=<last seq>` or send `{"resume_from": N}`, and load pages over HTTP between
   visits. daphne's RSS is sampled after BENCH_WEB_WARMUP seconds of churn (default 60),
   every BENCH_SAMPLE_SECONDS (default 30) and at the end.
2. Worker: one `qcluster` with one worker runs BENCH_WORKER_STEPS (default 100,000) steps of
   `bench.chain` tasks of BENCH_WORKER_TASK_STEPS (default 10,000) steps, first as in
   production (isolated: time slices in an executor the worker forks and reuses, up to
   ORCH_EXECUTOR_MAX_RUNS slices each), then with
   ORCH_ISOLATE_EXECUTION=false (the worker process itself runs every step, so nothing is
   reset between tasks). RSS of the qcluster parent, the worker and the executor after the
   first 1,000 steps, every 10,000 steps and at the end. BENCH_WORKER_MODES picks modes.

RSS is VmRSS from /proc (psutil if installed). BENCH_TRACEMALLOC=1 runs daphne and the
qcluster under tracemalloc (bench/_traced.py) and prints the allocation sites that grew most
between the start and the end sample (slower; for a leak hunt, not for the figures).
Prints figures, asserts nothing.
"""
import argparse
import asyncio
import json
import math
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.measure import stop_process_groups  # noqa: E402

DEFAULT_DATABASE_URL = "postgres://postgres@127.0.0.1:5432/bench_memory"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/6"
SECTIONS = ("web", "worker")
TRACE = os.environ.get("BENCH_TRACEMALLOC", "").lower() in ("1", "true", "yes", "on")


def env_num(name: str, default, kind=int):
    value = os.environ.get(name, "").strip()
    return kind(value) if value else default


# --- processes and their memory ------------------------------------------------------------

def rss_kib(pid: int) -> int:
    """The resident set size of `pid` now, in KiB (0 once it is gone)."""
    try:
        import psutil

        try:
            return psutil.Process(pid).memory_info().rss // 1024
        except psutil.Error:
            return 0
    except ImportError:
        pass
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def children(pid: int) -> list[int]:
    """The direct children of `pid`, oldest first."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(entry))
    return sorted(found)


def cpu_ticks(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except OSError:
        return 0


def mib(kib: float) -> str:
    return f"{kib / 1024:.1f}"


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs (0 with fewer than two distinct xs)."""
    if len(xs) < 2:
        return 0.0
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Programs:
    """Child programs, each in its own process group (as `make run` starts them)."""

    def __init__(self, logs: Path):
        self.logs, self.procs = logs, {}
        self.trace_dir = Path(tempfile.mkdtemp(prefix="bench-memory-trace-")) if TRACE else None

    def start(self, name: str, argv: list[str], **env: str) -> subprocess.Popen:
        full_env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", **env}
        if self.trace_dir is not None:
            full_env["BENCH_TRACEMALLOC_DIR"] = str(self.trace_dir)
            argv = [sys.executable, str(ROOT / "bench" / "_traced.py"), *argv[1:]]
        log = open(self.logs / f"{name}.log", "w")
        self.procs[name] = subprocess.Popen(argv, cwd=ROOT, env=full_env, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        return self.procs[name]

    def check(self):
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}; see {self.logs / (name + '.log')}")

    def stop(self):
        stop_process_groups(self.procs.values())
        self.procs = {}

    # tracemalloc (BENCH_TRACEMALLOC=1)
    def snapshot(self, pids: list[int]) -> dict[int, Path]:
        """Ask `pids` for a tracemalloc snapshot; {pid: file} once written."""
        if self.trace_dir is None:
            return {}
        before = {p: set(self.trace_dir.glob(f"{p}-*.snap")) for p in pids}
        for pid in pids:
            try:
                os.kill(pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        found, deadline = {}, time.monotonic() + 120
        while len(found) < len(pids) and time.monotonic() < deadline:
            for pid in pids:
                new = set(self.trace_dir.glob(f"{pid}-*.snap")) - before[pid]
                if new and pid not in found:
                    found[pid] = max(new)
            time.sleep(0.2)
        return found


def print_trace_diff(label: str, first: Path | None, last: Path | None, top: int = 15) -> None:
    import tracemalloc

    if not first or not last:
        print(f"  tracemalloc ({label}): no snapshots")
        return
    old, new = tracemalloc.Snapshot.load(str(first)), tracemalloc.Snapshot.load(str(last))
    ignore = [tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, "<frozen importlib._bootstrap>")]
    old, new = old.filter_traces(ignore), new.filter_traces(ignore)
    total = sum(s.size for s in new.statistics("filename")) - sum(s.size for s in old.statistics("filename"))
    print(f"  tracemalloc ({label}): traced memory {total / 1024:+.0f} KiB between the samples; grew most:")
    for stat in new.compare_to(old, "traceback")[:top]:
        if stat.size_diff <= 0:
            break
        frames = [f"{Path(f.filename).name}:{f.lineno}" for f in stat.traceback[-6:]]
        print(f"    {stat.size_diff / 1024:+8.1f} KiB {stat.count_diff:+7d} blocks  {' <- '.join(reversed(frames))}")


# --- Django in this process -------------------------------------------------------------------

def bench_user_session() -> str:
    """A superuser's session key (the websockets and pages authenticate with its cookie)."""
    from django.contrib.auth import get_user_model
    from django.test import Client

    User = get_user_model()
    user = User.objects.filter(username="bench").first() or User.objects.create_superuser("bench", "b@x.org", "pw")
    client = Client()
    client.force_login(user)
    return client.cookies["sessionid"].value


def end_leftovers() -> None:
    """Tasks left running by an earlier run would take the workers' time: end them."""
    from orchestrator.engine import services
    from orchestrator.engine.states import TERMINAL
    from orchestrator.models import Task

    for task_id in Task.objects.exclude(status__in=TERMINAL).values_list("pk", flat=True):
        services.task_terminate(task_id=task_id, reason="bench: left over from an earlier run")


def create_chain(steps: int, sleep_ms: int = 0) -> int:
    from orchestrator.engine import services

    return services.task_create(type="bench.chain", params={"steps": steps, "sleep_ms": sleep_ms},
                                limits={"max_subtasks": 1}).pk


def wait_port(port: int, programs: Programs, timeout: float = 60) -> None:
    timeout *= 4 if TRACE else 1
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        programs.check()
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"nothing listens on port {port}")


# --- 1. the web process -----------------------------------------------------------------------

class Churn:
    """Counters of what the clients did, and the task ids they visit."""

    def __init__(self):
        self.connections = self.refused = self.errors = self.messages = self.fragments = 0
        self.resumes = self.aborted = self.pages = self.page_errors = 0
        self.error_kinds: dict[str, int] = {}
        self.base_fragments = 0
        self.running: list[int] = []
        self.finished: list[int] = []
        self.lock = threading.Lock()

    def pick_task(self) -> int | None:
        with self.lock:
            pool = self.running if self.running and (random.random() < 0.75 or not self.finished) else self.finished
            return random.choice(pool) if pool else None


def feed_tasks(churn: Churn, stop: threading.Event, running: int, steps: int, sleep_ms: int) -> None:
    """Keep `running` tasks running (each emits an event per step), replacing finished ones."""
    from django.db import close_old_connections

    from orchestrator.engine.states import TERMINAL
    from orchestrator.models import Task

    while not stop.is_set():
        close_old_connections()
        try:
            with churn.lock:
                ids = list(churn.running)
            done = set(Task.objects.filter(pk__in=ids, status__in=TERMINAL).values_list("pk", flat=True))
            fresh = [create_chain(steps, sleep_ms) for _ in range(running - (len(ids) - len(done)))]
            with churn.lock:
                churn.running = [i for i in ids if i not in done] + fresh
                churn.finished = (churn.finished + sorted(done))[-50:]
        except Exception as exc:  # a blip: the next round catches up
            print(f"  (feeder: {exc!r})", file=sys.stderr)
        stop.wait(1.0)


async def client_loop(churn: Churn, port: int, cookie: str, until: float, hold: tuple[float, float]) -> None:
    import websockets

    origin = f"http://127.0.0.1:{port}"
    headers = {"Cookie": f"sessionid={cookie}"}

    def load_page(path: str) -> None:
        request = urllib.request.Request(origin + path, headers=headers)
        with urllib.request.urlopen(request, timeout=60) as response:
            response.read()

    while time.monotonic() < until:
        task_id = churn.pick_task()
        on_list = task_id is None or random.random() < 0.3
        path = "/ws/tasks/" if on_list else f"/ws/tasks/{task_id}/"
        query, first_message = "", None
        if not on_list and random.random() < 0.3:  # a page that saw some events reconnects
            query = f"?resume_from={random.randint(0, 5)}"
        elif not on_list and random.random() < 0.2:
            first_message = {"resume_from": 0}
        visit_end = time.monotonic() + random.uniform(*hold)
        while time.monotonic() < min(visit_end, until):
            last_seq = None
            try:
                async with websockets.connect(f"ws://127.0.0.1:{port}{path}{query}", origin=origin,
                                              additional_headers=headers, open_timeout=60, max_size=None,
                                              ping_interval=None) as ws:
                    churn.connections += 1
                    if query:
                        churn.resumes += 1
                    if first_message is not None:
                        await ws.send(json.dumps(first_message))
                        churn.resumes += 1
                        first_message = None
                    # A network blip now and then: the page drops and reconnects with its last seq.
                    blip_at = time.monotonic() + random.uniform(0.5, 8) if random.random() < 0.4 else math.inf
                    stop_at = min(visit_end, until, blip_at)
                    while (left := stop_at - time.monotonic()) > 0:
                        try:
                            raw = await asyncio.wait_for(ws.recv(), timeout=left)
                        except asyncio.TimeoutError:
                            break
                        churn.messages += 1
                        message = json.loads(raw)
                        if message.get("type") == "event":
                            last_seq = message["seq"]
                        elif message.get("type") == "state" and "seq" in message and last_seq is None:
                            last_seq = message["seq"]
                        if message.get("fragments"):
                            churn.fragments += 1
                    if random.random() < 0.5 or stop_at == blip_at:
                        churn.aborted += 1
                        ws.transport.abort()  # gone without a close frame: a tab closed, a network cut
            except websockets.exceptions.InvalidStatus:
                churn.refused += 1
                break
            except (OSError, asyncio.TimeoutError, websockets.exceptions.WebSocketException) as exc:
                churn.errors += 1
                churn.error_kinds[type(exc).__name__] = churn.error_kinds.get(type(exc).__name__, 0) + 1
                await asyncio.sleep(0.5)
            if on_list or last_seq is None:
                break
            query = f"?resume_from={last_seq}"
        # Between visits: an ordinary page load now and then (the list, a task page).
        if random.random() < 0.4:
            page = "/" if task_id is None or random.random() < 0.4 else f"/tasks/{task_id}/"
            try:
                await asyncio.to_thread(load_page, page)
                churn.pages += 1
            except Exception:
                churn.page_errors += 1
        await asyncio.sleep(random.uniform(0, 1.5))


def section_web() -> None:
    from django.db import close_old_connections

    minutes = env_num("BENCH_WEB_MINUTES", 10.0, float)
    clients = env_num("BENCH_WEB_CLIENTS", 16)
    warmup = env_num("BENCH_WEB_WARMUP", min(60.0, minutes * 60 / 5), float)
    every = env_num("BENCH_SAMPLE_SECONDS", min(30.0, max(5.0, minutes * 60 / 10)), float)
    n_tasks = env_num("BENCH_WEB_TASKS", 3)
    task_steps, step_ms = env_num("BENCH_WEB_TASK_STEPS", 150), env_num("BENCH_WEB_STEP_MS", 300)
    hold = (1.0, env_num("BENCH_WEB_HOLD_SECONDS", 10.0, float))
    print(f"\n== Web: one daphne, {minutes:g} min of churn after {warmup:g} s of warm-up; {clients} websocket clients; "
          f"{n_tasks} bench.chain tasks running at a time ({task_steps} steps of {step_ms} ms, an event each) "
          "on one qcluster ==")
    end_leftovers()
    cookie = bench_user_session()
    logs = Path(tempfile.mkdtemp(prefix="bench-memory-web-"))
    programs = Programs(logs)
    port = free_port()
    web = programs.start("web", [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port),
                                 "orchestrator.asgi:application"], PORT=str(port))
    programs.start("workers", [sys.executable, str(ROOT / "manage.py"), "qcluster"])
    churn = Churn()
    stop = threading.Event()
    feeder = threading.Thread(target=feed_tasks, args=(churn, stop, n_tasks, task_steps, step_ms), daemon=True)
    samples: list[tuple[float, int, int, int, int]] = []  # (seconds since start sample, connections, messages, pages, KiB)
    snaps: list[dict] = []
    try:
        wait_port(port, programs)
        feeder.start()
        booted = rss_kib(web.pid)
        began = time.monotonic()
        start_at, until = began + warmup, began + warmup + minutes * 60

        def sampler():
            next_at = start_at
            while True:
                now = time.monotonic()
                if now >= next_at or now >= until:
                    if not samples:
                        snaps.append(programs.snapshot([web.pid]))
                        churn.base_fragments = churn.fragments
                    samples.append((now - start_at, churn.connections, churn.messages, churn.pages, rss_kib(web.pid)))
                    if now >= until:
                        snaps.append(programs.snapshot([web.pid]))
                        return
                    next_at += every
                time.sleep(min(0.5, max(0.0, min(next_at, until) - time.monotonic())))

        sampling = threading.Thread(target=sampler, daemon=True)
        sampling.start()

        async def run_clients():
            await asyncio.gather(*(client_loop(churn, port, cookie, until, hold) for _ in range(clients)))

        asyncio.run(run_clients())
        sampling.join()
        programs.check()
    finally:
        programs.stop()  # first: nothing this started may outlive a failed run
        stop.set()
        if feeder.is_alive():
            feeder.join(timeout=10)
        close_old_connections()
    base_t, base_c, base_m, base_p, base_rss = samples[0]
    print(f"  daphne RSS after start-up {mib(booted)} MiB; after warm-up {mib(base_rss)} MiB "
          f"({base_c} connections, {base_m} messages so far)")
    print(f"  {'minute':>7} {'connections':>12} {'messages':>10} {'page loads':>11} {'RSS MiB':>8}")
    for t, c, m, p, r in samples:
        print(f"  {t / 60:7.1f} {c - base_c:12d} {m - base_m:10d} {p - base_p:11d} {mib(r):>8}")
    end_t, end_c, end_m, end_p, end_rss = samples[-1]
    conns, msgs, pages = end_c - base_c, end_m - base_m, end_p - base_p
    rss = [s[4] for s in samples]
    per_hour = slope([s[0] / 3600 for s in samples], rss) / 1024
    per_10k = slope([s[1] for s in samples], rss) * 10_000 / 1024
    half = samples[len(samples) // 2:]
    late = slope([s[0] / 3600 for s in half], [s[4] for s in half]) / 1024
    print(f"  RSS start {mib(base_rss)} MiB, end {mib(end_rss)} MiB ({(end_rss - base_rss) / 1024:+.1f} MiB), "
          f"max {mib(max(rss))} MiB; slope {per_hour:+.1f} MiB per hour of this run (second half {late:+.1f}), "
          f"{per_10k:+.2f} MiB per 10,000 connections")
    seconds = max(end_t, 1.0)
    print(f"  served in {end_t / 60:.1f} min: {conns} websocket connections ({conns / seconds:.1f}/s; {churn.resumes} "
          f"with resume_from, {churn.aborted} dropped without a close), {msgs} messages ({churn.fragments - churn.base_fragments} with "
          f"fragments), {pages} page loads; refused {churn.refused}, connection errors {churn.errors}, "
          f"page errors {churn.page_errors} (warm-up excluded)"
          + (f"; errors by kind (warm-up included): {churn.error_kinds}" if churn.error_kinds else ""))
    # An operator with a task page open reconnects after every network change, sleep or deploy,
    # and opens pages as they work: ~30 connections an hour, 8 hours a day.
    print(f"  ≈ a working day (8 h, ~30 page connections an hour) of {conns / 240:.0f} operators, compressed "
          f"into {end_t / 60:.0f} min")
    if TRACE and len(snaps) == 2:
        print_trace_diff("daphne", snaps[0].get(web.pid), snaps[1].get(web.pid))
    print(f"  (logs: {logs})")


# --- 2. the worker ----------------------------------------------------------------------------

class Tree:
    """The qcluster's processes: the parent (manage.py qcluster), its sentinel, the worker (of
    the sentinel's children, the one running tasks), and the worker's executor, if any."""

    def __init__(self, root: int):
        self.root = root

    def roles(self) -> dict[str, int | None]:
        sentinel = next(iter(children(self.root)), None)
        pool = children(sentinel) if sentinel else []
        worker = None
        for pid in pool:  # the watchdog of an isolated executor
            if children(pid):
                worker = pid
        if worker is None and pool:  # else the busiest (in-process, it runs every step)
            worker = max(pool, key=cpu_ticks)
        executor = next(iter(children(worker)), None) if worker else None
        return {"parent": self.root, "sentinel": sentinel, "worker": worker, "executor": executor}

    def everything(self) -> list[int]:
        pids, todo = [], [self.root]
        while todo:
            pid = todo.pop()
            pids.append(pid)
            todo.extend(children(pid))
        return pids


def worker_mode(mode: str, total: int, per_task: int) -> None:
    from django.db import close_old_connections
    from django.db.models import Sum

    from orchestrator.engine.states import TERMINAL
    from orchestrator.models import Task

    isolated = mode == "isolated"
    end_leftovers()
    logs = Path(tempfile.mkdtemp(prefix=f"bench-memory-worker-{mode}-"))
    programs = Programs(logs)
    sizes = [per_task] * (total // per_task) + ([total % per_task] if total % per_task else [])
    ids = [create_chain(n) for n in sizes]
    started = time.monotonic()
    cluster = programs.start("workers", [sys.executable, str(ROOT / "manage.py"), "qcluster"], ORCH_WORKERS="1",
                             ORCH_ISOLATE_EXECUTION="true" if isolated else "false")
    tree = Tree(cluster.pid)
    print(f"\n  -- {mode}: {len(ids)} tasks of {per_task:,} steps, one qcluster with one worker "
          + ("(time slices in an executor the worker reuses, as in production)" if isolated else
             "(ORCH_ISOLATE_EXECUTION=false: the worker process runs every step itself)"))
    print(f"  {'steps':>8} {'s':>6} {'parent':>7} {'sentinel':>8} {'worker':>7} {'executor':>8} {'all':>7}  (RSS MiB)")
    rows, snaps = [], []
    marks = [1_000] + list(range(10_000, total, 10_000)) + [total]
    try:
        for mark in marks:
            while True:
                programs.check()
                done = Task.objects.filter(pk__in=ids).aggregate(n=Sum("steps_done"))["n"] or 0
                unfinished = Task.objects.filter(pk__in=ids).exclude(status__in=TERMINAL).exists()
                if (done >= mark and (mark < total or not unfinished)) or not unfinished:
                    break
                time.sleep(0.25)
            roles = tree.roles()
            if isolated and mark == total:
                roles["executor"] = None  # the last one has exited
            kib = {role: rss_kib(pid) if pid else 0 for role, pid in roles.items()}
            kib["all"] = sum(rss_kib(p) for p in tree.everything())
            if not rows or mark == total:
                pids = [p for p in (roles["parent"], roles["worker"]) if p]
                snaps.append(programs.snapshot(pids))
                snaps[-1]["roles"] = dict(roles)
            rows.append((done, time.monotonic() - started, kib))
            print(f"  {done:8,d} {time.monotonic() - started:6.0f} {mib(kib['parent']):>7} {mib(kib['sentinel']):>8} "
                  f"{mib(kib['worker']):>7} {mib(kib['executor']) if kib['executor'] else '-':>8} {mib(kib['all']):>7}")
            close_old_connections()
        statuses = dict(Task.objects.filter(pk__in=ids).values_list("pk", "status"))
    finally:
        programs.stop()
    first, last = rows[0][2], rows[-1][2]
    growth = ", ".join(f"{role} {(last[role] - first[role]) / 1024:+.1f} MiB" for role in ("parent", "sentinel", "worker"))
    executors = [r[2]["executor"] for r in rows if r[2]["executor"]]
    steps_run = rows[-1][0] - rows[0][0]
    worker_slope = slope([r[0] for r in rows], [r[2]["worker"] for r in rows]) * 10_000 / 1024
    print(f"  growth from {rows[0][0]:,} to {rows[-1][0]:,} steps: {growth} (worker slope {worker_slope:+.2f} MiB "
          f"per 10,000 steps)" + (f"; executors (sampled while a task runs) {mib(min(executors))}–{mib(max(executors))} MiB"
                                   if isolated and executors else ""))
    not_completed = [s for s in statuses.values() if s != "completed"]
    print(f"  {rows[-1][0]:,} steps in {rows[-1][1]:.0f} s ({1000 * rows[-1][1] / max(rows[-1][0], 1):.2f} ms/step "
          f"incl. start-up); tasks not completed: {len(not_completed)}" + (f" {not_completed}" if not_completed else ""))
    if TRACE and len(snaps) == 2:
        for role in ("worker", "parent"):
            a, b = snaps[0]["roles"][role], snaps[1]["roles"][role]
            if a and a == b:
                print_trace_diff(f"{mode} {role}", snaps[0].get(a), snaps[1].get(b))
    print(f"  (logs: {logs}; {steps_run:,} steps between the first and the last sample)")


def section_worker() -> None:
    total = env_num("BENCH_WORKER_STEPS", 100_000)
    per_task = min(env_num("BENCH_WORKER_TASK_STEPS", 10_000), total)
    modes = [m.strip() for m in os.environ.get("BENCH_WORKER_MODES", "isolated,inprocess").split(",") if m.strip()]
    print(f"\n== Worker: {total:,} steps of bench.chain (pure steps) per mode; modes: {', '.join(modes)} ==")
    for mode in modes:
        if mode not in ("isolated", "inprocess"):
            raise SystemExit(f"unknown BENCH_WORKER_MODES entry {mode!r}: isolated, inprocess")
        worker_mode(mode, total, per_task)


# --- main -------------------------------------------------------------------------------------

def main(argv=None) -> int:
    # A SIGTERM (a timeout, Ctrl-C's cousin) unwinds like an exception, so the programs stop too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default=os.environ.get("BENCH_ONLY", ""), help="web, worker (comma-separated)")
    args = parser.parse_args(argv)
    sections = [s.strip() for s in args.only.split(",") if s.strip()] or list(SECTIONS)
    for name in sections:
        if name not in SECTIONS:
            parser.error(f"unknown section {name!r}; sections: {', '.join(SECTIONS)}")
    os.environ.setdefault("DATABASE_URL", DEFAULT_DATABASE_URL)
    os.environ["REDIS_URL"] = os.environ.get("BENCH_REDIS_URL", DEFAULT_REDIS_URL)
    # Production-like (and the same for every process this starts: sessions are shared).
    os.environ.setdefault("DEBUG", "false")
    os.environ.setdefault("SECRET_KEY", secrets.token_urlsafe(50))
    os.environ.setdefault("ORCH_EXTRA_TASK_TYPES", "bench.benchtypes")
    os.environ.setdefault("ORCH_LOG_LEVEL", "WARNING")
    if os.environ["DATABASE_URL"].startswith(("postgres://", "postgresql://")):
        from bench.measure import PgServer

        PgServer(os.environ["DATABASE_URL"]).ensure_database(PgServer(os.environ["DATABASE_URL"]).database)
    import redis

    redis.Redis.from_url(os.environ["REDIS_URL"]).flushdb()  # an earlier run's broker messages and groups
    from bench._django import database_label, setup

    setup("memory-bench")
    from django.conf import settings

    print(f"database: {database_label()}; channel layer and broker: Redis {os.environ['REDIS_URL']}; "
          f"DEBUG={settings.DEBUG}; {os.cpu_count()} CPUs; RSS from "
          f"{'psutil' if _has_psutil() else '/proc/<pid>/status VmRSS'}"
          + ("; tracemalloc ON (slower, RSS includes its overhead)" if TRACE else ""))
    if "web" in sections:
        section_web()
    if "worker" in sections:
        section_worker()
    return 0


def _has_psutil() -> bool:
    try:
        import psutil  # noqa: F401
        return True
    except ImportError:
        return False


if __name__ == "__main__":
    sys.exit(main())
