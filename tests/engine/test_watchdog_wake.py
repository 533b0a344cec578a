"""The watchdog (a worker, engine/executor.py) wakes when its executor exits, not at its next
poll: the worker slot is free for the next task at once. Told by a pidfd where the kernel has
one; the fallback sleeps the poll interval."""
import os
import time

from orchestrator.engine.executor_process import ExecutorProcess
from tests.conftest import wait_for


def test_the_watchdog_wakes_when_its_executor_exits_not_at_its_next_poll():
    executor = ExecutorProcess()  # a real executor, waiting for its first run
    try:
        assert executor.exit_fd is not None, "this kernel has pidfd_open (Linux 5.3+)"
        os.close(executor.lease_write)  # no run for it: it exits
        executor.lease_write = None
        started = time.monotonic()
        executor.wait(60)  # a poll interval far longer than the executor lives
        woke_after = time.monotonic() - started
        # Its report pipe reads EOF as it exits, a moment before it can be collected.
        _, status = wait_for(lambda: (lambda done: done if done[0] else None)(executor.poll_exit()), timeout=10,
                             message="the executor to be collected")
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, \
            f"the executor did not end as told (wait status {status}): it crashed"
    finally:
        executor.close()
    assert woke_after < 30, f"woke after {woke_after:.1f} s: at the poll's end, not at the exit"


def test_without_a_pidfd_the_watchdog_waits_the_poll_interval():
    executor = ExecutorProcess()
    try:
        os.close(executor.exit_fd)
        executor.exit_fd = None
        started = time.monotonic()
        executor.wait(0.3)
        assert time.monotonic() - started >= 0.3
    finally:
        os.kill(executor.pid, 9)
        os.waitpid(executor.pid, 0)
        executor.close()
