"""Soak: many tasks on real worker clusters while faults rain down; then check that no effect
was lost or duplicated, no process was left behind and no task is stuck.

    .venv/bin/python bench/soak.py --short                      # >= 20 faults, ~1-2 minutes
    .venv/bin/python bench/soak.py --faults 1000 --duration 1020 # the long run (~20 minutes)

Everything it breaks is its own: a private PostgreSQL cluster (initdb/pg_ctl on a free port,
tests/support/services.py), a private Redis broker (REDIS_URL for the workers: django-q2's
Redis broker), an SMTP server (tests/support/misbehaving.py) and an HTTP upstream (SoakUpstream),
both running in this process. Against them run `--clusters` real `manage.py qcluster`
processes (ORCH_WORKERS each) and a real sweeper (`manage.py recover --loop`). Mixed
demo.migrate_rows / demo.notify / demo.pipeline / soak.post tasks are created as earlier ones
finish. soak.post (bench/soak_types.py, loaded with ORCH_EXTRA_TASK_TYPES) POSTs to the
upstream through the WAL, one POST a step, each step with StepSpec(timeout=3 s); 30 % of them
are keyed (an Idempotency-Key and a status_url the tool's probe asks), the rest plain
non-idempotent POSTs. The upstream records each POST it acts on by its reference
(X-Soak-Ref: t<task>:<step>) and, keyed, acts once per key.

Faults (kind: what is done):
- kill_executor: kill -9 of a running task's executor (Task.worker_pid);
- kill_worker: kill -9 of the django-q2 worker process watching a running task's executor;
- kill_cluster: kill -9 of a whole `qcluster` process group, restarted after a moment;
- stop_cluster: an orderly stop (SIGINT to the group, as Ctrl-C) while it runs tasks; each
  watchdog must kill its executor tree and hand its task back; whatever of that cluster is
  still alive once it exited counts as stray; restarted after a moment;
- kill_executor_mid_send: the SMTP server takes the next message and holds its reply while
  the sending task's executor is killed (the email arrived; nobody heard the 250);
- kill_executor_before_data: the server holds its answer to the next RCPT TO while the
  sender's executor is killed (the intent is written, nothing was sent);
- smtp_drop_after_data / smtp_reply_late: the next message is taken and the connection
  dropped before the reply / answered after EMAIL_TIMEOUT (each SMTP fault is counted when
  it fires);
- stop_mid_send / force_mid_send: the SMTP server takes the next message and holds its reply
  while the soak asks an operator's Stop / Force-terminate of the sending task through the
  services the dashboard's buttons call (services.task_stop / task_terminate, as a user of the
  operator group); counted when the request reached a task a worker was running;
- stop_mid_post / force_mid_post: the same with the upstream holding its answer to a POST
  (8 s) after acting on it;
- upstream_502_after_acting: the upstream acts on the next POST, then answers 502 (an outcome
  unknown: review for a plain POST, a replay with the same key for a keyed one);
- step_timeout: the upstream acts on the next POST and holds its answer past the step's
  timeout (6 s): the timeout cancels the step with the POST in flight;
  (the upstream's faults are counted when they fire; a POST meets at most one fault;)
- broker_purge: the waiting messages of the Redis list `django_q:orchestrator:q` are deleted
  (counted only when it removed some);
- redis_restart: kill -9 + restart of the private Redis (every few minutes; >= 1);
- pg_restart: `pg_ctl stop -m immediate` + start of the private PostgreSQL (every few
  minutes; >= 1).
Each kind happens at least once: the fault phase goes on, within its time budget (the asked
duration + half of it, at most + 120 s), until every kind has been counted.
Every process this script starts carries SOAK_RUN_ID in its environment; nothing without it
is ever signalled. A Force-terminate's executor tree is watched like a kill -9's (stray after
KILL_STRAY_SECONDS), counted from when the database was last reachable: the request reaches
the worker through the task's control column, so a pg_restart right after it delays the kill
until the database is back. Only a task running under a lease has its tree watched (a queued
task's worker_pid names an executor that may since run another task). The settle phase also
waits for the open review items to be decided.

A scripted reviewer decides each open review item from the SMTP server's log: the message
with that X-Idempotency-Key was received -> "happened", else "not_happened"; for an
http.request, from the upstream's: it acted on that reference -> "happened", else
"not_happened". Items of ended (stopped, terminated) tasks too: there the decision records
what happened and runs nothing. Its users have no email address (the review.opened
notifications would go to the soak's SMTP server); an email without an X-Idempotency-Key
meets no fault and is not counted.

At the end (faults stopped, everything settled or the settle timeout passed, workers shut
down) it prints faults by kind, tasks by final status, review decisions and the invariants,
each of which must be 0:
- lost: notify recipients who got no email, migrate tasks whose destination rows are
  missing or wrong, pipeline tasks without their final output, soak.post steps whose POST
  the upstream never acted on, tasks not completed — except the tasks the soak's own Stop /
  Force-terminate ended (stopped/terminated: nothing of them is owed; reported by kind);
- duplicated: extra copies of a message (by X-Idempotency-Key and by (task, recipient)) and
  POSTs the upstream acted on twice (by reference), minus copies a reviewer's not_happened
  explains (one that arrived before the decision); ended tasks' effects count too;
- stray: processes of this run still alive after shutdown (by environment marker, by
  `pgrep -f` for pipeline stage scripts, and by process tree: this script is a child
  subreaper, so orphans are re-parented to it), processes of a cluster still alive once
  its orderly stop (stop_cluster) is over, and processes of a killed executor, worker or
  cluster (its process tree just before the kill) still alive KILL_STRAY_SECONDS after it;
- stuck: tasks not in a final state;
- unreviewed (unknown effects): WAL rows whose outcome nobody knows and nobody recorded — still
  `pending` once every task has ended, without a decided review item; or marked `failed`
  (did not happen) on an outcome the tool reported unknown, on an ended task, with neither a
  reviewer's decision nor a probe behind it.
It also prints the tasks the soak stopped / terminated by fault kind, review decisions by tool,
outcomes in doubt its probes settled, and the step timeouts in the workers' logs.
Exit status 1 if any invariant is not 0.

Options (also as environment variables): --faults (SOAK_FAULTS), --tasks (SOAK_TASKS, the
most to create; default: as many as the fault phase needs), --duration (SOAK_DURATION,
seconds of the fault phase), --seed (SOAK_SEED), --settle-timeout, --concurrency, --clusters,
--workers, --json PATH (the summary as JSON), --keep (keep the run directory with the logs).
SOAK_LOG_LEVEL sets the workers' ORCH_LOG_LEVEL (default WARNING; logs in the run directory).

The workers run with a 0.5 s heartbeat (stale after 2 s), ORCH_REQUEUE_AFTER_SECONDS=3,
slices of 1.5 s (so re-enqueued tasks meet lost messages too), EMAIL_TIMEOUT=1 s and
ORCH_MAX_RECOVERY_ATTEMPTS=100000: at about one fault a second a task is recovered many
times, and running out of attempts (needs_human) would be the configured limit, not a bug
(SOAK_MAX_RECOVERY_ATTEMPTS=3 shows what the default does).
"""
import argparse
import asyncio
import collections
import datetime
import json
import os
import queue
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import uuid
from decimal import Decimal
from email import message_from_bytes
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support.misbehaving import SmtpServer  # noqa: E402
from tests.support.services import PostgresCluster, RedisServer  # noqa: E402

BURST_FOR_PURGE = 8
QUEUE_KEY = "django_q:orchestrator:q"
MIGRATE_RATE = 2.0  # one rate for every migrate task: they all write demo_destination
EMAIL_TIMEOUT = 1.0
LATE_SECONDS = 2.5
RANDOM_KINDS = {  # weights of the randomly chosen faults; the restarts are scheduled
    "kill_executor": 24, "kill_executor_mid_send": 8, "kill_executor_before_data": 7, "kill_worker": 10,
    "kill_cluster": 5, "stop_cluster": 3, "smtp_drop_after_data": 14, "smtp_reply_late": 11, "broker_purge": 21,
    "stop_mid_send": 5, "force_mid_send": 5, "stop_mid_post": 5, "force_mid_post": 5,
    "upstream_502_after_acting": 9, "step_timeout": 7,
}
# Faults armed on the SMTP server: counted when they fire on a message (the SMTP server's mode),
# or, for the operator's Stop/Force of the sending task, when the request reached a running task.
SMTP_MODES = {"smtp_drop_after_data": "drop_after_data", "smtp_reply_late": "reply_late",
              "kill_executor_mid_send": "kill_mid_send", "kill_executor_before_data": "kill_before_data",
              "stop_mid_send": "stop_mid_send", "force_mid_send": "force_mid_send"}
# Faults armed on the HTTP upstream, counted the same way.
UPSTREAM_MODES = {"upstream_502_after_acting": "502_after_acting", "step_timeout": "hold_past_timeout",
                  "stop_mid_post": "stop_mid_post", "force_mid_post": "force_mid_post"}
OPERATOR_KINDS = ("stop_mid_send", "force_mid_send", "stop_mid_post", "force_mid_post")  # Stop / Force-terminate
STEP_TIMEOUT_SECONDS = 3.0  # soak.post's StepSpec(timeout=...) (bench/soak_types.py)
HOLD_FOR_OPERATOR_SECONDS = 8.0  # the upstream holds its answer while Stop/Force arrives (< the POST's timeout)
SCHEDULED_KINDS = ("pg_restart", "redis_restart")
NOTHING_TO_ACT_ON_SECONDS = 2.0  # a fault with nothing to act on (no running task...) is tried again that long
KILL_STRAY_SECONDS = 3.0  # what a kill -9 left of its victim's tree must be gone by then
ALL_KINDS = (*RANDOM_KINDS, *SCHEDULED_KINDS)
INVARIANTS = ("lost", "duplicated", "stray", "stuck", "unreviewed")


def log(message: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --- processes -----------------------------------------------------------------------------
def read_proc(pid: int, name: str) -> bytes:
    try:
        with open(f"/proc/{pid}/{name}", "rb") as f:
            return f.read()
    except OSError:
        return b""


def proc_stat(pid: int):
    """(ppid, state) or None."""
    data = read_proc(pid, "stat").decode(errors="replace")
    if not data:
        return None
    fields = data[data.rindex(")") + 2:].split()
    return int(fields[1]), fields[0]


def all_pids() -> list[int]:
    return [int(e) for e in os.listdir("/proc") if e.isdigit()]


class Marker:
    """SOAK_RUN_ID=<id> in a process's environment: it belongs to this run."""

    def __init__(self):
        self.value = uuid.uuid4().hex
        self.needle = f"SOAK_RUN_ID={self.value}".encode()

    def on(self, pid: int) -> bool:
        return self.needle in read_proc(pid, "environ").split(b"\0")

    def living(self) -> list[int]:
        me = os.getpid()
        return [p for p in all_pids() if p != me and self.on(p) and (proc_stat(p) or (0, "Z"))[1] != "Z"]


def children_of(pid: int) -> list[int]:
    return [p for p in all_pids() if (proc_stat(p) or (None,))[0] == pid]


def start_time(pid: int) -> str | None:
    """When a living process started (clock ticks after boot): tells it from a reused pid."""
    data = read_proc(pid, "stat").decode(errors="replace")
    if not data:
        return None
    fields = data[data.rindex(")") + 2:].split()
    return None if fields[0] == "Z" else fields[19]


def tree_of(root: int) -> dict[int, str]:
    """`root` and its living descendants: pid -> start time."""
    children: dict[int, list[int]] = {}
    for pid in all_pids():
        stat = proc_stat(pid)
        if stat:
            children.setdefault(stat[0], []).append(pid)
    tree, frontier = {}, [root]
    while frontier:
        pid = frontier.pop()
        started = start_time(pid)
        if started:
            tree[pid] = started
        frontier.extend(children.get(pid, []))
    return tree


class Managed:
    """A `manage.py <command>` of this run, in its own process group."""

    def __init__(self, name: str, args: list[str], env: dict, log_dir: Path):
        self.name, self.args, self.env, self.log_dir = name, args, env, log_dir
        self.starts = 0
        self.start()

    def start(self) -> None:
        self.starts += 1
        self.tag = f"{self.name}.{self.starts}"  # SOAK_PROC: every process of this start has it
        self.log = open(self.log_dir / f"{self.tag}.log", "w")
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "manage.py"), *self.args], cwd=ROOT,
                                     env={**self.env, "SOAK_PROC": self.tag}, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def descendants_alive(self) -> list[int]:
        """Living processes of this start, wherever they were re-parented."""
        needle = f"SOAK_PROC={self.tag}".encode()
        return [p for p in all_pids() if needle in read_proc(p, "environ").split(b"\0")
                and (proc_stat(p) or (0, "Z"))[1] != "Z"]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal_group(self, signum: int) -> None:
        try:
            os.killpg(self.proc.pid, signum)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        self.signal_group(signal.SIGKILL)
        self.proc.wait(timeout=30)
        self.log.close()

    def workers(self) -> list[int]:
        """The cluster's processes below its sentinel (workers, monitor, pusher)."""
        return [p for sentinel in children_of(self.proc.pid) for p in children_of(sentinel)]


# --- the SMTP server -----------------------------------------------------------------------
class ArmedModes:
    """Faults queued for a server's next requests (`arm(mode)`: the next one that mode can
    apply to misbehaves that way, once); the server has `lock` and `armed` (a deque)."""

    def arm(self, mode: str) -> None:
        with self.lock:
            self.armed.append(mode)

    def disarm(self) -> int:
        with self.lock:
            pending = len(self.armed)
            self.armed.clear()
            return pending

    def pending(self) -> int:
        with self.lock:
            return len(self.armed)


class SoakSmtp(ArmedModes, SmtpServer):
    """The misbehaving server, its mode switched per message: `arm(mode)` makes the next
    message misbehave that way once. Keeps a log of (time, key, to) for every message taken."""

    DATA_MODES = ("drop_after_data", "reply_late", "kill_mid_send", "stop_mid_send", "force_mid_send")
    RCPT_MODES = ("kill_before_data",)

    def __init__(self, port: int, on_fired):
        super().__init__(port)
        self.late_seconds = LATE_SECONDS
        self.armed: collections.deque = collections.deque()
        self.on_fired = on_fired
        self.log: list[tuple[float, str, str]] = []
        self.untracked = 0  # messages without an X-Idempotency-Key
        # (fault kind, recipient): kill the sender's executor, or Stop / Force-terminate its task
        self.kill_requests: queue.Queue = queue.Queue()

    def _take(self, modes) -> str:
        with self.lock:
            if self.armed and self.armed[0] in modes:
                return self.armed.popleft()
        return "ok"

    def received_keys(self) -> set[str]:
        with self.lock:
            return {key for _, key, _ in self.log}

    async def handle_RCPT(self, server, session, envelope, address, rcpt_options):
        if self._take(self.RCPT_MODES) == "kill_before_data":
            self.kill_requests.put(("kill_executor_before_data", address))
            await asyncio.sleep(self.late_seconds)  # the sender dies waiting for this answer
        return await super().handle_RCPT(server, session, envelope, address, rcpt_options)

    async def handle_DATA(self, server, session, envelope):
        message = message_from_bytes(envelope.content)
        if not message["X-Idempotency-Key"]:
            # Not a task's email.send (a notification, say): no fault, not in the effects' log.
            with self.lock:
                self.untracked += 1
            self.mode = "ok"
            return await super().handle_DATA(server, session, envelope)
        mode = self._take(self.DATA_MODES)
        with self.lock:
            self.log.append((time.time(), message["X-Idempotency-Key"] or "", message["To"] or ""))
        if mode in ("drop_after_data", "reply_late"):
            self.on_fired(f"smtp_{mode}")
        elif mode == "kill_mid_send":
            self.kill_requests.put(("kill_executor_mid_send", message["To"] or ""))
            mode = "reply_late"  # the sender dies waiting for the 250
        elif mode in ("stop_mid_send", "force_mid_send"):
            self.kill_requests.put((mode, message["To"] or ""))
            mode = "reply_late"  # the operator's request arrives while the sender waits for the 250
        # The parent reads `mode` before its first await: this message gets this mode. It
        # logs the message too (`received`); `self.log` adds the time.
        self.mode = mode
        return await super().handle_DATA(server, session, envelope)


# --- the HTTP upstream ----------------------------------------------------------------------
class SoakUpstream(ArmedModes):
    """The other side of soak.post's POSTs (bench/soak_types.py): records every request it acts
    on, by its reference (the X-Soak-Ref header, `t<task>:<step>`) and, when the tool sends one,
    its Idempotency-Key — a keyed request acts once per key, its repeats get the recorded answer,
    and GET /status/<key> says whether it acted (the http tool's probe). `arm(mode)` makes the
    next POST misbehave, after acting:
    - "502_after_acting": answer 502 (the upstream acted, then failed);
    - "hold_past_timeout": hold the answer past soak.post's step timeout;
    - "stop_mid_post" / "force_mid_post": hold the answer while the soak asks an operator's
      Stop / Force-terminate of the task (queued in `requests` as (kind, reference)).
    A request whose reference had a fault already gets none (a step hit twice the same way
    would give up by its failure policy: the configured limit, not a bug), nor does one of a
    task whose other POST is being held (soak.post's steps run in parallel: each held POST
    is then the one its fault is about — a Stop does not end a step held for its timeout)."""

    def __init__(self, on_fired):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        upstream = self
        self.lock = threading.Lock()
        self.armed: collections.deque = collections.deque()
        self.on_fired = on_fired
        self.log: list[tuple[float, str, str, bool]] = []  # (time, reference, key, acted)
        self.answers: dict[str, dict] = {}  # Idempotency-Key -> the answer it got
        self.faulted: set[str] = set()  # references that met a fault
        self.fired: dict[str, list[tuple[str, float]]] = collections.defaultdict(list)  # mode -> (reference, when)
        self.holding: set[str] = set()  # tasks ("t<id>") one of whose POSTs is being held
        self.requests: queue.Queue = queue.Queue()
        self.hold_seconds = {"hold_past_timeout": STEP_TIMEOUT_SECONDS * 2,
                             "stop_mid_post": HOLD_FOR_OPERATOR_SECONDS, "force_mid_post": HOLD_FOR_OPERATOR_SECONDS}

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def log_message(self, *args):
                pass

            def answer(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:
                    pass  # the client gave up (cancelled, timed out, killed)

            def do_GET(self):
                key = urllib.parse.unquote(self.path.rpartition("/status/")[2])
                with upstream.lock:
                    recorded = upstream.answers.get(key)
                self.answer(200, recorded) if recorded is not None else self.answer(404, {"error": "no such request"})

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                ref = self.headers.get("X-Soak-Ref") or ""
                key = self.headers.get("Idempotency-Key") or ""
                with upstream.lock:
                    replay = key and key in upstream.answers
                    upstream.log.append((time.time(), ref, key, not replay))
                    if replay:
                        recorded = upstream.answers[key]
                        mode = "ok"
                    else:
                        recorded = {"ref": ref, "accepted": True, "bytes": len(body)}
                        if key:
                            upstream.answers[key] = recorded
                        mode = "ok"
                        task = ref.split(":")[0]
                        if upstream.armed and ref not in upstream.faulted and task not in upstream.holding:
                            mode = upstream.armed.popleft()
                            upstream.faulted.add(ref)
                            upstream.fired[mode].append((ref, time.time()))
                            if mode in upstream.hold_seconds:
                                upstream.holding.add(task)
                if mode == "502_after_acting":
                    upstream.on_fired("upstream_502_after_acting")
                    return self.answer(502, {"error": "bad gateway (after the upstream acted)"})
                if mode == "hold_past_timeout":
                    upstream.on_fired("step_timeout")
                elif mode in ("stop_mid_post", "force_mid_post"):
                    upstream.requests.put((mode, ref))
                if mode != "ok":
                    time.sleep(upstream.hold_seconds[mode])
                    with upstream.lock:
                        upstream.holding.discard(ref.split(":")[0])
                self.answer(200, recorded)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/charges"
        self.status_url = f"http://127.0.0.1:{self.port}/status/{{key}}"
        threading.Thread(target=self.server.serve_forever, name="upstream", daemon=True).start()

    def acted_refs(self) -> set[str]:
        with self.lock:
            return {ref for _, ref, _, acted in self.log if acted}

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def valid_stage_output(path: Path, stage: int) -> bool:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return data.get("stage") == stage and len(data.get("values", ())) == 20000


# --- the run ---------------------------------------------------------------------------------
class Soak:
    def __init__(self, opts):
        self.opts = opts
        self.rng = random.Random(opts.seed)
        self.task_rng = random.Random(opts.seed + 1)  # the task mix does not depend on the faults
        self.faults = collections.Counter()
        self.fault_lock = threading.Lock()
        self.notes = collections.Counter()  # things worth knowing that are not faults
        self.decisions = collections.Counter()
        self.decisions_by_tool = collections.Counter()
        self.not_happened: dict[str, float] = {}  # key -> time of the (last) not_happened decision
        self.not_happened_refs: dict[str, float] = {}  # POST reference -> time of its not_happened decision
        self.ended_by_soak: dict[int, str] = {}  # task -> the fault kind whose Stop/Force-terminate ended it
        self.review_anomalies: list[str] = []
        self.orphans_seen: dict[int, list] = {}  # pid -> [first seen, last seen, command line]
        self.created = 0
        self.rcpt_task: dict[str, int] = {}  # notify recipient -> task id
        self.stop_reviewer = threading.Event()
        self.down_clusters: dict[int, float] = {}  # index -> restart time
        self.stopping: dict[int, float] = {}  # index -> when an orderly stop (SIGINT) gives up
        self.stop_strays: dict[int, str] = {}  # processes an orderly cluster stop left behind
        self.kill_strays: dict[int, str] = {}  # processes a kill -9 of their executor/worker/cluster left behind
        # (check at, fault, tree before the kill, delivered through the database)
        self.kill_watches: list[tuple[float, str, dict[int, str], bool]] = []
        self.pg_outages: list[tuple[float, float]] = []  # (stopped at, accepting again at), monotonic
        self.postponed_watches: list[tuple] = []  # watches whose deadline an outage moved, once noted
        self.run_dir = Path(tempfile.mkdtemp(prefix="orch-soak-"))
        self.marker = Marker()

    def fault(self, kind: str, n: int = 1) -> None:
        with self.fault_lock:
            self.faults[kind] += n

    def total_faults(self) -> int:
        with self.fault_lock:
            return sum(self.faults.values())

    # --- infrastructure -----------------------------------------------------------------
    def start_services(self) -> None:
        self.secret_key = "soak-" + secrets.token_urlsafe(32)
        self.pg = PostgresCluster(free_port())
        self.pg.init()
        with open(self.pg.data / "postgresql.conf", "a") as conf:
            conf.write("\nmax_connections = 300\n")
        self.pg.start()
        subprocess.run(["psql", "-h", "127.0.0.1", "-p", str(self.pg.port), "-U", "postgres", "-q", "-c",
                        "CREATE DATABASE soak"], check=True, capture_output=True)
        self.redis = RedisServer(free_port(), self.run_dir / "redis.log").start()
        self.smtp = SoakSmtp(free_port(), self.fault).start()
        self.upstream = SoakUpstream(self.fault)
        log(f"run dir {self.run_dir}; postgresql :{self.pg.port} ({self.pg.dir}), redis :{self.redis.port}, "
            f"smtp :{self.smtp.port}, http upstream :{self.upstream.port}")

    def env(self) -> dict:
        return {
            "DJANGO_SETTINGS_MODULE": "orchestrator.settings",
            "DATABASE_URL": f"postgres://postgres@127.0.0.1:{self.pg.port}/soak",
            "REDIS_URL": f"redis://127.0.0.1:{self.redis.port}/1",
            "EMAIL_HOST": "127.0.0.1", "EMAIL_PORT": str(self.smtp.port), "EMAIL_TIMEOUT": str(EMAIL_TIMEOUT),
            "ORCH_HEARTBEAT_SECONDS": "0.5", "ORCH_STALE_AFTER_SECONDS": "2",
            "ORCH_REQUEUE_AFTER_SECONDS": "3",
            "ORCH_MAX_RECOVERY_ATTEMPTS": os.environ.get("SOAK_MAX_RECOVERY_ATTEMPTS", "100000"),
            "ORCH_SLICE_SECONDS": "1.5", "ORCH_WORKERS": str(self.opts.workers),
            "ORCH_VAR_DIR": str(self.run_dir / "var"), "ORCH_LOG_LEVEL": os.environ.get("SOAK_LOG_LEVEL", "WARNING"),
            "ORCH_LOG_FORMAT": "text", "PYTHONUNBUFFERED": "1",
            "ORCH_EXTRA_TASK_TYPES": "bench.soak_types",  # soak.post: POSTs to the soak's upstream
            # As in production (DEBUG off): one key for every process of the run.
            "DEBUG": "false", "SECRET_KEY": self.secret_key,
        }

    def setup_django(self) -> None:
        os.environ.update(self.env())
        os.environ.pop("ORCH_FAULTS", None)
        import django
        from django.core.management import call_command

        django.setup()
        call_command("migrate", verbosity=0)
        from django.contrib.auth.models import Group, User

        from orchestrator.engine import scheduler

        # No email addresses: the review.opened notifications would go to the soak's SMTP server.
        self.reviewer = User.objects.create_user("soak-reviewer", "", "soak-pw-8c1f")
        self.reviewer.groups.set(Group.objects.filter(name="reviewer"))
        # Stop / Force-terminate as an operator asks them on the dashboard (the same services).
        self.operator = User.objects.create_user("soak-operator", "", "soak-pw-3e7a")
        self.operator.groups.set(Group.objects.filter(name="operator"))
        # This process is a client: a send lost to a Redis outage is a message lost between
        # the commit and the send (the sweeper re-sends it), not an error of the client.
        original_send = scheduler.send

        def send(task_id: int) -> None:
            try:
                original_send(task_id)
            except Exception as exc:  # noqa: BLE001 - redis.ConnectionError and friends
                self.notes["client sends lost to the broker"] += 1
                log(f"send of task {task_id} lost: {type(exc).__name__}")

        scheduler.send = send

    def child_env(self) -> dict:
        return {**os.environ, **self.env(), "SOAK_RUN_ID": self.marker.value}

    def start_workers(self) -> None:
        logs = self.run_dir / "logs"
        logs.mkdir(exist_ok=True)
        env = self.child_env()
        self.clusters = [Managed(f"cluster-{i}", ["qcluster"], env, logs) for i in range(self.opts.clusters)]
        self.sweeper = Managed("sweeper", ["recover", "--loop", "--interval", "0.5"], env, logs)
        deadline = time.monotonic() + 60
        while not all(len(c.workers()) >= self.opts.workers for c in self.clusters):
            if time.monotonic() > deadline:
                raise RuntimeError("the worker clusters did not start")
            time.sleep(0.2)

    # --- database access that survives PostgreSQL restarts ---------------------------
    def db(self, fn, *args, attempts: int = 60, **kwargs):
        from django.db import Error, connection

        for attempt in range(attempts):
            try:
                return fn(*args, **kwargs)
            except Error:
                connection.close()
                if attempt == attempts - 1:
                    raise
                time.sleep(0.5)

    # --- tasks ---------------------------------------------------------------------------
    def new_task(self) -> None:
        from orchestrator.engine import services

        n = self.created + 1
        rng = self.task_rng
        kind = rng.choices(["demo.notify", "demo.migrate_rows", "demo.pipeline", "soak.post"], [4, 3, 3, 4])[0]
        if kind == "soak.post":
            params = {"url": self.upstream.url, "status_url": self.upstream.status_url,
                      "requests": rng.randint(3, 8), "keyed": rng.random() < 0.3,
                      "pause": round(rng.uniform(0.1, 0.4), 2), "step_timeout": STEP_TIMEOUT_SECONDS}
        elif kind == "demo.notify":
            params = {"recipients": [f"r{j}.n{n}@example.org" for j in range(rng.randint(4, 12))],
                      "subject": f"soak {n}", "body": f"message {n} of the soak"}
        elif kind == "demo.migrate_rows":
            params = {"rows": rng.choice([1000, 2000, 3000]), "batch_size": rng.choice([100, 150]),
                      "rate": MIGRATE_RATE}
        else:
            params = {"stages": rng.randint(3, 5), "seconds_per_stage": round(rng.uniform(0.3, 0.8), 2)}
        task = self.db(services.task_create, type=kind, params=params, title=f"soak {n}")
        for address in params.get("recipients", ()):
            self.rcpt_task[address] = task.pk
        self.created += 1

    def unfinished(self) -> int:
        from orchestrator.engine.states import TERMINAL
        from orchestrator.models import Task

        return self.db(lambda: Task.objects.exclude(status__in=TERMINAL).count())

    def keep_tasks_coming(self, elapsed: float) -> None:
        limit = self.opts.tasks
        if limit and self.created >= limit:
            return
        if limit:  # spread them over the fault phase
            due = limit * min(1.0, elapsed / max(1.0, self.opts.duration)) + self.opts.concurrency
            if self.created >= due:
                return
        missing = self.opts.concurrency - self.unfinished()
        for _ in range(max(0, missing)):
            if limit and self.created >= limit:
                break
            self.new_task()

    # --- faults --------------------------------------------------------------------------
    def running_tasks(self) -> list[tuple[int, int]]:
        from orchestrator.models import Task

        return self.db(lambda: list(Task.objects.filter(status="running", worker_pid__isnull=False)
                                    .exclude(lease_owner="").values_list("pk", "worker_pid")))

    def kill(self, pid: int, *, fault: str | None = None) -> bool:
        """SIGKILL a process of this run (never anything else). With `fault`, its process tree
        is watched: whatever of it is alive KILL_STRAY_SECONDS later is a stray."""
        if not self.marker.on(pid):
            return False
        tree = tree_of(pid) if fault else {}
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return False
        if fault:
            self.watch_tree(fault, tree)
        return True

    def watch_tree(self, fault: str, tree: dict[int, str], *, through_database: bool = False) -> None:
        self.kill_watches.append((time.monotonic() + KILL_STRAY_SECONDS, fault, tree, through_database))

    def stray_deadline(self, check_at: float, through_database: bool) -> float:
        """When a watched tree must be gone: KILL_STRAY_SECONDS after the fault, or, for a request
        the worker reads from the database, after the database came back from an outage that
        began before that deadline."""
        if through_database:
            for stopped, back in self.pg_outages:
                if stopped < check_at and back > check_at - KILL_STRAY_SECONDS:
                    check_at = max(check_at, back + KILL_STRAY_SECONDS)
        return check_at

    def check_kill_watches(self, *, all_of_them: bool = False) -> None:
        """Trees of killed processes whose time is up: note (and kill) what is still alive."""
        now = time.monotonic()
        for watch in list(self.kill_watches):
            check_at, fault, tree, through_database = watch
            deadline = self.stray_deadline(check_at, through_database)
            if deadline > check_at and now >= check_at and watch not in self.postponed_watches:
                # Said in the report: how often the database's outage was what kept the tree alive.
                self.postponed_watches.append(watch)
                alive = any(start_time(pid) == started for pid, started in tree.items())
                self.notes[f"{fault}: tree {'alive' if alive else 'gone'} at its first check past {KILL_STRAY_SECONDS:g} s, "
                           f"given until {KILL_STRAY_SECONDS:g} s after a pg_restart"] += 1
            if deadline > now and not all_of_them:
                continue
            if deadline > now:
                time.sleep(deadline - now)
                now = time.monotonic()
            self.kill_watches.remove(watch)
            for pid, started in tree.items():
                if start_time(pid) != started:
                    continue  # gone (or its pid reused by another process)
                command = read_proc(pid, "cmdline").replace(b"\0", b" ").decode(errors="replace")[:200]
                self.kill_strays[pid] = f"alive {KILL_STRAY_SECONDS:g} s after {fault}: {command}"
                try:
                    os.kill(pid, signal.SIGKILL)  # it was in this run's tree (same start time): ours
                except ProcessLookupError:
                    pass

    def inject(self, kind: str) -> bool:
        """Try one fault; False when it had nothing to act on."""
        if kind == "kill_executor":
            running = self.running_tasks()
            self.rng.shuffle(running)
            if os.environ.get("SOAK_DEBUG"):
                log(f"kill_executor: running {running}, marked {[self.marker.on(p) for _, p in running]}")
            return any(self.kill(pid, fault=kind) for _, pid in running)
        if kind == "kill_worker":
            running = self.running_tasks()
            self.rng.shuffle(running)
            workers = {p for c in self.clusters if c.alive() for p in c.workers()}
            for _, pid in running:
                parent = (proc_stat(pid) or (None,))[0]
                if parent in workers and self.kill(parent, fault=kind):
                    return True
            return False
        if kind == "kill_cluster":
            # One cluster down at a time, and only once every cluster is up again.
            if self.down_clusters or self.stopping or \
                    not all(len(c.workers()) >= self.opts.workers for c in self.clusters):
                return False
            index = self.rng.randrange(len(self.clusters))
            tree = tree_of(self.clusters[index].proc.pid)
            self.clusters[index].kill()
            self.watch_tree(kind, tree)
            self.down_clusters[index] = time.monotonic() + self.rng.uniform(0.5, 3.0)
            return True
        if kind == "stop_cluster":
            if self.down_clusters or self.stopping or \
                    not all(len(c.workers()) >= self.opts.workers for c in self.clusters):
                return False
            index = self.rng.randrange(len(self.clusters))
            self.clusters[index].signal_group(signal.SIGINT)
            self.stopping[index] = time.monotonic() + 20
            return True
        if kind in SMTP_MODES:
            if self.smtp.pending() >= 2:
                return False
            self.smtp.arm(SMTP_MODES[kind])
            return True  # counted when it fires
        if kind in UPSTREAM_MODES:
            if self.upstream.pending() >= 2:
                return False
            self.upstream.arm(UPSTREAM_MODES[kind])
            return True  # counted when it fires
        if kind == "broker_purge":
            import redis

            client = redis.Redis.from_url(self.env()["REDIS_URL"])
            try:
                if not client.llen(QUEUE_KEY):
                    # Idle workers take a message the moment it lands: a burst of new tasks
                    # (more than there are workers) leaves some waiting in the list to purge.
                    for _ in range(BURST_FOR_PURGE):
                        self.new_task()
                with client.pipeline() as pipe:  # MULTI: what it saw is what it deleted
                    pipe.llen(QUEUE_KEY)
                    pipe.delete(QUEUE_KEY)
                    waiting, _ = pipe.execute()
            except redis.RedisError:
                return False
            finally:
                client.close()
            self.notes["broker messages purged"] += waiting
            return waiting > 0
        if kind == "redis_restart":
            self.redis.restart()
            return True
        if kind == "pg_restart":
            stopped = time.monotonic()
            self.pg.stop("immediate")
            time.sleep(self.rng.uniform(0.5, 2.5))
            self.pg.start()
            self.pg_outages.append((stopped, time.monotonic()))
            return True
        raise ValueError(kind)

    def kill_senders(self) -> None:
        """The SMTP server or the upstream holds its answer: kill the executor of the task
        sending that email, or ask an operator's Stop / Force-terminate of it."""
        from orchestrator.models import Task

        while True:
            try:
                kind, address = self.smtp.kill_requests.get_nowait()
                task_id = self.rcpt_task.get(address)
            except queue.Empty:
                try:
                    kind, ref = self.upstream.requests.get_nowait()
                except queue.Empty:
                    return
                match = re.match(r"t(\d+):", ref)
                task_id = int(match.group(1)) if match else None
            if kind in OPERATOR_KINDS:
                self.operator_request(kind, task_id)
                continue
            pids = self.db(lambda: list(Task.objects.filter(pk=task_id, status="running")
                                        .values_list("worker_pid", flat=True))) if task_id else []
            if pids and pids[0] and self.kill(pids[0], fault=kind):
                self.fault(kind)
            else:
                self.notes[f"{kind}: sender not found running (not counted)"] += 1

    def operator_request(self, kind: str, task_id: int | None) -> None:
        """Stop or Force-terminate the task whose email or POST is in flight, through the
        service the dashboard's buttons call, as an operator. Counted when it reached a task a
        worker was running; the task is the soak's own ending either way (not lost)."""
        from orchestrator.engine import services, states
        from orchestrator.models import Task

        if task_id is None:
            self.notes[f"{kind}: task not found (not counted)"] += 1
            return
        if task_id in self.ended_by_soak:
            self.notes[f"{kind}: its task was already stopped or terminated by the soak (not counted)"] += 1
            return
        verb = "stop" if kind.startswith("stop") else "terminate"
        running = self.db(lambda: Task.objects.filter(pk=task_id).values("status", "worker_pid", "lease_owner")
                          .first()) or {}
        # Force-terminate kills the executor's tree: whatever of it outlives KILL_STRAY_SECONDS is a stray.
        # Only while a worker runs the task: executors are reused, so a pid left from an earlier run
        # may name an executor now idle or running another task, which rightly lives on.
        pid = running.get("worker_pid")
        held = running.get("status") == "running" and running.get("lease_owner")
        tree = tree_of(pid) if verb == "terminate" and held and pid and self.marker.on(pid) else {}
        request = getattr(services, f"task_{verb}")
        try:
            task = self.db(request, task_id=task_id, actor=self.operator, reason=f"soak: {kind}")
        except states.InvalidTransition as exc:
            self.notes[f"{kind}: refused ({str(exc)[:60]}) (not counted)"] += 1
            return
        self.ended_by_soak[task_id] = kind
        if task.status in states.TERMINAL:
            self.notes[f"{kind}: applied at once, no worker held the task ({running.get('status')}; not counted)"] += 1
        else:
            if tree:
                self.watch_tree(kind, tree, through_database=True)
            self.fault(kind)  # a worker runs it: the runner (Stop) or the watchdog (Force) ends it

    def restart_clusters(self) -> None:
        now = time.monotonic()
        for index, deadline in list(self.stopping.items()):  # orderly stops under way
            cluster = self.clusters[index]
            if cluster.alive() and now < deadline:
                continue
            if cluster.alive():
                self.notes["stop_cluster: still running 20 s after SIGINT (killed)"] += 1
                cluster.signal_group(signal.SIGKILL)
                cluster.proc.wait(timeout=30)
            time.sleep(0.5)  # what its watchdogs killed is gone by now
            for pid in cluster.descendants_alive():
                command = read_proc(pid, "cmdline").replace(b"\0", b" ").decode(errors="replace")[:200]
                self.stop_strays[pid] = f"left by the orderly stop of {cluster.tag}: {command}"
                self.kill(pid)
            cluster.log.close()
            del self.stopping[index]
            self.down_clusters[index] = now + self.rng.uniform(0.5, 2.0)
        for index, at in list(self.down_clusters.items()):
            if now >= at:
                self.clusters[index].start()
                del self.down_clusters[index]
                self.notes["clusters restarted"] += 1
        for index, cluster in enumerate(self.clusters):  # a cluster that died by itself
            if not cluster.alive() and index not in self.down_clusters and index not in self.stopping:
                log(f"cluster-{index} exited by itself (code {cluster.proc.returncode}): restarting")
                self.notes["clusters that exited by themselves"] += 1
                cluster.log.close()
                cluster.start()
        if not self.sweeper.alive():
            log(f"the sweeper exited (code {self.sweeper.proc.returncode}): restarting")
            self.notes["sweeper exits"] += 1
            self.sweeper.log.close()
            self.sweeper.start()

    def reap_orphans(self) -> None:
        """Orphans re-parented to this subreaper: note the living, collect the dead."""
        if time.monotonic() - getattr(self, "_reaped_at", 0) < 0.2:
            return
        self._reaped_at = time.monotonic()
        known = {c.proc.pid for c in self.clusters} | {self.sweeper.proc.pid, self.redis.proc.pid}
        for pid in children_of(os.getpid()):
            if pid in known:
                continue
            state = (proc_stat(pid) or (0, "Z"))[1]
            if state == "Z":
                try:
                    os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    pass
            elif self.marker.on(pid):
                now = time.monotonic()
                seen = self.orphans_seen.setdefault(pid, [now, now, read_proc(pid, "cmdline").replace(b"\0", b" ")
                                                         .decode(errors="replace")[:150]])
                seen[1] = now

    # --- the reviewer --------------------------------------------------------------------
    def review_loop(self) -> None:
        from django.db import connection

        while not self.stop_reviewer.is_set():
            try:
                self.review_once()
            except Exception as exc:  # noqa: BLE001 - the database may be restarting
                connection.close()
                self.notes["reviewer errors (retried)"] += 1
                log(f"reviewer: {type(exc).__name__}: {str(exc)[:200]}")
            self.stop_reviewer.wait(0.3)
        connection.close()

    def review_once(self) -> None:
        from datetime import timedelta

        from django.utils import timezone

        from review.models import ReviewItem
        from review.services import ReviewClosed, review_decide

        # A second for a message in flight when its sender died to reach the server.
        cutoff = timezone.now() - timedelta(seconds=1)
        for item in ReviewItem.objects.filter(status="open", detected_at__lt=cutoff).select_related("wal_entry"):
            entry = item.wal_entry
            key = entry.idempotency_key
            ref = ((entry.args or {}).get("json") or {}).get("ref", "") if entry.tool == "http.request" else ""
            if entry.tool == "http.request" and ref:
                if ref in self.upstream.acted_refs():
                    decision, note = "happened", f"the upstream's log has request {ref}"
                else:
                    decision, note = "not_happened", f"no request {ref} in the upstream's log"
            elif entry.tool != "email.send":
                self.review_anomalies.append(f"review #{item.pk} for {entry.tool} ({key}): {item.reason[:200]}")
                decision, note = "not_happened", f"{entry.tool} is replayable; soak reviewer"
            elif key in self.smtp.received_keys():
                decision, note = "happened", f"X-Idempotency-Key {key} is in the SMTP server's log"
            else:
                decision, note = "not_happened", f"no message with X-Idempotency-Key {key} in the SMTP server's log"
            try:
                review_decide(item_id=item.pk, decision=decision, note=note, actor=self.reviewer)
            except ReviewClosed:
                continue
            self.decisions[decision] += 1
            self.decisions_by_tool[entry.tool] += 1
            if decision == "not_happened":
                self.not_happened[key] = time.time()
                if ref:
                    self.not_happened_refs[ref] = time.time()

    # --- phases --------------------------------------------------------------------------
    def fault_phase(self) -> None:
        opts = self.opts
        duration, target = opts.duration, opts.faults
        scheduled_each = max(1, round(duration / 150))  # a restart of each every ~2.5 minutes
        scheduled = sorted([((i + 0.4) * duration / scheduled_each, "pg_restart") for i in range(scheduled_each)] +
                           [((i + 0.8) * duration / scheduled_each, "redis_restart") for i in range(scheduled_each)])
        first_round = list(RANDOM_KINDS)  # every kind early on, then at random
        self.rng.shuffle(first_round)
        start = time.monotonic()
        next_fault = 3.0
        last_progress = start
        current, current_since = None, 0.0  # the fault being injected, and since when it is tried
        while True:
            elapsed = time.monotonic() - start
            self.kill_senders()
            self.restart_clusters()
            self.reap_orphans()
            self.check_kill_watches()
            if time.monotonic() - last_progress > 0.5:
                self.keep_tasks_coming(elapsed)
                last_progress = time.monotonic()
            done = self.total_faults()
            if time.monotonic() - getattr(self, "_progress_at", start) > 60:
                self._progress_at = time.monotonic()
                log(f"{elapsed:.0f} s: {done} faults, {self.created} tasks created, "
                    f"{sum(self.decisions.values())} review decisions")
            # Every kind at least once: one armed on a server counts only when it fires, and an
            # operator's Stop/Force only when it reached a running task, so the phase goes on
            # (within its time budget) until each has happened.
            missing = [k for k in RANDOM_KINDS if not self.faults.get(k)]
            if done >= target and not scheduled and not first_round and not missing:
                break
            if elapsed > duration + min(duration * 0.5, 120):  # the run's time budget
                log(f"fault phase over its time ({elapsed:.0f} s) with {done} of {target} faults")
                break
            if scheduled and elapsed >= scheduled[0][0]:
                kind = scheduled.pop(0)[1]
                log(f"{kind} ({done} faults so far)")
                self.inject(kind)
                self.fault(kind)
                continue
            if elapsed >= next_fault and (done < target or first_round or missing):
                if current is None:
                    current = first_round.pop(0) if first_round else self.rng.choice(missing) \
                        if done >= target else \
                        self.rng.choices(list(RANDOM_KINDS), list(RANDOM_KINDS.values()))[0]
                    current_since = elapsed
                if self.inject(current):
                    if current not in SMTP_MODES and current not in UPSTREAM_MODES:  # those count when they fire
                        self.fault(current)
                elif elapsed - current_since < NOTHING_TO_ACT_ON_SECONDS:
                    next_fault = elapsed + 0.2  # nothing to act on yet (no running task...): again soon
                    time.sleep(0.05)
                    continue
                else:
                    self.notes[f"{current} skipped: nothing to act on for {NOTHING_TO_ACT_ON_SECONDS:g} s"] += 1
                    if not self.faults.get(current):
                        first_round.append(current)  # every kind at least once: try it again later
                current = None
                remaining = max(1, target - self.total_faults() - len(scheduled) - self.smtp.pending()
                                - self.upstream.pending())
                left = max(0.3, duration - elapsed)
                next_fault = elapsed + left / remaining * self.rng.uniform(0.5, 1.5)
            time.sleep(0.05)
        self.fault_seconds = time.monotonic() - start

    def settle(self) -> None:
        from orchestrator.engine.states import TERMINAL
        from orchestrator.models import Task
        from review.models import ReviewItem

        pending = self.smtp.disarm()
        if pending:
            self.notes["smtp faults armed but never fired"] += pending
        pending = self.upstream.disarm()
        if pending:
            self.notes["upstream faults armed but never fired"] += pending
        for index in list(self.down_clusters):
            self.down_clusters[index] = 0
        while self.stopping:
            self.restart_clusters()
            time.sleep(0.2)
        for index in list(self.down_clusters):
            self.down_clusters[index] = 0
        start = time.monotonic()
        quiet_since = None
        while time.monotonic() - start < self.opts.settle_timeout:
            self.kill_senders()  # what was armed before the disarm still fires once
            self.restart_clusters()
            self.reap_orphans()
            self.check_kill_watches()
            statuses = self.db(lambda: set(Task.objects.exclude(status__in=TERMINAL).values_list("status", flat=True)))
            # Ended tasks' effects in doubt are reviewed too (the reviewer decides them in ~1 s).
            if not statuses and not self.db(lambda: ReviewItem.objects.filter(status="open").exists()):
                break
            # Only tasks waiting for a human that the scripted reviewer cannot help: stop waiting.
            if statuses <= {"needs_human"}:
                quiet_since = quiet_since or time.monotonic()
                if time.monotonic() - quiet_since > 10:
                    break
            else:
                quiet_since = None
            time.sleep(0.5)
        self.settle_seconds = time.monotonic() - start

    def shutdown(self) -> None:
        self.stop_reviewer.set()
        self.reviewer_thread.join(timeout=30)
        # Like Ctrl-C (make run): SIGINT to each process group. (SIGTERM to a qcluster's whole
        # group leaves its main process hanging: django-q2's sentinel dies of it at once.)
        for proc in [*self.clusters, self.sweeper]:
            if proc.alive():
                proc.signal_group(signal.SIGINT)
        deadline = time.monotonic() + 20
        for proc in [*self.clusters, self.sweeper]:
            try:
                proc.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.notes["processes still running 20 s after SIGINT (killed)"] += 1
        time.sleep(1.0)  # what a shut-down worker leaves must be gone by now
        self.check_kill_watches(all_of_them=True)
        self.strays = {**self.stop_strays, **self.kill_strays, **self.find_strays()}
        for proc in [*self.clusters, self.sweeper]:
            proc.kill()
        for pid in self.strays:
            self.kill(pid)

    def find_strays(self) -> dict[int, str]:
        strays = {}
        for pid in self.marker.living():
            strays[pid] = read_proc(pid, "cmdline").replace(b"\0", b" ").decode(errors="replace")[:200]
        pipeline_dir = str(self.run_dir / "var" / "pipeline")
        out = subprocess.run(["pgrep", "-f", pipeline_dir], capture_output=True, text=True).stdout
        for pid in map(int, out.split()):
            strays.setdefault(pid, read_proc(pid, "cmdline").replace(b"\0", b" ").decode(errors="replace")[:200])
        services = {self.redis.proc.pid}
        for pid in children_of(os.getpid()):
            state = (proc_stat(pid) or (0, "Z"))[1]
            comm = read_proc(pid, "comm").decode().strip()
            if pid in services or state == "Z" or comm in ("postgres", "redis-server"):
                continue
            strays.setdefault(pid, read_proc(pid, "cmdline").replace(b"\0", b" ").decode(errors="replace")[:200])
        return strays

    # --- the verdict ---------------------------------------------------------------------
    def verdict(self) -> dict:
        from django.db.models import Count, Sum

        from orchestrator.engine.states import TERMINAL
        from orchestrator.models import Task, TaskEvent, WalEntry
        from demo.models import DemoDestination
        from review.models import ReviewItem
        from demo.tasktypes.migrate_rows import CENTS, batch_ranges, source_amount

        tasks = self.db(lambda: list(Task.objects.order_by("pk").values("pk", "type", "status", "params",
                                                                          "status_reason", "recovery_attempts")))
        statuses = collections.Counter(t["status"] for t in tasks)
        types = collections.Counter(t["type"] for t in tasks)
        with self.smtp.lock:
            messages = list(self.smtp.log)
            if self.smtp.untracked:
                self.notes["emails without an X-Idempotency-Key (not a task's; not counted)"] = self.smtp.untracked
        by_key = collections.defaultdict(list)
        by_recipient = collections.Counter()
        for at, key, to in messages:
            by_key[key].append(at)
            match = re.match(r"t(\d+):", key)
            by_recipient[(int(match.group(1)) if match else None, to)] += 1

        with self.upstream.lock:
            posts = list(self.upstream.log)
        acted_by_ref = collections.defaultdict(list)  # reference -> times the upstream acted on it
        for at, ref, _, acted in posts:
            if acted:
                acted_by_ref[ref].append(at)

        lost, lost_detail = collections.Counter(), []
        rate = Decimal(str(MIGRATE_RATE))
        checked_batches = {}
        ended_by_soak = collections.Counter()  # (fault kind, final status) of the tasks the soak stopped/terminated
        for t in tasks:
            if t["pk"] in self.ended_by_soak:
                ended_by_soak[(self.ended_by_soak[t["pk"]], t["status"])] += 1
                if t["status"] in ("stopped", "terminated"):
                    continue  # its end is the soak's own Stop/Force: nothing of it is owed (its effects
                    # still count for duplicates and reviews, below)
            if t["status"] != "completed":
                lost["tasks not completed"] += 1
                lost_detail.append(f"task {t['pk']} ({t['type']}) is {t['status']}: {t['status_reason'][:300]}")
            if t["type"] == "soak.post":
                for i in range(1, t["params"]["requests"] + 1):
                    if not acted_by_ref.get(f"t{t['pk']}:post-{i:02d}"):
                        lost["POSTs the upstream never got"] += 1
                        lost_detail.append(f"task {t['pk']}: no request t{t['pk']}:post-{i:02d} at the upstream")
            elif t["type"] == "demo.notify":
                for to in t["params"]["recipients"]:
                    if not by_recipient[(t["pk"], to)]:
                        lost["notify recipients without their email"] += 1
                        lost_detail.append(f"task {t['pk']}: no email to {to}")
            elif t["type"] == "demo.migrate_rows":
                bad = []
                for first, last in batch_ranges(t["params"]["rows"], t["params"]["batch_size"]):
                    if (first, last) not in checked_batches:
                        expected = sum((source_amount(i) * rate).quantize(CENTS) for i in range(first, last + 1))
                        got = self.db(lambda: DemoDestination.objects.filter(id__gte=first, id__lte=last)
                                      .aggregate(n=Count("id"), total=Sum("amount")))
                        checked_batches[(first, last)] = (got["n"] == last - first + 1 and got["total"] == expected)
                    if not checked_batches[(first, last)]:
                        bad.append(f"{first}-{last}")
                if bad:
                    lost["migrate tasks with missing or wrong rows"] += 1
                    lost_detail.append(f"task {t['pk']}: destination rows missing or wrong in {', '.join(bad[:5])}")
            elif t["type"] == "demo.pipeline":
                last = t["params"]["stages"]
                output = self.run_dir / "var" / "pipeline" / f"task-{t['pk']}" / f"stage-{last:02d}.json"
                if t["status"] == "completed" and not valid_stage_output(output, t["params"]["stages"]):
                    lost["pipeline tasks without their output"] += 1
                    lost_detail.append(f"task {t['pk']}: {output} missing or not the last stage's 20000 values")

        dup_by_key = sum(len(v) - 1 for v in by_key.values() if len(v) > 1)
        dup_by_recipient = sum(n - 1 for n in by_recipient.values() if n > 1)
        # A not_happened decision asks for a repeat: a copy that had arrived before it (the
        # reviewer looked too early) is explained by the decision, not by the engine.
        explained = 0
        for key, decided_at in self.not_happened.items():
            copies = by_key.get(key, [])
            if len(copies) > 1:
                explained += min(len(copies) - 1, sum(1 for at in copies if at < decided_at))
        dup_posts = sum(len(v) - 1 for v in acted_by_ref.values() if len(v) > 1)
        explained_posts = 0
        for ref, decided_at in self.not_happened_refs.items():
            copies = acted_by_ref.get(ref, [])
            if len(copies) > 1:
                explained_posts += min(len(copies) - 1, sum(1 for at in copies if at < decided_at))
        duplicated = max(dup_by_key, dup_by_recipient) - explained + dup_posts - explained_posts
        dup_detail = [f"{key}: {len(v)} copies" for key, v in by_key.items() if len(v) > 1][:20]
        dup_detail += [f"task {task} -> {to}: {n} emails" for (task, to), n in by_recipient.items() if n > 1][:20]
        dup_detail += [f"POST {ref}: acted on {len(v)} times" for ref, v in acted_by_ref.items() if len(v) > 1][:20]

        # Effects whose outcome nobody knows and nobody recorded: a WAL row still pending (every
        # task has ended: nothing will settle it) without a decided review, or a row of an ended
        # task marked failed ("did not happen") on an outcome the tool reported unknown, with no
        # review and no probe behind it.
        ended = ("stopped", "terminated", "failed")
        unreviewed, unreviewed_detail = collections.Counter(), []
        rows = self.db(lambda: list(
            WalEntry.objects.filter(status="pending").values_list("idempotency_key", "tool", "task__status",
                                                                   "review_item__status")))
        for key, tool, task_status, review in rows:
            if review != "decided":
                why = "pending, review open" if review == "open" else "pending, no review item"
                unreviewed[why] += 1
                unreviewed_detail.append(f"{key} ({tool}, task {task_status}): {why}")
        rows = self.db(lambda: list(
            WalEntry.objects.filter(status="failed", task__status__in=ended, error__startswith="OutcomeUnknown")
            .exclude(settled_by="probe").exclude(review_item__status="decided")
            .values_list("idempotency_key", "tool", "task__status", "error")))
        for key, tool, task_status, error in rows:
            unreviewed["failed on an unknown outcome, task ended"] += 1
            unreviewed_detail.append(f"{key} ({tool}, task {task_status}): failed: {error[:200]}")
        wal_unknown_settled_by_probe = self.db(lambda: WalEntry.objects.filter(settled_by="probe").count())
        # Each step_timeout fault: did the step's timeout cut its POST? (the review item's reason
        # or the step's failure event says "step timeout"), else what ended the step first.
        with self.upstream.lock:
            held_past_timeout = list(self.upstream.fired["hold_past_timeout"])
        timeouts_cut, timeouts_recovered, timeouts_otherwise = 0, 0, []
        hold = self.upstream.hold_seconds["hold_past_timeout"]
        for ref, fired_at in held_past_timeout:
            task_id, step_id = int(ref[1:].split(":")[0]), ref.split(":")[1]
            reasons = self.db(lambda: list(ReviewItem.objects.filter(task_id=task_id, wal_entry__step_id=step_id)
                                           .values_list("reason", flat=True)))
            failures = self.db(lambda: list(TaskEvent.objects.filter(task_id=task_id, kind="step_failed",
                                                                      payload__step=step_id)
                                            .values_list("payload", flat=True)))
            said = " ".join(reasons) + json.dumps(failures)
            # A recovery between the hold and the step's end (a keyed POST is then replayed with its
            # key and leaves neither a review nor a failure; a recovery may come long after the
            # kill when the database was down meanwhile).
            since = datetime.datetime.fromtimestamp(fired_at, datetime.timezone.utc)
            entry = self.db(lambda: WalEntry.objects.filter(task_id=task_id, step_id=step_id)
                            .values("completed_at", "idempotent").first()) or {}
            until = entry.get("completed_at") or since + datetime.timedelta(seconds=hold + 5)
            recovered = self.db(lambda: TaskEvent.objects.filter(
                task_id=task_id, kind="recovery", created_at__gte=since, created_at__lte=until).exists())
            if "step timeout" in said or "StepTimedOut" in said:
                timeouts_cut += 1
            elif recovered:
                timeouts_recovered += 1  # its executor or cluster was killed (or stopped) during the hold
            else:
                status = self.db(lambda: Task.objects.filter(pk=task_id).values_list("status", flat=True).first())
                ender = self.ended_by_soak.get(task_id, "not ended by the soak")
                keyed = "keyed" if entry.get("idempotent") else "not keyed"
                timeouts_otherwise.append(f"{ref} ({keyed}; task {status}, {ender}): {said[:300]}")
        step_timeouts_logged = 0
        for path in (self.run_dir / "logs").glob("*.log"):
            step_timeouts_logged += path.read_text(errors="replace").count("step timed out after")

        stuck = [t for t in tasks if t["status"] not in TERMINAL]
        causes = self.db(lambda: list(TaskEvent.objects.filter(kind="recovery").values_list("payload", flat=True)))
        recoveries = len(causes)
        by_cause = collections.Counter()
        for payload in causes:
            cause = (payload or {}).get("cause", "")
            if not (payload or {}).get("dead_worker"):
                by_cause["no lease holder (sliced or recovered, its message lost)"] += 1
                continue
            by_cause["executor died" if "executor pid" in cause else "worker shut down" if "shut down" in cause
                     else "heartbeat stale" if "heartbeat" in cause else cause[:60] or "?"] += 1
        return {
            "faults": dict(sorted(self.faults.items())), "faults_total": sum(self.faults.values()),
            "tasks": dict(statuses), "tasks_by_type": dict(types), "tasks_total": len(tasks),
            "decisions": dict(self.decisions), "decisions_total": sum(self.decisions.values()),
            "review_anomalies": self.review_anomalies, "recoveries": recoveries,
            "recoveries_by_cause": dict(by_cause),
            "decisions_by_tool": dict(self.decisions_by_tool),
            "ended_by_soak": {f"{kind} -> {status}": n for (kind, status), n in sorted(ended_by_soak.items())},
            "stopped_by_soak": sum(n for (_, status), n in ended_by_soak.items() if status == "stopped"),
            "terminated_by_soak": sum(n for (_, status), n in ended_by_soak.items() if status == "terminated"),
            "posts_received": len(posts), "posts_acted": sum(1 for p in posts if p[3]),
            "wal_settled_by_probe": wal_unknown_settled_by_probe, "step_timeouts_logged": step_timeouts_logged,
            "step_timeout_faults_cut_by_the_timeout": timeouts_cut,
            "step_timeout_faults_recovered_first": timeouts_recovered,
            "step_timeout_faults_otherwise": timeouts_otherwise,
            "messages": len(messages), "notes": dict(self.notes), "orphans_seen": len(self.orphans_seen),
            "orphans_longest_seconds": round(max((b - a for a, b, _ in self.orphans_seen.values()), default=0), 2),
            "orphan_commands": collections.Counter(
                "pipeline stage script" if re.search(r"pipeline/task-\d+/stage-\d+\.py", c) else c[:80]
                for _, _, c in self.orphans_seen.values()).most_common(5),
            "lost": sum(lost.values()), "lost_breakdown": dict(lost), "lost_detail": lost_detail[:30],
            "duplicated": duplicated,
            "duplicated_breakdown": {"by_key": dup_by_key, "by_task_recipient": dup_by_recipient,
                                     "explained_by_not_happened": explained, "posts": dup_posts,
                                     "posts_explained_by_not_happened": explained_posts},
            "duplicated_detail": dup_detail,
            "stray": len(self.strays), "stray_after_kills": len(self.kill_strays), "stray_detail": [f"{pid}: {cmd}" for pid, cmd in self.strays.items()][:20],
            "stuck": len(stuck), "stuck_detail": [f"task {t['pk']} ({t['type']}) {t['status']}: "
                                                  f"{t['status_reason'][:200]}" for t in stuck][:20],
            "unreviewed": sum(unreviewed.values()), "unreviewed_breakdown": dict(unreviewed),
            "unreviewed_detail": unreviewed_detail[:20],
        }

    def report(self, v: dict) -> None:
        o = self.opts
        print(f"soak: {o.clusters} qcluster x {o.workers} workers + 1 sweeper; private PostgreSQL "
              f"(:{self.pg.port}), private Redis broker (:{self.redis.port}), misbehaving SMTP (:{self.smtp.port}), "
              f"misbehaving HTTP upstream (:{self.upstream.port}); seed {o.seed}")
        print(f"time: fault phase {self.fault_seconds:.0f} s (asked {o.duration:g} s), settle {self.settle_seconds:.0f} s, "
              f"total {time.monotonic() - self.t0:.0f} s")
        print(f"faults by kind (total {v['faults_total']}, asked >= {o.faults}):")
        for kind in ALL_KINDS:
            print(f"  {kind:26} {v['faults'].get(kind, 0):6}")
        print(f"tasks by final status (total {v['tasks_total']}): "
              + ", ".join(f"{k} {n}" for k, n in sorted(v["tasks"].items())))
        print("  by type: " + ", ".join(f"{k} {n}" for k, n in sorted(v["tasks_by_type"].items())))
        print(f"  ended by the soak's Stop/Force-terminate: stopped {v['stopped_by_soak']}, terminated "
              f"{v['terminated_by_soak']} (" + (", ".join(f"{k} {n}" for k, n in v["ended_by_soak"].items()) or "-")
              + ")")
        print(f"review decisions (total {v['decisions_total']}): "
              + (", ".join(f"{k} {n}" for k, n in sorted(v["decisions"].items())) or "none")
              + " (" + (", ".join(f"{k} {n}" for k, n in sorted(v["decisions_by_tool"].items())) or "-") + ")")
        print(f"outcomes in doubt settled by a tool's probe: {v['wal_settled_by_probe']}; step timeouts in the "
              f"workers' logs: {v['step_timeouts_logged']}")
        print(f"step_timeout faults: {v['faults'].get('step_timeout', 0)}; the step's timeout cut the POST: "
              f"{v['step_timeout_faults_cut_by_the_timeout']}; its task recovered before the step ended (another "
              f"fault killed or stopped its executor first): {v['step_timeout_faults_recovered_first']}; neither: "
              f"{len(v['step_timeout_faults_otherwise'])}")
        for line in v["step_timeout_faults_otherwise"][:10]:
            print(f"  step_timeout fault not cut by the timeout: {line}")
        print(f"recoveries (recovery events): {v['recoveries']} ("
              + ", ".join(f"{k} {n}" for k, n in sorted(v["recoveries_by_cause"].items())) + ")")
        print(f"messages received by SMTP: {v['messages']}; POSTs received by the upstream: {v['posts_received']} "
              f"(acted on {v['posts_acted']}; the rest repeats of a keyed request)")
        print(f"orphaned processes seen mid-run (re-parented to the soak): {v['orphans_seen']}, "
              f"the longest seen alive for {v['orphans_longest_seconds']} s")
        if v["orphan_commands"]:
            print("  orphans: " + ", ".join(f"{n} x {cmd}" for cmd, n in v["orphan_commands"]))
        for note, n in sorted(v["notes"].items()):
            print(f"  {note}: {n}")
        for anomaly in v["review_anomalies"][:10]:
            print(f"  review anomaly: {anomaly}")
        print("invariants (each must be 0):")
        print(f"  lost        {v['lost']:5}   " + (", ".join(f"{k} {n}" for k, n in v["lost_breakdown"].items()) or "-"))
        b = v["duplicated_breakdown"]
        print(f"  duplicated  {v['duplicated']:5}   emails: by X-Idempotency-Key {b['by_key']}, by (task, recipient) "
              f"{b['by_task_recipient']}, explained by not_happened decisions {b['explained_by_not_happened']}; "
              f"POSTs acted on twice {b['posts']}, explained {b['posts_explained_by_not_happened']}")
        print(f"  stray       {v['stray']:5}   of which alive {KILL_STRAY_SECONDS:g} s after a kill -9 of their "
              f"executor, worker or cluster, or a Force-terminate of their task: {v['stray_after_kills']}")
        print(f"  stuck       {v['stuck']:5}")
        print(f"  unreviewed unknown effects {v['unreviewed']:5}   "
              + (", ".join(f"{k} {n}" for k, n in v["unreviewed_breakdown"].items()) or "-"))
        for name in ("lost", "duplicated", "stray", "stuck", "unreviewed"):
            for line in v[f"{name}_detail"]:
                print(f"    {name}: {line}")
        ok = passed(v)
        self.passed = ok
        print("RESULT: " + ("PASS" if ok else "FAIL") + (f" (run dir kept: {self.run_dir})" if not ok or o.keep else ""))

    def run(self) -> dict:
        from orchestrator.engine import processes

        self.t0 = time.monotonic()
        processes.become_subreaper()  # orphans of this run come to us: the process-tree check
        self.fault_seconds = self.settle_seconds = 0.0
        self.strays = {}
        try:
            self.start_services()
            self.setup_django()
            self.start_workers()
            self.reviewer_thread = threading.Thread(target=self.review_loop, name="reviewer", daemon=True)
            self.reviewer_thread.start()
            log(f"workers up after {time.monotonic() - self.t0:.1f} s; injecting {self.opts.faults} faults "
                f"over ~{self.opts.duration:g} s")
            self.fault_phase()
            log(f"{self.total_faults()} faults in {self.fault_seconds:.0f} s; {self.created} tasks; settling")
            self.settle()
            log(f"settled in {self.settle_seconds:.0f} s; shutting down")
            self.shutdown()
            verdict = self.verdict()
            self.report(verdict)
            return verdict
        finally:
            self.cleanup()

    def cleanup(self) -> None:
        for proc in [*getattr(self, "clusters", []), *([self.sweeper] if hasattr(self, "sweeper") else [])]:
            if proc.alive():
                proc.kill()
        for pid in self.marker.living():
            self.kill(pid)
        if hasattr(self, "smtp"):
            self.smtp.stop()
        if hasattr(self, "upstream"):
            self.upstream.stop()
        if hasattr(self, "redis"):
            self.redis.stop()
        if hasattr(self, "pg"):
            self.pg.destroy()
        ok = getattr(self, "passed", False)
        if ok and not self.opts.keep:
            shutil.rmtree(self.run_dir, ignore_errors=True)


def parse_args(argv=None):
    env = os.environ.get
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--short", action="store_true", help=">= 20 faults in about a minute (the test's mode)")
    parser.add_argument("--faults", type=int, default=env("SOAK_FAULTS"))
    parser.add_argument("--tasks", type=int, default=env("SOAK_TASKS"))
    parser.add_argument("--duration", type=float, default=env("SOAK_DURATION"))
    parser.add_argument("--seed", type=int, default=env("SOAK_SEED"))
    parser.add_argument("--settle-timeout", type=float, default=env("SOAK_SETTLE_TIMEOUT"))
    parser.add_argument("--concurrency", type=int, default=env("SOAK_CONCURRENCY"))
    parser.add_argument("--clusters", type=int, default=int(env("SOAK_CLUSTERS", "2")))
    parser.add_argument("--workers", type=int, default=int(env("SOAK_WORKERS", "2")))
    parser.add_argument("--json", default=env("SOAK_JSON"), help="write the summary there as JSON")
    parser.add_argument("--keep", action="store_true", help="keep the run directory (logs) even when it passes")
    opts = parser.parse_args(argv)
    short = opts.short
    opts.faults = int(opts.faults or (24 if short else 1000))
    opts.duration = float(opts.duration or (50 if short else 1020))
    opts.tasks = int(opts.tasks or 0)  # 0: as many as the fault phase needs
    opts.seed = int(opts.seed) if opts.seed is not None else random.randrange(1_000_000)
    opts.settle_timeout = float(opts.settle_timeout or (60 if short else 240))
    opts.concurrency = int(opts.concurrency or (8 if short else 14))
    if opts.clusters < 2:
        parser.error("--clusters must be at least 2 (one is killed while the others run)")
    return opts


def passed(verdict: dict) -> bool:
    return not any(verdict[name] for name in INVARIANTS)


def main(argv=None) -> int:
    # Ctrl-C stops the soak, and its children get SIGINT's default action back (a shell
    # starts a background job with SIGINT ignored, and an ignored signal stays ignored across
    # exec: the sweeper, which relies on Python's default handler, would never stop).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    opts = parse_args(argv)
    soak = Soak(opts)
    verdict = None
    try:
        verdict = soak.run()
    finally:
        if opts.json:
            Path(opts.json).write_text(json.dumps(verdict, indent=2, default=str) if verdict else "null")
    return 0 if passed(verdict) else 1


if __name__ == "__main__":
    sys.exit(main())
