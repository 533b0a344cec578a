"""orchestrator.sdk, in one process: what @tool accepts and refuses when a module is imported,
that a missing effect fails closed, that the step context protocol is the engine's, and that a
tool's timeout is enforced for real (its token cancelled at the deadline; a side effect whose body
still runs is an unknown outcome, reviewed or replayed with its key by its class)."""
import time

import pytest
from pydantic import BaseModel

from orchestrator import sdk
from orchestrator.agent import toolbox, tooldef
from orchestrator.engine import services
from orchestrator.engine.context import StepContext as EngineStepContext
from orchestrator.engine.worker import drive_inline
from orchestrator.models import AgentMessage, Step, Task, WalEntry
from orchestrator.primitives.cancellation import CancellationToken
from orchestrator.tools.catalog import get_tool
from review.models import ReviewItem
from tests.extensions import faulty_tools
from tests.support.attacker_model import AttackerModel

pytestmark = pytest.mark.django_db(transaction=True)


class Args(BaseModel):
    text: str = ""


@pytest.fixture
def faulty(settings):
    settings.ORCH_EXTENSIONS = ["tests.extensions.faulty_tools"]
    faulty_tools.HOLD.clear()
    faulty_tools.SEEN.clear()
    yield faulty_tools
    faulty_tools.HOLD.set()  # the bodies given up on return, and their threads end


def test_an_unknown_effect_class_is_refused_when_the_module_is_imported():
    with pytest.raises(ValueError, match=r"tool 'sdk_t1': unknown effect 'sometimes'; one of read_only, idempotent, "
                                         r"keyed, non_idempotent"):
        @sdk.tool("sdk_t1", effect="sometimes")
        def t1(args: Args, call: sdk.ToolCall):
            pass
    assert tooldef.find("sdk_t1") is None and "sdk_t1" not in tooldef._DEFINED


@pytest.mark.parametrize("declare, problem", [
    (lambda: sdk.tool("sdk_t2")(lambda args, call: None), "annotate its first parameter"),
    (lambda: sdk.tool("sdk_t2")(_one_parameter), "takes 1 parameter"),
    (lambda: sdk.tool("sdk__t2")(_good), "no '__'"),
    (lambda: sdk.tool("sdk t2")(_good), "letters, digits"),
    (lambda: sdk.tool("email_send", effect=sdk.READ_ONLY)(_good), "a built-in tool's name"),
    (lambda: sdk.tool("sdk_t2", timeout=0)(_good), "timeout must be a positive number"),
    (lambda: sdk.tool("sdk_t2", effect=sdk.READ_ONLY, probe=lambda a, c: None)(_good), "nothing to probe"),
    # Granted to every agent created with only a goal: a read of nothing of the host, never more.
    (lambda: sdk.tool("sdk_t2", effect=sdk.IDEMPOTENT, granted_by_default=True)(_good), "only a read_only tool"),
    (lambda: sdk.tool("sdk_t2", granted_by_default=True)(_good), "only a read_only tool"),
    (lambda: sdk.tool("sdk_t2", effect=sdk.READ_ONLY, reaches_host=True, granted_by_default=True)(_good),
     "only a read_only tool that does not reach the host"),
])
def test_a_declaration_that_cannot_work_is_refused_at_import(declare, problem):
    with pytest.raises((TypeError, ValueError), match=problem):
        declare()


def _one_parameter(args: Args):
    pass


def _good(args: Args, call: sdk.ToolCall):
    return {}


def test_a_name_taken_by_another_function_is_refused():
    @sdk.tool("sdk_once", effect=sdk.IDEMPOTENT)
    def first(args: Args, call: sdk.ToolCall):
        return 1

    with pytest.raises(ValueError, match=r"'sdk_once' is already defined by tests\.extensions\.test_sdk\..*first"):
        @sdk.tool("sdk_once", effect=sdk.IDEMPOTENT)
        def second(args: Args, call: sdk.ToolCall):
            return 2


def test_a_tool_without_an_effect_class_is_non_idempotent_and_an_agents_call_waits_for_a_reviewer(faulty):
    tool = toolbox.find_tool("faulty_send")
    assert tool.effect == sdk.NON_IDEMPOTENT == "non_idempotent"
    assert get_tool("faulty_send").is_idempotent({}) is False
    assert "not idempotent" in toolbox.needs_approval("faulty_send", {}, require=[], waived=[])
    # A keyed tool's key reaches the other side: a replay is safe, and no reviewer is needed.
    assert get_tool("faulty_keyed").is_idempotent({}) is True
    assert toolbox.needs_approval("faulty_keyed", {}, require=[], waived=[]) == ""
    # The model sees the argument model's schema and the function's docstring.
    schema = tool.schema()["function"]
    assert schema["description"].startswith("Sends a note")
    assert set(schema["parameters"]["properties"]) == {"text", "hang_times"}


def test_tools_of_a_module_that_is_not_configured_are_not_offered(faulty, settings):
    assert toolbox.find_tool("faulty_read") is not None and "faulty_read" in toolbox.known_names()
    settings.ORCH_EXTENSIONS = []
    assert toolbox.find_tool("faulty_read") is None and "faulty_read" not in toolbox.known_names()
    with pytest.raises(services.InvalidInput):
        services.task_create(type="agent.plan_execute", params={"goal": "g", "tools": ["faulty_read"]})


def test_the_step_context_protocol_is_what_the_engine_gives_a_step():
    class P(BaseModel):
        x: int = 1

    ctx = EngineStepContext(task_id=1, step_id="s", params=P(), deps={}, lease=None, token=CancellationToken())
    assert isinstance(ctx, sdk.StepContext)
    members = {m for m in dir(sdk.StepContext) if not m.startswith("_")} | set(sdk.StepContext.__annotations__)
    assert members <= set(dir(ctx)) | set(vars(ctx))
    assert {"effect", "wait_for", "progress", "params", "deps", "tokens_left", "sleep"} <= members


def run(tool: str, args: dict | None = None) -> Task:
    task = services.task_create(type="faulty.one_call", params={"tool": tool, "args": args or {}})
    drive_inline(task.pk)
    return Task.objects.get(pk=task.pk)


def test_a_side_effect_still_running_at_its_timeout_is_an_unknown_outcome_in_front_of_a_reviewer(faulty):
    started = time.monotonic()
    task = run("faulty_send")
    took = time.monotonic() - started
    assert task.status == "awaiting_review", task.status_reason
    [seen] = faulty.SEEN
    # Its token was cancelled at the deadline, and the call was given up on within the grace.
    assert seen["cancelled_at"] is not None and "timed out after 0.5 s" in seen["reason"]
    assert abs(seen["cancelled_at"] - seen["deadline"]) < 0.3
    assert took < faulty.TIMEOUT + tooldef.TIMEOUT_GRACE_SECONDS + 5
    entry = WalEntry.objects.get(task=task)
    assert (entry.tool, entry.status, entry.idempotent) == ("faulty_send", "pending", False)
    assert seen["key"] == entry.idempotency_key and (seen["task"], seen["step"]) == (task.pk, "call")
    [item] = ReviewItem.objects.filter(task=task)
    assert item.wal_entry_id == entry.pk and "still running when its timeout of 0.5 s passed" in item.reason


def test_a_keyed_call_that_overran_is_performed_again_with_the_same_key(faulty):
    task = run("faulty_keyed")
    assert task.status == "completed", task.status_reason
    first, second = faulty.SEEN
    assert first["cancelled_at"] is not None and second["cancelled_at"] is None
    assert first["key"] == second["key"] == f"t{task.pk}:call:0"
    entry = WalEntry.objects.get(task=task)
    assert entry.status == "done" and entry.result == {"stored": "note", "key": first["key"]}
    assert not ReviewItem.objects.filter(task=task).exists()


def test_a_body_that_honours_its_token_stops_at_the_deadline_and_is_not_performed(faulty):
    started = time.monotonic()
    task = run("faulty_polite")
    assert task.status == "completed", task.status_reason
    first, second = faulty.SEEN
    # It gave up when its token was cancelled: no grace was needed to know it performed nothing.
    assert first["cancelled_at"] is not None and time.monotonic() - started < faulty.TIMEOUT + 5
    entry = WalEntry.objects.get(task=task)
    assert entry.status == "done" and entry.result == {"stored": "note"}


def test_a_read_that_overruns_its_timeout_is_an_error_the_model_reads_and_no_wal_entry(faulty):
    ok, result = toolbox.call(None, "faulty_read", '{"text": "x"}', ["faulty_read"])
    assert not ok and result == "error: faulty_read did not answer within its timeout of 0.5 s"
    ok, result = toolbox.call(None, "faulty_read", '{"text": "x"}', ["faulty_read"])  # answers the second time
    assert ok and result == {"read": "x"}
    assert not WalEntry.objects.exists()


def test_a_step_can_call_a_read_tool_and_nothing_goes_through_the_wal(faulty):
    task = run("faulty_read", {"text": "y", "hang_times": 0})
    assert task.status == "completed" and task.steps.get().result == {"read": "y"}
    assert not WalEntry.objects.filter(task=task).exists()
    assert faulty.SEEN[0]["key"] is None and faulty.SEEN[0]["step"] == "call"


def test_a_call_with_arguments_its_model_refuses_is_not_performed(faulty):
    task = run("faulty_keyed", {"text": 5})
    assert task.status == "failed" and "invalid arguments" in task.status_reason
    assert not faulty.SEEN and not WalEntry.objects.filter(task=task).exists()


def test_a_tool_that_reaches_the_host_is_granted_only_by_an_admin_where_the_installation_enables_it(
        faulty, settings, operator, make_user):
    params = {"goal": "g", "tools": ["faulty_host_read"]}
    admin = make_user("ada", superuser=True)
    with pytest.raises(services.InvalidInput) as refused:
        services.task_create(type="agent.plan_execute", actor=admin, params=params)
    assert "faulty_host_read reach the worker's host or the database and are not enabled" in str(refused.value.errors)
    settings.ORCH_AGENT_HOST_TOOLS = ["faulty_host_read"]
    with pytest.raises(services.InvalidInput) as refused:
        services.task_create(type="agent.plan_execute", actor=operator, params=params)
    assert "only an admin may grant faulty_host_read" in str(refused.value.errors)
    task = services.task_create(type="agent.plan_execute", actor=admin, params=params)
    assert task.params["tools"] == ["faulty_host_read"]


def test_an_agents_keyed_call_whose_outcome_is_unknown_is_replayed_with_its_key_not_reported_failed(
        faulty, settings):
    with AttackerModel([("faulty_keyed", {"text": "ticket"})]) as model:
        settings.LLM_BASE_URL, settings.LLM_MODEL, settings.LLM_MAX_ATTEMPTS = model.base_url, "scripted", 1
        task = services.task_create(type="agent.plan_execute", params={"goal": "g", "tools": ["faulty_keyed"]})
        drive_inline(task.pk)
    task = Task.objects.get(pk=task.pk)
    assert task.status == "completed", task.status_reason
    first, second = faulty.SEEN
    assert first["key"] == second["key"] and first["cancelled_at"] is not None
    assert Step.objects.get(task=task, step_id="tool-001-1").attempts == 2
    # The model reads what the replay returned, never "it failed" (it could ask again, with a new key).
    answer = AgentMessage.objects.get(task=task, role="tool", name="faulty_keyed")
    assert answer.content == '{"stored": "ticket", "key": "%s"}' % first["key"]


def test_a_step_calls_a_built_in_agent_tool_by_the_same_door_and_an_unknown_one_is_refused(faulty):
    task = run("contracts_list", {"limit": 2})
    assert task.status == "completed", task.status_reason
    assert [c["contract"] for c in task.steps.get().result["contracts"]] == [1, 2]
    task = run("no_such_tool")
    assert task.status == "failed" and "there is no tool 'no_such_tool'" in task.status_reason
