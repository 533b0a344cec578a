"""The threads a run's parallel steps run on, kept between the runs of this process.

Each thread of a run's pool opens its own database connection at its first query (Django's are
per thread): ~4 ms on a quiet machine, 10–20 ms beside the run's other threads, for every
thread of every run (bench/agent.py: an agent's tool calls of one turn run side by side; a new
pool per run was ~1.5 ms of its overhead per step). So a run takes a pool of its size and gives
it back at its end, and the next run of that size in this process gets its threads with their
connections open (PostgreSQL's are health-checked before use, CONN_HEALTH_CHECKS; SQLite's are
not kept, CONN_MAX_AGE 0).

A run's supervisor (engine/supervisor.py) polls on a kept thread too (`run_kept`): with a thread
and a connection of its own per run, the connection was opened beside the run's first steps and
closed beside its end (measured: the close delayed the run's finishing transaction by ~3 ms).

A run that abandons its steps (a Force-terminate; steps that ignored their cancellation) does
not give its pool back: its threads may still be busy. Threads do not survive a fork, so a
forked executor never takes its parent's pools (they are kept per process id).
"""
import os
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

from django.db import connection

from ..outage import check_connection_if_idle

# Idle pools kept per size: one per run going on at once in this process is enough to reuse;
# past that a pool given back is closed (its connections too).
IDLE_POOLS_KEPT = 2

_lock = threading.Lock()
# Keyed by (process id, size): a run's step pools; a run's supervisor thread, kept apart, under
# size 0 (its connection is in use at every poll, where a step pool of one on a watched run may
# never have opened one).
_idle: dict[tuple[int, int], list[ThreadPoolExecutor]] = {}
_SUPERVISOR = 0


def take(size: int) -> ThreadPoolExecutor:
    """A pool of `size` threads for one run: an idle one of this process, or a new one."""
    with _lock:
        idle = _idle.get((os.getpid(), size))
        if idle:
            return idle.pop()
    return ThreadPoolExecutor(max_workers=size, thread_name_prefix="step")


def give_back(pool: ThreadPoolExecutor, size: int, *, abandon: bool) -> None:
    """The run's end: its pool kept for the next run, or (abandoned, or enough kept) shut down."""
    if abandon:
        pool.shutdown(wait=False, cancel_futures=True)
        return
    with _lock:
        idle = _idle.setdefault((os.getpid(), size), [])
        if len(idle) < IDLE_POOLS_KEPT:
            idle.append(pool)
            return
    close_thread_connections(pool)
    pool.shutdown(wait=True, cancel_futures=True)


def run_kept(function) -> Future:
    """Run `function` (a run's supervisor loop) on a kept thread of its own (an idle one, or a new one); the thread
    goes back to the idle pools as soon as `function` returns, with its connection open."""
    with _lock:
        idle = _idle.get((os.getpid(), _SUPERVISOR))
        pool = idle.pop() if idle else None
    pool = pool or ThreadPoolExecutor(max_workers=1, thread_name_prefix="supervisor")
    return pool.submit(_then_idle, function, pool)


def _then_idle(function, pool: ThreadPoolExecutor):
    try:
        return function()
    finally:
        # On the pool's own thread: giving back here (not in a done-callback of whoever waits)
        # makes the thread idle the moment the function ends. Past the idle pools kept, it
        # closes its connection itself (give_back would wait for this thread from this thread).
        with _lock:
            idle = _idle.setdefault((os.getpid(), _SUPERVISOR), [])
            kept = len(idle) < IDLE_POOLS_KEPT
            if kept:
                idle.append(pool)
        if not kept:
            connection.close()
            pool.shutdown(wait=False)


# A pool thread's connection is checked (CONN_HEALTH_CHECKS: a `SELECT 1`) before its first step of
# a run, after it sat idle (outage.IDLE_CHECK_SECONDS), or after a database error on it — not before
# every step: in an agent's turn the check was a round trip on each tool call's thread, ~1 ms beside
# the others.
_checked = threading.local()


def before_step(run) -> None:
    """On a pool thread, before a step of `run`: replace its connection if it may have gone stale
    (outage.check_connection_if_idle, forced at the run's first step on this thread). A database
    restarted between two steps of a run, a second apart at most, fails the later step once (its
    retry finds the connection checked)."""
    last = getattr(_checked, "run", None)  # a weak reference: an idle thread must not keep a run's state
    check_connection_if_idle(force=last is None or last() is not run)
    _checked.run = weakref.ref(run)


def kept_threads() -> set[threading.Thread]:
    """The threads of this process's idle pools: waiting for the next run, not left running by
    the last one (an executor that finds other threads alive after a run retires)."""
    with _lock:
        return {thread for (pid, _), pools in _idle.items() if pid == os.getpid()
                for pool in pools for thread in getattr(pool, "_threads", ())}


def close_thread_connections(pool: ThreadPoolExecutor) -> None:
    """Close the database connection each pool thread opened (a long-lived worker process must
    not leak one per pool). The barrier makes every thread take exactly one close job."""
    threads = len(getattr(pool, "_threads", ()))
    if not threads:
        return
    barrier = threading.Barrier(threads)

    def close():
        connection.close()
        try:
            barrier.wait(timeout=5)
        except threading.BrokenBarrierError:
            pass

    for future in [pool.submit(close) for _ in range(threads)]:
        future.result(timeout=10)
