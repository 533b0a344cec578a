"""The executor process a worker forks, and reuses for its next task runs while it is clean.

A fork per task run cost more than the run of a short task: the fork itself, a new PostgreSQL
session (a new server backend, its catalog caches cold) and a cold process planning the task
(bench/compare.py: ~100 ms of CPU per three-step task across all processes, the 2 cores busy at
17 tasks/s). So an executor that ends a run cleanly waits for its worker's next lease instead of
exiting, with its database session.

What isolation keeps: one run at a time, in its own session (setsid), killed with its whole tree
by its watchdog (Force-terminate, a Stop past its grace, a lost lease, the worker shut down) and
dying with its worker. A killed or crashed executor is never reused: the next run gets a new one.
An executor is reused only when its last run ended without losing its lease and nothing of it is
left running in it: every thread the run started has ended (a step that ignored its
cancellation, a thread a step's code started), and its subprocesses are killed by the watchdog
before the next run. It retires after
ORCH_EXECUTOR_MAX_RUNS runs (1: a new process for every run, as before).

The worker and its executor talk over two pipes: the worker writes one lease per run (a JSON
line); the executor answers one byte when the run is over: "reusable" or "retiring" (it exits).
"""
import dataclasses
import json
import logging
import os
import select
import signal
import threading
import time

from django.db import connections

from .. import telemetry
from ..conf import harness
from ..models import TaskStatus
from ..outage import check_connection_if_idle
from ..tools import mcp
from . import processes, step_threads
from .lease import LEASE_LOST, Lease
from .runner import Runner

log = logging.getLogger(__name__)

# How a run ended, in one byte: its executor may run the next; it exits; it was force-ended
# (Force-terminate, a Stop past its grace) and its watchdog kills its tree now, as it would had
# its own poll seen the request first.
REUSABLE, RETIRING, FORCE_ENDED = b"d", b"r", b"k"
# How long an ended run's threads get to finish before the executor gives up being reused: the
# runner's own (its supervisor, the step clock) end at their next wake, within a control poll.
THREADS_END_WITHIN_SECONDS = 1.0


class ExecutorProcess:
    """The worker's handle on its executor: fork, hand it a run, read how the run ended."""

    def __init__(self):
        keep_connections = _can_keep_connections_across_fork()
        if not keep_connections:
            connections.close_all()  # a forked child must not share the parent's sockets
        lease_read, self.lease_write = os.pipe()  # non-inheritable: an exec'd subprocess holds neither
        report_read, report_write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(self.lease_write)
            os.close(report_read)
            _serve(lease_read, report_write, keep_connections)  # never returns
        os.close(lease_read)
        os.close(report_write)
        os.set_blocking(report_read, False)
        self.pid, self.report_fd, self.owner = pid, report_read, os.getpid()
        self.exited, self.retiring, self.force_ended = False, False, False
        # Readable when the executor exits: the watchdog wakes at once instead of at its next
        # poll. None where the kernel has no pidfd (before Linux 5.3).
        try:
            self.exit_fd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            self.exit_fd = None

    @property
    def reusable(self) -> bool:
        return not (self.exited or self.retiring) and self.owner == os.getpid()

    def start(self, lease: Lease) -> bool:
        """Hand the executor its next run; False if it is gone (it died while it waited)."""
        try:
            os.write(self.lease_write, json.dumps(dataclasses.asdict(lease)).encode() + b"\n")
        except BrokenPipeError:
            self.exited = True
            return False
        return True

    def report(self) -> bytes | None:
        """How the current run ended (REUSABLE, RETIRING or FORCE_ENDED), or None while it goes on."""
        if self.report_fd is None:
            return None
        try:
            word = os.read(self.report_fd, 1)
        except BlockingIOError:
            return None
        if not word:  # the executor closed its end: it is exiting (its exit says how)
            os.close(self.report_fd)
            self.report_fd = None
            return None
        self.retiring = word in (RETIRING, FORCE_ENDED)
        self.force_ended = word == FORCE_ENDED
        return word

    def poll_exit(self) -> tuple[bool, int]:
        """(exited, wait status): collects the executor if it has exited."""
        if self.exited:
            return True, 0
        try:
            done, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:  # already collected (processes.reap_children)
            done, status = self.pid, 0
        if done == self.pid:
            self.exited = True
            return True, status
        return False, 0

    def wait(self, timeout: float) -> None:
        """Until the executor reports, exits, or `timeout` passes (a signal ends it early too)."""
        # Without a pidfd (before Linux 5.3) the exit is seen at the watchdog's next poll.
        fds = [fd for fd in (self.exit_fd, self.report_fd) if fd is not None]
        if not fds:
            time.sleep(timeout)
            return
        try:
            select.select(fds, [], [], timeout)
        except InterruptedError:
            pass

    def killed(self) -> None:
        """Its watchdog killed its tree: this process is not reused."""
        self.exited = True

    def wait_for_retirement(self, timeout: float = 5.0) -> None:
        """The executor said it retires: collect it (killed if it lingers)."""
        deadline = time.monotonic() + timeout
        while not self.poll_exit()[0]:
            if time.monotonic() > deadline:
                processes.kill_tree(self.pid)
                self.exited = True
                return
            self.wait(0.05)

    def close(self) -> None:
        """Let it go (its lease pipe closed: an idle executor reads EOF and exits)."""
        for fd in (self.lease_write, self.report_fd, self.exit_fd):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.lease_write = self.report_fd = self.exit_fd = None


_executor: ExecutorProcess | None = None


def ready_executor() -> ExecutorProcess:
    """This worker's idle executor, or a new one if it has none it may reuse."""
    global _executor
    if _executor is not None and _executor.reusable and not _executor.poll_exit()[0]:
        return _executor
    if _executor is not None and _executor.owner == os.getpid():
        _executor.close()
    _executor = ExecutorProcess()
    return _executor


def after_run(executor: ExecutorProcess) -> None:
    """After its watchdog is done with a run: keep the executor for the next one, or let it go."""
    global _executor
    if not executor.reusable:
        executor.close()
        if _executor is executor:
            _executor = None


# The worker's database connections, inherited by an executor that must never use nor close
# them: kept referenced until the executor's os._exit, so that no finalizer runs.
_inherited_connections: list = []


def _can_keep_connections_across_fork() -> bool:
    """PostgreSQL: the worker keeps its connections while its executor runs (its watchdog polls
    the task, its next claim follows) instead of closing them before every fork and connecting
    again: a new PostgreSQL session per task was ~10 ms before each claim (bench/compare.py).
    SQLite's connections are closed as before (SQLite forbids carrying one across a fork)."""
    return all(conn.vendor == "postgresql" for conn in connections.all(initialized_only=True))


def _drop_inherited_connections() -> None:
    """In the executor just forked: Django's connections start afresh at their next use, and the
    worker's stay the worker's. Closing one here would end the worker's session (psycopg sends
    its Terminate message on the shared socket), so each is let go without a word: its
    descriptor closed in this process only, the object kept so that no finalizer runs."""
    for conn in connections.all(initialized_only=True):
        if conn.connection is None:
            continue
        _inherited_connections.append(conn.connection)
        try:
            os.close(conn.connection.fileno())
        except OSError:  # already gone: nothing of it is left here
            pass
        conn.connection = None


def _serve(lease_read: int, report_write: int, keep_connections: bool) -> None:
    """The executor's life: run each lease its worker hands it, until told to go (EOF), until
    a run leaves something behind, or for ORCH_EXECUTOR_MAX_RUNS runs."""
    code, lease = 0, None
    try:
        if keep_connections:
            _drop_inherited_connections()
        processes.forget_keeper()  # only the worker holds its keeper's pipe
        os.setsid()
        processes.die_with_parent()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        own_threads = set(threading.enumerate())
        with os.fdopen(lease_read, "rb", buffering=0) as leases:
            runs = 0
            while line := leases.readline():
                runs += 1
                if runs > 1:
                    # A session broken since the last run is replaced (checked if it sat idle; one broken
                    # sooner fails the run's first read, which retry_while_down retries on a new one).
                    check_connection_if_idle()
                    processes.reap_children()  # subprocesses of the last run, killed by the watchdog
                lease = Lease(**json.loads(line))
                try:
                    outcome = Runner(lease, watched=True).run()  # this process's watchdog enforces Stop's grace
                finally:
                    mcp.close_all()  # its MCP servers exit now rather than be killed as leftovers
                    telemetry.flush()  # os._exit skips the exporter's atexit hook
                # A run fenced off by another worker may have been cut anywhere: its process goes
                # with it, as when its watchdog kills it for the same reason.
                if outcome == TaskStatus.TERMINATED:
                    os.write(report_write, FORCE_ENDED)
                    break
                retiring = (outcome == LEASE_LOST or not _threads_ended(own_threads, lease)
                            or runs >= harness.executor_max_runs)
                os.write(report_write, RETIRING if retiring else REUSABLE)
                if retiring:
                    break
    except BaseException:
        log.exception("executor crashed", extra={"task_id": lease and lease.task_id,
                                                 "lease_epoch": lease and lease.epoch})
        code = 1
    finally:
        try:
            connections.close_all()
        finally:
            os._exit(code)


def _threads_ended(own_threads: set, lease: Lease) -> bool:
    """Whether every thread the run started has ended (within THREADS_END_WITHIN_SECONDS)."""
    deadline = time.monotonic() + THREADS_END_WITHIN_SECONDS
    while True:
        kept = step_threads.kept_threads()  # the step pool kept for the next run (engine/step_threads.py)
        left = [t for t in threading.enumerate() if t not in own_threads and t not in kept and t.is_alive()]
        if not left:
            return True
        if time.monotonic() > deadline:
            log.info("executor retires: the run left %d threads running (%s)", len(left),
                     ", ".join(t.name for t in left[:5]), extra={"task_id": lease.task_id, "lease_epoch": lease.epoch})
            return False
        left[0].join(timeout=max(0.0, deadline - time.monotonic()))
