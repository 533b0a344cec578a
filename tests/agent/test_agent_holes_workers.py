"""The agent on real worker processes (issue 20, item 7): the tokens of a stream cut by Stop
are counted, though the task ends without another attempt."""
import pytest

from orchestrator.engine import services
from orchestrator.models import AgentMessage, Task, TaskEvent
from tests.conftest import wait_for

from .test_agent_workers import LONG_GOAL, model_env

pytestmark = [pytest.mark.workers, pytest.mark.django_db(transaction=True)]


def test_the_tokens_of_a_stream_cut_by_stop_are_counted(standin_server, start_workers):
    start_workers(1, **model_env(standin_server, "standin-planner+slow=0.1+no-usage"))
    task = services.task_create(type="agent.plan_execute", params={"goal": LONG_GOAL, "tools": []})
    wait_for(lambda: TaskEvent.objects.filter(task=task, kind="progress", payload__message="agent.stream").exists(),
             timeout=60, message="the answer streaming")
    services.task_stop(task_id=task.pk)
    wait_for(lambda: Task.objects.get(pk=task.pk).status == "stopped", timeout=30, message="stopped")
    task = Task.objects.get(pk=task.pk)
    [partial] = AgentMessage.objects.filter(task=task, role="assistant", interrupted=True)
    assert partial.content and partial.tokens_estimated
    # Its prompt and what streamed were spent: counted once, and the row says so.
    assert partial.accounted and partial.prompt_tokens > 0
    assert task.tokens_used == partial.prompt_tokens + partial.completion_tokens
