"""ORCH_EXTENSIONS: a missing or broken module stops the start with its name (`manage.py check`,
which runserver, qcluster and the sweeper run first, and daphne's ASGI application); a working
one's task type is in the API's task types and the new-task form, and its tools are offered to
agents — only while the module is configured."""
import subprocess
import sys

import pytest

from orchestrator.agent import toolbox
from orchestrator.engine import services
from orchestrator.models import Task
from tests.conftest import ROOT, process_env
from tests.support.helpers import bearer

TICKETS = "examples.tickets"


def manage(*command: str, extensions: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "manage.py"), *command], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env=process_env(ORCH_EXTENSIONS=extensions))


@pytest.mark.parametrize("module, why", [
    ("examples.no_such_tracker", "no module named 'examples.no_such_tracker'"),
    ("tests.extensions.broken_on_import", "RuntimeError: the tracker's client needs TICKETS_TOKEN"),
])
def test_a_module_that_cannot_be_imported_fails_the_system_checks_with_its_name(module, why):
    done = manage("check", extensions=f"{TICKETS},{module}")
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert f"(orchestrator.E030) ORCH_EXTENSIONS names {module!r}, which cannot be imported: {why}" in output
    assert TICKETS + "'" not in output  # the one that loads is not blamed


@pytest.mark.parametrize("command", [("qcluster",), ("recover", "--loop")], ids=["workers", "sweeper"])
def test_the_workers_and_the_sweeper_refuse_to_start_with_a_broken_extension(command):
    # They run the system checks first: the start stops, naming the module (a process that
    # started instead would run until the 120 s timeout fails the test).
    done = manage(*command, extensions="tests.extensions.broken_on_import")
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert ("(orchestrator.E030) ORCH_EXTENSIONS names 'tests.extensions.broken_on_import', which cannot be "
            "imported: RuntimeError: the tracker's client needs TICKETS_TOKEN") in output


def test_a_wsgi_server_refuses_to_start_with_a_broken_extension():
    done = subprocess.run([sys.executable, "-c", "import orchestrator.wsgi"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env=process_env(ORCH_EXTENSIONS="tests.extensions.broken_on_import"))
    assert done.returncode != 0
    assert ("ImproperlyConfigured: ORCH_EXTENSIONS: 'tests.extensions.broken_on_import' cannot be imported: "
            "RuntimeError: the tracker's client needs TICKETS_TOKEN") in done.stderr


def test_the_web_process_refuses_to_start_with_a_broken_extension():
    # daphne imports orchestrator.asgi and runs no system checks: the application itself refuses.
    env = process_env(ORCH_EXTENSIONS="tests.extensions.broken_on_import")
    done = subprocess.run([sys.executable, "-c", "import orchestrator.asgi"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env=env)
    assert done.returncode != 0
    assert ("ImproperlyConfigured: ORCH_EXTENSIONS: 'tests.extensions.broken_on_import' cannot be imported: "
            "RuntimeError: the tracker's client needs TICKETS_TOKEN") in done.stderr


def test_a_working_extension_passes_the_checks():
    done = manage("check", extensions=TICKETS)
    assert done.returncode == 0 and "no issues" in done.stdout, done.stdout + done.stderr


@pytest.fixture
def tickets(settings):
    settings.ORCH_EXTENSIONS = [TICKETS]


@pytest.mark.django_db
def test_the_api_lists_the_extensions_task_type_with_its_params_schema(client, operator, settings):
    types = {t["name"]: t for t in client.get("/api/task-types", **bearer(operator)).json()}
    assert "tickets.escalate" not in types
    settings.ORCH_EXTENSIONS = [TICKETS]
    types = {t["name"]: t for t in client.get("/api/task-types", **bearer(operator)).json()}
    escalate = types["tickets.escalate"]
    assert escalate["title"] == "Escalate to the ticket tracker"
    assert escalate["params_schema"]["required"] == ["title"]
    assert set(escalate["params_schema"]["properties"]) == {"title", "body", "comment"}
    created = client.post("/api/tasks", {"type": "tickets.escalate", "params": {"title": "Printer on fire"}},
                          content_type="application/json", **bearer(operator))
    assert created.status_code == 201, created.content
    assert Task.objects.get(pk=created.json()["id"]).type == "tickets.escalate"
    refused = client.post("/api/tasks", {"type": "tickets.escalate", "params": {"title": ""}},
                          content_type="application/json", **bearer(operator))
    assert refused.status_code == 422


@pytest.mark.django_db
def test_the_new_task_form_offers_the_extensions_type_and_creates_it(client, operator, tickets):
    client.force_login(operator)
    listing = client.get("/tasks/new/").content.decode()
    assert "tickets.escalate" in listing and "Escalate to the ticket tracker" in listing
    form = client.get("/tasks/new/", {"type": "tickets.escalate"}).content.decode()
    for field in ("params.title", "params.body", "params.comment"):
        assert f'name="{field}"' in form
    response = client.post("/tasks/new/", {"type": "tickets.escalate", "params.title": "Printer on fire",
                                           "params.body": "smoke", "params.comment": "on it"})
    assert response.status_code == 302, response.content.decode()[-2000:]
    task = Task.objects.get()
    assert task.type == "tickets.escalate"
    assert task.params == {"title": "Printer on fire", "body": "smoke", "comment": "on it"}


@pytest.mark.django_db
def test_an_agent_may_be_given_the_extensions_tools_only_while_it_is_configured(settings, operator):
    assert toolbox.find_tool("tickets_search") is None
    settings.ORCH_EXTENSIONS = [TICKETS]
    assert {"tickets_search", "tickets_create", "tickets_comment"} <= set(toolbox.known_names())
    assert [toolbox.find_tool(n).effect for n in ("tickets_search", "tickets_create", "tickets_comment")] == [
        "read_only", "keyed", "non_idempotent"]
    task = services.task_create(type="agent.plan_execute", actor=operator,
                                params={"goal": "g", "tools": ["tickets_search", "tickets_comment"]})
    assert task.params["tools"] == ["tickets_search", "tickets_comment"]
    settings.ORCH_EXTENSIONS = []
    with pytest.raises(services.InvalidInput) as refused:
        services.task_create(type="agent.plan_execute", actor=operator,
                             params={"goal": "g", "tools": ["tickets_search"]})
    assert "unknown tools ['tickets_search']" in str(refused.value.errors)
