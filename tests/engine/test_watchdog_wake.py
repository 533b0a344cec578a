"""The watchdog (a worker, engine/executor.py) wakes when its executor exits, not at its next
poll: the worker slot is free for the next task at once. Told by a pidfd where the kernel has
one; the fallback sleeps the poll interval."""
import os
import time

from orchestrator.engine.executor import Watchdog
from orchestrator.engine.lease import Lease


def forked_child(lifetime: float) -> int:
    pid = os.fork()
    if pid == 0:
        time.sleep(lifetime)
        os._exit(0)
    return pid


def test_the_watchdog_wakes_when_its_executor_exits_not_at_its_next_poll():
    pid = forked_child(0.2)
    watchdog = Watchdog(Lease(task_id=1, epoch=1, owner="test", host="test", pid=pid), pid)
    try:
        assert watchdog.exit_fd is not None, "this kernel has pidfd_open (Linux 5.3+)"
        started = time.monotonic()
        watchdog.wait_for_exit(60)  # a poll interval far longer than the executor lives
        woke_after = time.monotonic() - started
    finally:
        os.waitpid(pid, 0)
        os.close(watchdog.exit_fd)
    assert woke_after < 30, f"woke after {woke_after:.1f} s: at the poll's end, not at the exit"


def test_without_a_pidfd_the_watchdog_waits_the_poll_interval():
    pid = forked_child(5)
    watchdog = Watchdog(Lease(task_id=1, epoch=1, owner="test", host="test", pid=pid), pid)
    try:
        os.close(watchdog.exit_fd)
        watchdog.exit_fd = None
        started = time.monotonic()
        watchdog.wait_for_exit(0.3)
        assert time.monotonic() - started >= 0.3
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
