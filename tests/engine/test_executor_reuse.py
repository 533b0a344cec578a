"""A worker reuses its executor for its next task run when the last one ended cleanly
(engine/executor_process.py): the same process, on PostgreSQL the same database session. What
isolation promises stays: a killed executor (Force-terminate) is never reused, a run that left a
thread running retires its executor, what a run left running as a process is killed before the
next run, an executor killed while it waits is replaced, and an idle executor dies with its worker.

A real process plays the worker (claim, run_isolated, one task after another), so that the test
process is nobody's parent."""
import json
import os
import signal
import subprocess
import sys

import pytest
from django.db import connection

from orchestrator.engine import processes, services
from orchestrator.models import Step, Task
from tests.conftest import ROOT, process_env, wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.task_types("tests.support.testtypes")]

# argv: a JSON list of ["run", task_id] and ["kill-idle"] (SIGKILL the worker's idle executor).
WORKER = """
import json, os, signal, sys
import django
django.setup()
from orchestrator.engine import executor_process
from orchestrator.engine.executor import run_isolated
from orchestrator.engine.lease import claim

outcomes = []
for action in json.loads(sys.argv[1]):
    if action[0] == "run":
        outcomes.append(run_isolated(claim(action[1])))
    else:
        idle = executor_process._executor
        os.kill(idle.pid, signal.SIGKILL)
        os.waitpid(idle.pid, 0)
        idle.exited = True  # collected here: its watchdog would see it gone the same way
print(json.dumps(outcomes))
"""


def session_task(leave: str = "") -> Task:
    return services.task_create(type="test.session", params={"leave": leave})


def worker(actions: list, **env) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", WORKER, json.dumps(actions)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env=process_env(ORCH_EXTRA_TASK_TYPES="tests.support.testtypes", **env))


def outcomes_of(process: subprocess.Popen) -> list[str]:
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def run_all(actions: list, **env) -> list[str]:
    return outcomes_of(worker(actions, **env))


def ran_on(task: Task) -> dict:
    """The step's answer: the executor's pid, its database session, what it left running."""
    return Step.objects.get(task=task, step_id="session").result


def test_an_executor_whose_run_ended_cleanly_runs_the_next_on_its_own_session_and_dies_with_its_worker():
    first, second = session_task(), session_task()
    assert run_all([["run", first.pk], ["run", second.pk]]) == ["executor finished"] * 2
    assert [Task.objects.get(pk=t.pk).status for t in (first, second)] == ["completed"] * 2
    one, two = ran_on(first), ran_on(second)
    assert one["pid"] == two["pid"], "the second run was forked a new executor"
    if connection.vendor == "postgresql":
        assert one["backend"] == two["backend"], "the reused executor connected again"
    # The worker has exited: its idle executor went with it (it must not wait for a run forever).
    wait_for(lambda: not processes.alive(two["pid"]), timeout=10, message="the idle executor to die with its worker")


def test_a_process_a_run_left_running_is_killed_before_the_executor_runs_the_next():
    leaving, after = session_task(leave="subprocess"), session_task()
    assert run_all([["run", leaving.pk], ["run", after.pk]]) == ["executor finished"] * 2
    left = ran_on(leaving)["left"]
    assert left and not processes.alive(left), "the run's subprocess outlived its run"
    assert ran_on(after)["pid"] == ran_on(leaving)["pid"]


def test_a_run_that_left_a_thread_running_retires_its_executor():
    leaving, after = session_task(leave="thread"), session_task()
    assert run_all([["run", leaving.pk], ["run", after.pk]]) == ["executor finished"] * 2
    assert Task.objects.get(pk=after.pk).status == "completed"
    assert ran_on(after)["pid"] != ran_on(leaving)["pid"], "an executor with a run's thread still in it was reused"
    assert not processes.alive(ran_on(leaving)["pid"])


def test_a_run_whose_steps_ran_in_parallel_leaves_its_executor_reusable():
    """The step pool a run gives back is kept for the next run (engine/step_threads.py): its
    idle threads are not threads the run left running."""
    before = session_task()
    parallel = services.task_create(type="test.growing", params={"items": 3}, limits={"max_subtasks": 3})
    after = session_task()
    assert run_all([["run", before.pk], ["run", parallel.pk], ["run", after.pk]]) == ["executor finished"] * 3
    assert Task.objects.get(pk=parallel.pk).status == "completed"
    assert ran_on(after)["pid"] == ran_on(before)["pid"], "the executor retired after a run with parallel steps"


def stubborn_then_another(end_it, mode: str = "ignore_token") -> tuple[int, list[str], Task]:
    """A worker runs a step deaf to cancellation (or, with mode "sleep", one that obeys it), then
    another task; `end_it(stubborn, executor)` ends the first run mid-step. Returns the first run's
    executor pid, the outcomes, the second task."""
    stubborn = services.task_create(type="test.interruptible", params={"mode": mode, "steps": 1, "seconds": 600})
    after = session_task()
    process = worker([["run", stubborn.pk], ["run", after.pk]])
    try:
        executor = wait_for(lambda: Task.objects.get(pk=stubborn.pk).worker_pid, timeout=60,
                            message="the stubborn task's executor to start")
        wait_for(lambda: Task.objects.get(pk=stubborn.pk).activities, timeout=30, message="its step to run")
        end_it(stubborn, executor)
        outcomes = outcomes_of(process)
    finally:
        if process.poll() is None:
            process.kill()
    assert Task.objects.get(pk=after.pk).status == "completed"
    return executor, outcomes, after


def test_a_force_terminated_executor_is_never_reused():
    executor, outcomes, after = stubborn_then_another(
        lambda stubborn, _: services.task_terminate(task_id=stubborn.pk, reason="the test kills it"))
    assert outcomes == ["terminated", "executor finished"]
    assert not processes.alive(executor)
    assert ran_on(after)["pid"] != executor, "the killed executor's pid ran the next task"


def test_an_executor_whose_run_obeyed_a_force_terminate_is_killed_not_reused():
    # The run's own supervisor may see the request before the watchdog's poll does, and a step
    # that obeys its cancellation lets the run end "terminated" by itself: its executor is
    # killed all the same (a Force-terminate ends the task's processes, whoever saw it first).
    executor, outcomes, after = stubborn_then_another(
        lambda stubborn, _: services.task_terminate(task_id=stubborn.pk, reason="the test ends it"), mode="sleep")
    assert outcomes == ["terminated", "executor finished"]
    assert not processes.alive(executor), "the executor of a force-terminated run lives on"
    assert ran_on(after)["pid"] != executor, "the force-terminated run's executor ran the next task"


def test_an_executor_killed_while_it_waited_is_replaced_for_the_next_run():
    first, second = session_task(), session_task()
    assert run_all([["run", first.pk], ["kill-idle"], ["run", second.pk]]) == ["executor finished"] * 2
    assert Task.objects.get(pk=second.pk).status == "completed"
    assert ran_on(second)["pid"] != ran_on(first)["pid"]


def test_with_max_runs_1_every_run_has_a_new_executor():
    first, second = session_task(), session_task()
    assert run_all([["run", first.pk], ["run", second.pk]], ORCH_EXECUTOR_MAX_RUNS=1) == ["executor finished"] * 2
    assert ran_on(first)["pid"] != ran_on(second)["pid"]
    assert not processes.alive(ran_on(first)["pid"]), "a retired executor was left running"


def test_an_executor_killed_mid_step_is_replaced_for_the_next_run():
    # kill -9 of the executor mid-step: its watchdog hands the task to recovery, and the
    # worker's next task runs on a new executor.
    executor, outcomes, after = stubborn_then_another(lambda _, executor: os.kill(executor, signal.SIGKILL))
    assert outcomes == ["executor died", "executor finished"]
    assert ran_on(after)["pid"] != executor


class _KilledExecutor:
    pid = 0

    def killed(self) -> None:
        pass


def test_a_terminate_whose_run_ended_itself_between_the_watchdogs_read_and_lock_is_terminated_not_lease_lost(monkeypatch):
    """The race behind a CI failure of the test above: the watchdog's poll read `control =
    terminate`, then the run's own supervisor committed `terminated` (releasing the lease), then
    the watchdog's fenced lock failed. The task ended as asked, by this lease's own run."""
    from django.db import transaction
    from orchestrator.engine import executor as executor_module, states
    from orchestrator.engine.lease import claim
    from orchestrator.models import TaskStatus

    monkeypatch.setattr(executor_module.processes, "kill_tree", lambda *args, **kwargs: [])
    task = session_task()
    lease = claim(task.pk)
    Task.objects.filter(pk=task.pk).update(status=TaskStatus.RUNNING)  # as the run's start writes
    services.task_terminate(task_id=task.pk, reason="the test ends it")
    with transaction.atomic():  # what the run's own finish writes on a Force-terminate
        states.transition(states.lock_task(task.pk), TaskStatus.TERMINATED, reason="force-terminated by an operator",
                          lease_owner="", control="", activities=[])
    assert executor_module.Watchdog(lease, _KilledExecutor()).terminate("force-terminated by an operator",
                                                                      "terminate") == TaskStatus.TERMINATED
    # A lease another worker holds now is lost, whatever the task's status.
    other = session_task()
    stale = claim(other.pk)
    Task.objects.filter(pk=other.pk).update(lease_epoch=stale.epoch + 1)
    assert executor_module.Watchdog(stale, _KilledExecutor()).terminate("x", "terminate") == "lease lost"
