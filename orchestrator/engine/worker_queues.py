"""The worker cluster's job queues survive a worker's kill -9.

django-q2 hands jobs to its worker processes through a `multiprocessing.Queue`: one pipe, read
under one lock all workers share (a POSIX semaphore). An idle worker waits for its next job
*holding* that lock, inside the read. Killed there (kill -9, the OOM killer), it never releases
it: every other worker, and each one the cluster starts in its place, waits for the lock forever.
The cluster takes no more work, and Ctrl-C never ends it: its stop waits for workers that never
read their STOP (django-q2 issue #23, open upstream; tests/engine/test_worker_death.py). The
lock a process sends under is the same (a worker killed while its queue's feeder thread sends a
result would silence every worker's results).

Here both locks of the cluster's queues are POSIX record locks on a file (`fcntl.lockf`), which
the kernel releases when the process holding one dies; a per-process thread lock keeps the
threads of one process apart (a record lock belongs to a process, not to a thread).

What this does not cover: a worker killed in the middle of reading a message (its length read,
not yet its body) leaves the pipe out of step. That window is the time to copy one small
message; the one closed here is the whole time an idle worker waits. The queue's shared size
counter keeps its own lock (reentrant, held for a few instructions).
"""
import errno
import fcntl
import tempfile
import threading
import time
from multiprocessing import util

import django_q.queues

_BUSY = (errno.EACCES, errno.EAGAIN)
# The kernel sees two processes each holding one queue's lock and waiting for the other's as a
# deadlock (record locks belong to processes), though the waits are in different threads and
# end on their own (a worker's reader and its result feeder): such a wait is tried again.
_RETRY = (errno.EDEADLK, errno.EINTR)
_POLL_SECONDS = 0.002


class ProcessLock:
    """A lock between the processes forked from its creator that the death of its holder
    releases. Same interface as `multiprocessing.Lock` (acquire(block, timeout), release, with)."""

    def __init__(self):
        # Unlinked at once: the open descriptor, inherited across fork, is all that is shared.
        # Kept open for the process's life: closing any descriptor of the file would drop the
        # process's record locks on it.
        self._file = tempfile.TemporaryFile(prefix="orch-queue-lock-")
        self._fd = self._file.fileno()
        self._threads = threading.Lock()
        util.register_after_fork(self, ProcessLock._after_fork)

    def _after_fork(self):
        # A thread of the parent may have held the thread lock at the fork: the child's is new.
        self._threads = threading.Lock()

    def acquire(self, block: bool = True, timeout: float | None = None) -> bool:
        wait = block and timeout is None
        deadline = None if wait or not block else time.monotonic() + max(0.0, timeout)
        if not self._threads.acquire(block, -1 if wait or not block else max(0.0, timeout)):
            return False
        try:
            while True:
                try:
                    fcntl.lockf(self._fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return True
                except OSError as exc:
                    if exc.errno not in _BUSY + _RETRY:
                        raise
                if not wait and (deadline is None or time.monotonic() >= deadline):
                    self._threads.release()
                    return False
                time.sleep(_POLL_SECONDS)
        except BaseException:
            self._threads.release()
            raise

    def release(self) -> None:
        fcntl.lockf(self._fd, fcntl.LOCK_UN)
        self._threads.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def __getstate__(self):
        raise TypeError("a ProcessLock is shared by fork only (the worker cluster's start method on Linux), "
                        "not by pickling")


class DeathSafeQueue(django_q.queues.Queue):
    """django-q2's queue with locks a killed holder releases."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._rlock = ProcessLock()
        self._wlock = ProcessLock()


def install() -> None:
    """Make django-q2's cluster build its job and result queues as DeathSafeQueue (called from
    the app's ready(): django_q.cluster can be imported once the apps are)."""
    import django_q.cluster

    django_q.cluster.Queue = DeathSafeQueue
