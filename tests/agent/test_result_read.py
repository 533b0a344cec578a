"""Big tool results stay out of the prompt (issue 22, item 3): a result past
ORCH_AGENT_RESULT_INLINE_CHARS reaches the model as its head and a reference; the step keeps it
whole; the model reads on with result_read, which reads only this task's own results."""
import json
from types import SimpleNamespace

import pytest

from orchestrator.agent import toolbox
from orchestrator.engine import services
from orchestrator.engine.results import result_of
from orchestrator.engine.worker import drive_inline
from orchestrator.models import AgentMessage, Step, Task
from orchestrator.primitives.cancellation import CancellationToken
from tests.agent import big_result_tools
from tests.support.helpers import standin_for_this_process

pytestmark = pytest.mark.django_db(transaction=True)

GOAL = "Fetch the report and tell me how it goes on"


@pytest.fixture
def model(settings):
    with standin_for_this_process(settings, token_seconds=0, ORCH_EXTENSIONS=["tests.agent.big_result_tools"],
                                  ORCH_AGENT_RESULT_INLINE_CHARS=8000) as server:
        yield server


def offered(request) -> set[str]:
    return {t["function"]["name"] for t in request.body.get("tools") or []}


def test_a_5_mb_result_reaches_the_prompt_as_its_head_and_the_model_pages_through_it(model):
    task = services.task_create(type="agent.plan_execute", params={"goal": GOAL, "tools": ["report_fetch"]})
    assert drive_inline(task.pk) == "completed"
    whole = big_result_tools.report()
    assert len(whole) == 5_000_000
    # The step keeps the whole result; the dialog carries its head and how to read on.
    assert result_of(Step.objects.get(task=task, step_id="tool-001-1"))["result"] == whole
    shown = AgentMessage.objects.get(task=task, step_id="tool-001-1", role="tool").content
    assert shown.startswith(whole[:8000]) and len(shown) < 8300
    assert shown.endswith('read on with result_read(ref="tool-001-1", offset=8000).]')
    # No request carried the 5 MB; result_read was offered once there was something to read on.
    assert max(len(json.dumps(r.body["messages"])) for r in model.requests) < 60_000
    assert "result_read" not in offered(model.requests[0])
    assert all("result_read" in offered(r) for r in model.requests[1:])
    # The pages read are the exact next slices, each saying where it is and how to go on.
    pages = list(AgentMessage.objects.filter(task=task, role="tool", name="result_read").order_by("turn"))
    assert [p.content.split("\n", 1)[1] for p in pages] == [whole[8000:14000], whole[14000:20000],
                                                            whole[20000:26000]]
    assert pages[0].content.split("\n", 1)[0] == (
        '[tool-001-1: characters 8000-14000 of 5000000. Read on with result_read(ref="tool-001-1", offset=14000).]')
    answer = AgentMessage.objects.filter(task=task, role="assistant").order_by("-turn").first().content
    assert answer.endswith(whole[26000 - 120:26000])


def test_result_read_reads_only_this_tasks_own_results_and_says_why_not(model):
    first = services.task_create(type="agent.plan_execute", params={"goal": GOAL, "tools": ["report_fetch"]})
    assert drive_inline(first.pk) == "completed"
    other = services.task_create(type="agent.plan_execute", params={"goal": "say hello", "tools": []})

    def call(task, args):  # as the agent's tool step calls it, for `task`
        ctx = SimpleNamespace(task_id=task.pk, step_id="tool-009-1", token=CancellationToken("test"))
        return toolbox.call(ctx, "result_read", json.dumps(args), ["result_read"])

    # Another task's result, by its ref: refused, as if it did not exist (a prompt-injected model
    # guessing refs learns nothing).
    ok, text = call(other, {"ref": "tool-001-1", "offset": 0})
    assert not ok and text.startswith("error: there is no tool result 'tool-001-1' in this task")
    for args, error in (({"ref": "turn-001", "offset": 0}, "there is no tool result 'turn-001'"),
                        ({"ref": "tool-001-1", "offset": 5_000_000}, "past its end"),
                        ({"ref": "tool-001-1", "offset": 0, "limit": 7000}, "invalid arguments")):
        ok, text = call(first, args)
        assert not ok and error in text, text
    ok, text = call(first, {"ref": "tool-001-1", "offset": 4_999_990, "limit": 100})
    assert ok and text.endswith(big_result_tools.report()[-10:]) and "That is the end." in text
    assert Task.objects.get(pk=other.pk).status == "queued"  # nothing ran for it
