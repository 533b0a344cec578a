"""A worker cluster whose idle processes are killed (kill -9, as the OOM killer does) goes on
taking work, and stops on Ctrl-C: the queues its guard hands jobs and results through are
DeathSafeQueue (orchestrator/engine/worker_queues.py). With django-q2's own queue an idle worker
dies holding the job queue's read lock, and the cluster takes nothing more and never stops
(django-q2 issue #23)."""
import os
import signal
import threading
import time

import pytest

from orchestrator.engine import services, worker_queues
from orchestrator.models import Task
from tests.conftest import wait_for

pytestmark = [pytest.mark.workers, pytest.mark.django_db(transaction=True)]

PIPELINE = {"stages": 2, "seconds_per_stage": 0.05}


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def group_alive(pgid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                pids.append(int(entry))
    return pids


def blocked_in(pid: int) -> tuple[str, str]:
    """(state, the kernel function it sleeps in: /proc/<pid>/wchan, "0" where the kernel hides it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        with open(f"/proc/{pid}/wchan") as f:
            return state, f.read().strip() or "0"
    except OSError:
        return "gone", "0"


def idle_in_their_reads(pids: list[int]) -> bool:
    """Every process asleep, and (where the kernel tells) at least two of them in a pipe's read: a
    worker holding the job queue's read lock, and the monitor in the result queue's."""
    seen = [blocked_in(pid) for pid in pids]
    if any(state != "S" for state, _ in seen):
        return False
    if all(wchan == "0" for _, wchan in seen):
        return True  # no wchan on this kernel: asleep is all that can be told
    return sum("pipe_read" in wchan for _, wchan in seen) >= 2


def kill_everything_the_guard_started(cluster) -> None:
    """kill -9 of the guard's children (the workers, idle in the job queue's read, the monitor in
    the result queue's, the pusher), then wait for the guard to start each again."""
    killed = wait_for(lambda: (pids := cluster.worker_pids()) and len(pids) >= 4 and pids, timeout=60,
                      message="the cluster's workers, monitor and pusher")
    wait_for(lambda: idle_in_their_reads(killed), timeout=30,
             message=f"the workers and monitor asleep in their queues' reads: {[blocked_in(p) for p in killed]}")
    for pid in killed:
        os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not any(alive(p) for p in killed), message="the killed processes to be gone")
    wait_for(lambda: len([p for p in cluster.worker_pids() if p not in killed]) >= 4, timeout=60,
             message="the guard to start them again")


def completed(task_id: int) -> bool:
    return Task.objects.values_list("status", flat=True).get(pk=task_id) == "completed"


def test_a_cluster_whose_idle_processes_were_killed_still_runs_tasks_and_stops_on_ctrl_c(start_workers, settings):
    settings.ORCH_EXTRA_TASK_TYPES = ["tests.support.testtypes"]
    cluster = start_workers(2)
    for round_ in range(2):  # twice: the processes started in place of killed ones can die too
        kill_everything_the_guard_started(cluster)
        task = services.task_create(type="demo.pipeline", params=PIPELINE)
        wait_for(lambda: completed(task.pk), timeout=30,
                 message=f"round {round_}: task {task.pk} to complete on the cluster ({cluster.output()[-2000:]})")

    os.killpg(cluster.proc.pid, signal.SIGINT)  # Ctrl-C
    cluster.proc.wait(timeout=30)
    wait_for(lambda: not group_alive(cluster.proc.pid), timeout=15, message="every process of the cluster to exit")


def test_a_lock_held_by_a_process_that_died_is_free():
    lock = worker_queues.ProcessLock()
    child = os.fork()
    if child == 0:  # the child takes the lock and dies holding it
        lock.acquire()
        os._exit(0)
    os.waitpid(child, 0)
    assert lock.acquire(timeout=5)
    lock.release()


def test_a_lock_held_by_a_living_process_is_not_taken():
    lock = worker_queues.ProcessLock()
    read, write = os.pipe()
    child = os.fork()
    if child == 0:
        lock.acquire()
        os.write(write, b"x")
        time.sleep(30)
        os._exit(0)
    try:
        assert os.read(read, 1) == b"x"  # the child holds it
        assert not lock.acquire(block=False)
        assert not lock.acquire(timeout=0.2)
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        assert lock.acquire(timeout=5)
        lock.release()
    finally:
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_the_cluster_builds_its_queues_as_death_safe_queues():
    from django_q import cluster

    assert cluster.Queue is worker_queues.DeathSafeQueue


def test_a_lock_held_by_another_thread_of_the_same_process_is_not_taken():
    # A record lock belongs to a process: the thread lock keeps a process's threads apart.
    lock = worker_queues.ProcessLock()
    assert lock.acquire()
    taken = []
    other = threading.Thread(target=lambda: taken.append(lock.acquire(timeout=0.2)))
    other.start()
    other.join()
    assert taken == [False]
    lock.release()
    other = threading.Thread(target=lambda: taken.append(lock.acquire(timeout=5) and lock.release() is None))
    other.start()
    other.join()
    assert taken == [False, True]
