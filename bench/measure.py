"""Measurement helpers the benchmark scripts share (bench/steps.py, bench/compare.py,
bench/hosts.py, bench/recovery.py, bench/interrupt.py, bench/memory.py).

- `DjangoCounters`: commits (`BaseDatabaseWrapper.commit`) and SQL statements of every Django
  connection in every thread of this process (the runner, step threads, the heartbeat).
- `run_task`: create a task and drive it in this process (`drive_inline`), timed.
- `PgServer`: exact figures from PostgreSQL itself, for any system that writes to it: transactions
  committed per database (`pg_stat_database.xact_commit` deltas, read once the statistics have
  settled) and bytes on disk per table (`pg_total_relation_size`, indexes and TOAST included).
- `rss_kib`: this process's resident set size.
- `pct`: a percentile of a list of timings; `host_of`: which of the worker hosts a benchmark
  started (bench/hosts.py, bench/recovery.py) a process belongs to.
- `wait_until`: poll a condition until it holds (TimeoutError after `timeout`);
  `stop_process_groups`: SIGTERM to the process groups a benchmark started, SIGKILL past a grace.

Nothing here asserts: the scripts print figures.
"""
import threading
import time
from urllib.parse import urlsplit, urlunsplit


class DjangoCounters:
    """Counts, from `install()` on, Django commits and SQL statements; read them with `read()`."""

    def __init__(self):
        self.commits = 0
        self.statements = 0
        self._lock = threading.Lock()
        self._installed = False

    def install(self) -> "DjangoCounters":
        if self._installed:
            return self
        from django.db import connections
        from django.db.backends.base.base import BaseDatabaseWrapper
        from django.db.backends.signals import connection_created

        original_commit = BaseDatabaseWrapper.commit
        counters = self

        def counting_commit(wrapper):
            with counters._lock:
                counters.commits += 1
            return original_commit(wrapper)

        BaseDatabaseWrapper.commit = counting_commit
        # Every connection, in every thread (runner, step threads, supervisor), counts.
        connection_created.connect(self._on_connection_created, weak=False)
        for conn in connections.all():
            self._wrap(conn)
        self._installed = True
        return self

    def _on_connection_created(self, sender, connection, **kwargs):
        self._wrap(connection)

    def _wrap(self, conn):
        if self._count_statement not in conn.execute_wrappers:
            conn.execute_wrappers.append(self._count_statement)

    def _count_statement(self, execute, sql, params, many, context):
        with self._lock:
            self.statements += 1
        return execute(sql, params, many, context)

    def read(self) -> tuple[int, int]:
        """(commits, statements) so far."""
        with self._lock:
            return self.commits, self.statements


def run_task(type_name: str, params: dict, *, limits: dict | None = None) -> tuple[object, float]:
    """Create a task and drive it to the end in this process and thread, as a worker would (one
    time slice after the other): (task, seconds). The time includes the creation (as a peer's
    time includes starting its workflow)."""
    from orchestrator.engine import services
    from orchestrator.engine.worker import drive_inline

    start = time.perf_counter()
    task = services.task_create(type=type_name, params=params,
                                limits={"max_subtasks": 1} if limits is None else limits)
    # watched=True: as in an isolated executor (production's default), a step that runs
    # alone runs on the runner's thread.
    outcome = drive_inline(task.pk, watched=True)
    while outcome == "sliced":  # its time slice (ORCH_SLICE_SECONDS) used up: it re-enqueued itself; go on
        outcome = drive_inline(task.pk, watched=True)
    elapsed = time.perf_counter() - start
    if outcome != "completed":
        raise RuntimeError(f"task {task.pk} ended {outcome!r}")
    return task, elapsed


def json_payload_bytes(task) -> int:
    """An estimate for any database (SQLite too): the JSON payload bytes the task keeps
    (results, snapshots, events, WAL) after pruning, plus a rough per-row overhead."""
    from orchestrator.models import Snapshot, Step, TaskEvent, WalEntry

    total = 0
    for model, fields in ((Step, ("result", "reads", "depends_on", "declared_reads")), (Snapshot, ("state",)),
                          (TaskEvent, ("payload",)), (WalEntry, ("args", "result"))):
        for row in model.objects.filter(task=task).values(*fields):
            total += sum(len(str(v)) for v in row.values()) + 64
    return total


def rss_kib() -> int:
    """This process's resident set size now (VmRSS), in KiB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def peak_rss_kib() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def pct(values, q: int) -> float:
    """The q-th percentile (statistics.quantiles, n=100); the value itself when there is one."""
    import statistics

    return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else values[0]


def wait_until(condition, timeout: float, interval: float = 0.01, check=None):
    """`condition()`'s first truthy value, polled every `interval` seconds; TimeoutError after
    `timeout`. `check()` runs between polls (it raises when a process the wait depends on died)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError
        if check is not None:
            check()
        time.sleep(interval)


def stop_process_groups(procs, grace: float = 15.0) -> None:
    """SIGTERM to each Popen's process group (each started with start_new_session=True), then
    SIGKILL to the groups whose leader has not exited within `grace` seconds."""
    import os
    import signal
    import subprocess

    procs = list(procs)
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


def host_of(pid: int, hosts: list):
    """The host (a Popen started in its own session: a `qcluster`) among `hosts` that process
    `pid` is, or descends from; None when it is none of theirs or is gone."""
    from orchestrator.engine import processes

    while pid and pid > 1:
        for host in hosts:
            if pid == host.pid:
                return host
        stat = processes._stat(pid)
        if stat is None:
            return None
        pid = stat[0]
    return None


class PgServer:
    """One PostgreSQL server, addressed by the URL of any database on it. Its own queries go
    through the `postgres` database, so they never count in the databases being measured."""

    def __init__(self, url: str):
        parts = urlsplit(url)
        if parts.scheme not in ("postgres", "postgresql"):
            raise ValueError(f"not a PostgreSQL URL: {url}")
        self._parts = parts._replace(scheme="postgresql")
        self.database = parts.path.lstrip("/")

    def url_for(self, database: str) -> str:
        return urlunsplit(self._parts._replace(path="/" + database))

    def connect(self, database: str = "postgres"):
        import psycopg

        return psycopg.connect(self.url_for(database), autocommit=True)

    def ensure_database(self, name: str) -> bool:
        """Create database `name` unless it exists; True if it was created."""
        from psycopg import sql

        with self.connect() as conn:
            if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone():
                return False
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
            return True

    def xact_commits_now(self, databases: list[str]) -> int:
        """The sum of `xact_commit` over `databases` as the statistics show it now."""
        with self.connect() as conn:
            return self._xact(conn, databases)

    @staticmethod
    def _xact(conn, databases) -> int:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        return int(conn.execute("SELECT coalesce(sum(xact_commit), 0) FROM pg_stat_database "
                                "WHERE datname = ANY(%s)", (list(databases),)).fetchone()[0])

    def vacuum_when_autovacuum_is_off(self, databases: list[str]) -> bool:
        """VACUUM ANALYZE each of `databases` that exists, if this server runs no autovacuum (True
        then). Without it the tables of every earlier run stay bloated and unanalysed: a query the
        planner would serve from a small partial index was seen reading 75,000 dead index entries
        of a status index (8 ms where 0.1 ms is usual) after some 30,000 tasks — each run slower
        than the last, for every system measured. A server with autovacuum does this on its own."""
        with self.connect() as conn:
            if conn.execute("SHOW autovacuum").fetchone()[0] == "on":
                return False
            present = {row[0] for row in conn.execute("SELECT datname FROM pg_database WHERE datname = ANY(%s)",
                                                        (databases,))}
        for database in databases:
            if database in present:
                with self.connect(database) as conn:
                    conn.execute("VACUUM ANALYZE")
        return True

    def xact_commits(self, databases: list[str], *, stable_for: float = 1.0, interval: float = 0.2,
                     timeout: float = 60.0) -> int:
        """The sum of `xact_commit` over `databases`, once every transaction so far is counted.

        A backend reports its counters when it goes idle, but at most once a second; what it
        could not report then waits up to PGSTAT_IDLE_INTERVAL (10 s) while it stays idle, and is
        reported at once when it exits. So the figure is settled when it has not moved for
        `stable_for` seconds and every other session on those databases has exited or has been
        idle for more than 10 s (close the measured system's connections to be quick). After
        `timeout` the current value is returned."""
        deadline = time.monotonic() + timeout
        with self.connect() as conn:
            last, since = None, time.monotonic()
            while True:
                value = self._xact(conn, databases)
                recent = conn.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = ANY(%s) AND pid <> pg_backend_pid() "
                    "AND backend_type = 'client backend' AND (state IS DISTINCT FROM 'idle' "
                    "OR state_change > now() - interval '10.5 seconds')", (list(databases),)).fetchone()[0]
                now = time.monotonic()
                if value != last:
                    last, since = value, now
                elif (not recent and now - since >= stable_for) or now > deadline:
                    return value
                time.sleep(interval)

    def table_bytes(self, database: str, *, tables: list[str] | None = None, schema: str | None = None) -> dict:
        """{table: pg_total_relation_size} for the named tables (those that exist) or for every
        table of `schema`."""
        with self.connect(database) as conn:
            if tables is not None:
                rows = conn.execute("SELECT c.relname, pg_total_relation_size(c.oid) FROM pg_class c "
                                    "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.relkind = 'r' "
                                    "AND n.nspname = coalesce(%s, 'public') AND c.relname = ANY(%s)",
                                    (schema, list(tables))).fetchall()
            else:
                rows = conn.execute("SELECT c.relname, pg_total_relation_size(c.oid) FROM pg_class c "
                                    "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.relkind = 'r' "
                                    "AND n.nspname = %s", (schema,)).fetchall()
        return {name: int(size) for name, size in rows}
