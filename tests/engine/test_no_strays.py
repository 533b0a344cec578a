"""No process outlives its executor: a step's subprocess and the processes *it* starts are
killed when the executor dies (kill -9), and when the worker watching it dies (kill -9)."""
import os
import signal
import uuid

import pytest

from orchestrator.engine import processes, services
from orchestrator.models import Task
from tests.conftest import wait_for
from tests.support.straytypes import MARK_VARIABLE

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.workers]

TYPES = "tests.support.straytypes"


def start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rindex(")") + 2:].split()
    return None if fields[0] == "Z" else fields[19]


def marked(mark: str) -> dict[int, str]:
    """Living processes with the mark in their environment: pid -> start time."""
    needle = f"{MARK_VARIABLE}={mark}".encode()
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environment = f.read().split(b"\0")
        except OSError:
            continue
        if needle in environment:
            started = start_time(int(entry))
            if started:
                found[int(entry)] = started
    return found


def still_alive(tree: dict[int, str]) -> list[int]:
    """Which processes of `tree` (pid -> start time) are alive (the same process, not a reused pid)."""
    return [pid for pid, started in tree.items() if start_time(pid) == started]


@pytest.fixture
def mark():
    value = f"stray-{uuid.uuid4().hex}"
    yield value
    for pid in marked(value):  # whatever a failing run left
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def running_tree(mark: str, settings, start_workers):
    settings.ORCH_EXTRA_TASK_TYPES = [TYPES]
    cluster = start_workers(1, ORCH_EXTRA_TASK_TYPES=TYPES)
    task = services.task_create(type="test.strays", params={"mark": mark})
    tree = wait_for(lambda: (lambda found: found if len(found) >= 4 else None)(marked(mark)), timeout=60,
                    message="the step's process tree (4 processes) to run")
    executor = Task.objects.get(pk=task.pk).worker_pid
    assert executor and processes.alive(executor)
    return cluster, task, executor, tree


@pytest.mark.parametrize("victim", ["executor", "worker", "cluster"])
def test_a_killed_executor_or_worker_leaves_no_process_behind(victim, mark, settings, start_workers):
    cluster, task, executor, tree = running_tree(mark, settings, start_workers)
    if victim == "cluster":  # the whole host's workers: kill -9 of the qcluster's process group
        os.killpg(cluster.proc.pid, signal.SIGKILL)
    elif victim == "worker":
        worker = processes._stat(executor)[0]
        assert worker in cluster.worker_pids()
        os.kill(worker, signal.SIGKILL)
    else:
        os.kill(executor, signal.SIGKILL)
    # The task runs again (its step starts a new tree); the old tree must be gone.
    wait_for(lambda: not still_alive(tree), timeout=10,
             message=f"the killed {victim}'s processes to go: {still_alive(tree)} of {sorted(tree)} still alive")


# --- the session keeper alone (no workers) ----------------------------------------------------

KEEPING_WORKER = """
import subprocess, sys, time
from orchestrator.engine import processes
# Two tasks in a row, as a worker runs them: the first's session released, the second's guarded.
done = subprocess.Popen(["sleep", "600"], start_new_session=True)  # stands for the first executor
first = processes.guard_session(done.pid)
first.release()
leader = subprocess.Popen(["sh", "-c", sys.argv[1]], start_new_session=True)  # stands for the executor
keeper = processes.guard_session(leader.pid)
assert keeper is first  # one keeper per worker, kept across its tasks
print(leader.pid, keeper.pid, done.pid, flush=True)
time.sleep(600)
"""


def test_the_keeper_kills_the_session_when_its_worker_dies(mark):
    """The worker's one keeper, after a first task's session was released and while it guards
    the second's: the worker's death kills the second session, and leaves the first alone."""
    import subprocess
    import sys

    from tests.conftest import ROOT
    from tests.support.straytypes import TREE

    worker = subprocess.Popen([sys.executable, "-c", KEEPING_WORKER, TREE], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True, env={**os.environ, MARK_VARIABLE: mark})
    done = None
    try:
        leader, keeper, done = map(int, worker.stdout.readline().split())
        tree = wait_for(lambda: (lambda found: found if len(found) >= 5 else None)(marked(mark)), timeout=10,
                        message="the worker, the leader and its tree")
        assert processes.session_members(leader)
        os.kill(worker.pid, signal.SIGKILL)  # the worker dies holding the session
        wait_for(lambda: not processes.session_members(leader), timeout=10, message="the session to be killed")
        wait_for(lambda: not processes.alive(keeper), timeout=10, message="the keeper to exit")
        assert set(still_alive(tree)) <= {worker.pid, done}  # (the worker: a zombie until this test reaps it)
        assert processes.alive(done)  # released: not the keeper's to kill
    finally:
        worker.kill()
        worker.wait()
        if done:
            os.kill(done, signal.SIGKILL)


def test_a_released_keeper_leaves_the_session_alone_and_a_stopped_one_exits(mark):
    import subprocess

    leader = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        keeper = processes.guard_session(leader.pid)
        assert processes.alive(keeper.pid)
        keeper.release()
        assert processes.keeper() is keeper and processes.alive(keeper.pid)  # kept for the next task
        keeper.stop()
        assert not processes.alive(keeper.pid)
        assert leader.poll() is None and processes.session_members(leader.pid) == [leader.pid]
        assert processes.keeper() is not keeper  # a new one when asked again
        processes.keeper().stop()
    finally:
        leader.kill()
        leader.wait()


def test_a_keeper_killed_by_hand_is_replaced_at_the_next_task(mark):
    import subprocess

    leader = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        killed = processes.keeper()
        os.kill(killed.pid, signal.SIGKILL)
        wait_for(lambda: not processes.alive(killed.pid), timeout=10, message="the keeper to die")
        replacement = processes.guard_session(leader.pid)
        assert replacement is not killed and processes.alive(replacement.pid)
        replacement.stop()
    finally:
        leader.kill()
        leader.wait()
