"""Stop, Force-terminate and Pause reach every layer — with real worker processes, and no
process, request or stream is left running afterwards."""
import subprocess
import time

import pytest

from orchestrator.engine import processes, services
from orchestrator.models import Step, Task, TaskEvent
from tests.conftest import wait_for
from tests.support.streaming_server import StreamingServer
from tests.support.testtypes import tag

pytestmark = [pytest.mark.workers, pytest.mark.django_db(transaction=True)]
GRACE = 2.0
TEST_TYPES = {"ORCH_EXTRA_TASK_TYPES": "tests.support.testtypes", "ORCH_GRACE_SECONDS": str(GRACE)}


@pytest.fixture
def workers(start_workers, settings):
    settings.ORCH_EXTRA_TASK_TYPES = ["tests.support.testtypes"]
    settings.ORCH_GRACE_SECONDS = GRACE
    return start_workers(1, **TEST_TYPES)


@pytest.fixture
def server():
    srv = StreamingServer()
    yield srv
    srv.stop()


def tagged_processes(task_id: int) -> list[str]:
    out = subprocess.run(["pgrep", "-af", tag(task_id)], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "pgrep" not in line]


def start(mode: str, **params) -> Task:
    task = services.task_create(type="test.interruptible", params={"mode": mode, **params})
    wait_for(lambda: Task.objects.get(pk=task.pk).activities or Task.objects.get(pk=task.pk).status == "running",
             timeout=30, message="the task to start")
    wait_for(lambda: Task.objects.get(pk=task.pk).worker_pid and Task.objects.get(pk=task.pk).status == "running",
             timeout=30, message="the executor to run")
    return Task.objects.get(pk=task.pk)


def wait_final(task_id: int, timeout: float) -> tuple[Task, float]:
    began = time.monotonic()
    wait_for(lambda: Task.objects.get(pk=task_id).status in ("stopped", "terminated", "paused", "completed", "failed"),
             timeout=timeout, interval=0.02, message="the task to settle")
    return Task.objects.get(pk=task_id), time.monotonic() - began


def test_stop_kills_the_step_subprocess(workers):
    task = start("subprocess")
    wait_for(lambda: tagged_processes(task.pk), timeout=20, message="the subprocess")
    services.task_stop(task_id=task.pk)
    task, took = wait_final(task.pk, GRACE + 1)
    assert task.status == "stopped"
    assert not tagged_processes(task.pk)
    assert task.activities == []
    assert TaskEvent.objects.filter(task=task, kind="control_acknowledged").exists()
    assert Step.objects.get(task=task, step_id="step-1").status == "pending"  # not marked done


def test_stop_aborts_a_slow_streaming_http_response(workers, server):
    task = start("http_stream", url=server.url + "/slow")
    wait_for(lambda: server.open_streams == 1, timeout=20, message="the request to stream")
    services.task_stop(task_id=task.pk)
    task, _ = wait_final(task.pk, GRACE + 1)
    assert task.status == "stopped"
    wait_for(lambda: server.open_streams == 0, timeout=2, message="the server to see the client leave")


def test_stop_aborts_an_llm_token_stream(workers, server):
    task = start("llm_stream", url=server.url + "/v1/chat/completions")
    wait_for(lambda: server.open_streams == 1, timeout=20, message="the token stream")
    services.task_stop(task_id=task.pk)
    task, _ = wait_final(task.pk, GRACE + 1)
    assert task.status == "stopped"
    wait_for(lambda: server.open_streams == 0, timeout=2, message="the stream to be closed")


def test_stop_cancels_every_concurrent_subtask(workers):
    task = start("subtasks", subtasks=3)
    wait_for(lambda: len(tagged_processes(task.pk)) == 3, timeout=20, message="three subtasks running")
    services.task_stop(task_id=task.pk)
    task, _ = wait_final(task.pk, GRACE + 1)
    assert task.status == "stopped"
    assert not tagged_processes(task.pk)


def test_force_terminate_kills_a_step_that_ignores_the_token_within_a_second(workers):
    task = start("ignore_token")
    executor = task.worker_pid
    assert processes.alive(executor)
    services.task_terminate(task_id=task.pk, reason="stuck")
    task, took = wait_final(task.pk, 1.0)
    assert task.status == "terminated" and took < 1.0
    wait_for(lambda: not processes.alive(executor), timeout=1, message="the executor to be gone")


def test_stop_escalates_to_force_when_the_step_ignores_the_token(workers):
    task = start("ignore_token")
    executor = task.worker_pid
    services.task_stop(task_id=task.pk)
    task, took = wait_final(task.pk, GRACE + 1.5)
    assert task.status == "terminated" and "escalated" in task.status_reason
    assert took >= GRACE - 0.2
    wait_for(lambda: not processes.alive(executor), timeout=1, message="the executor to be gone")


def test_force_terminate_leaves_no_grandchild_even_one_that_ignores_sigterm(workers):
    task = start("stubborn")
    wait_for(lambda: tagged_processes(task.pk), timeout=20, message="the stubborn subprocess")
    services.task_terminate(task_id=task.pk, reason="cleanup")
    task, took = wait_final(task.pk, 1.0)
    assert task.status == "terminated"
    wait_for(lambda: not tagged_processes(task.pk), timeout=1, message="no process left")


def test_after_stop_the_task_shows_what_is_still_winding_down(workers):
    task = start("stubborn")  # ignores SIGTERM: its group is SIGKILLed after 1 s
    wait_for(lambda: tagged_processes(task.pk), timeout=20, message="the stubborn subprocess")
    services.task_stop(task_id=task.pk)
    seen = wait_for(lambda: Task.objects.get(pk=task.pk).activities, timeout=2, interval=0.02,
                    message="the winding-down activities")
    kinds = {a["kind"] for a in seen}
    assert {"step", "subprocess"} <= kinds and all(a["since"] for a in seen)
    task, _ = wait_final(task.pk, GRACE + 1)
    assert task.status == "stopped" and task.activities == []
    assert not tagged_processes(task.pk)
    # The page follows the event log: the wind-down is in it.
    logged = TaskEvent.objects.filter(task=task, kind="winding_down").order_by("seq")
    assert any("subprocess" in line for e in logged for line in e.payload["still_running"])


def test_pause_lets_the_current_step_finish_and_resume_continues(workers):
    task = services.task_create(type="test.interruptible", params={"mode": "sleep", "steps": 4, "seconds": 0.6})
    wait_for(lambda: Task.objects.get(pk=task.pk).status == "running", timeout=30, message="running")
    services.task_pause(task_id=task.pk)
    task, _ = wait_final(task.pk, 5)
    assert task.status == "paused"
    done = Step.objects.filter(task=task, status="done").count()
    assert 1 <= done < 4  # the step in progress finished; the next did not start
    services.task_resume(task_id=task.pk)
    wait_for(lambda: Task.objects.get(pk=task.pk).status == "completed", timeout=30, message="completion")
    assert Step.objects.filter(task=task, status="done").count() == 4
    assert all(s.attempts == 1 for s in Step.objects.filter(task=task))
