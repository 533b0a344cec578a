"""The demo workloads are an extension like any other (demo/, written only against
orchestrator.sdk; import-linter keeps the core from importing it): offered while ORCH_DEMO is on,
gone from every list and refused when it is off."""
import pytest
from django.test import Client

from orchestrator.agent import toolbox
from orchestrator.engine import services
from orchestrator.engine.services import InvalidInput
from orchestrator.tasktypes import all_types
from tests.support.helpers import bearer

pytestmark = pytest.mark.django_db

DEMO_TYPES = {"demo.contracts", "demo.migrate_rows", "demo.notify", "demo.pipeline"}


def test_the_demo_types_and_tools_come_from_the_demo_app_on_the_public_api(operator):
    types = all_types()
    assert DEMO_TYPES <= set(types)
    assert {type(t).__module__.split(".")[0] for name, t in types.items() if name in DEMO_TYPES} == {"demo"}
    assert type(types["agent.plan_execute"]).__module__ == "orchestrator.tasktypes.agent"
    assert {toolbox.find_tool(n).name for n in ("contracts_list", "contracts_read")} == {"contracts_list",
                                                                                          "contracts_read"}
    listed = {t["name"] for t in Client().get("/api/task-types", **bearer(operator)).json()}
    assert DEMO_TYPES <= listed


def test_with_orch_demo_off_the_demo_is_neither_listed_nor_runnable(settings, operator):
    settings.ORCH_DEMO = False
    assert not DEMO_TYPES & set(all_types())
    listed = {t["name"] for t in Client().get("/api/task-types", **bearer(operator)).json()}
    assert listed == {"agent.plan_execute"}
    with pytest.raises(InvalidInput, match="Unknown task type 'demo.notify'"):
        services.task_create(type="demo.notify", params={"recipients": ["a@example.org"], "subject": "s"})
    client = Client()
    client.force_login(operator)
    assert "demo.pipeline" not in client.get("/tasks/new/").content.decode()
    # An agent created with only a goal gets the built-in read alone; the demo's reads are unknown.
    task = services.task_create(type="agent.plan_execute", params={"goal": "read the contracts"})
    assert task.params["tools"] == ["memory_search"]
    with pytest.raises(InvalidInput, match="contracts_read"):
        services.task_create(type="agent.plan_execute", params={"goal": "g", "tools": ["contracts_read"]})
