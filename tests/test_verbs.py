"""Operator verbs are declared once (engine/verbs.py): a verb added here — "snooze", one
record plus one service — appears in the API (its path in the OpenAPI schema, a POST that
works, its role enforced), on the task page (its button) and in the CLI (a subcommand with
its inputs), and nothing else is edited. Unregistered afterwards, so no other test sees it.

And the rule that moved into the service: Force-terminate needs a reason from the API and
the CLI as it does from the page (refused with what to do, nothing changed)."""
from io import StringIO

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import transaction
from django.urls import reverse

from orchestrator.engine import actions, inbox, services, states, verbs
from orchestrator.management.commands.tasks import Command as TasksCommand
from orchestrator.models import AuditEntry, InboundEvent, Task, TaskStatus
from tests.support.helpers import bearer


# --- the new verb: one service ...

def task_snooze(*, task_id: int, minutes: int = 0, reason: str = "", actor=None, ip=None,
                source_event_id: str = "") -> Task:
    """Put a queued task aside for `minutes` (here: paused, with the minutes in its reason)."""
    if not isinstance(minutes, int) or minutes < 1:
        raise services.InvalidInput([services.FieldError("minutes", "snooze for at least 1 minute")])
    with transaction.atomic():
        task = states.lock_task(task_id)
        actions.require(task, "snooze", actor)
        if inbox.record_control(task, "snooze", actor=actor, source_event_id=source_event_id).duplicate:
            return task
        inbox.settle_control(task, "snooze", f"applied: snoozed for {minutes} min")
        states.transition(task, TaskStatus.PAUSED, reason=reason or f"snoozed for {minutes} minutes", actor=actor,
                          ip=ip, action="task.snooze", control="", lease_owner="", lease_epoch=task.lease_epoch + 1)
    return task


# ... and one record.
SNOOZE = verbs.Verb(
    name="snooze", label="Snooze", target=TaskStatus.PAUSED, phrase="be snoozed", role_phrase="snooze tasks",
    service=task_snooze, priority=1, description="put a queued task aside for a while",
    state_check=lambda task, limits: "" if task.status == TaskStatus.QUEUED else (
        f"Task #{task.pk} is {task.status}; only a queued task can be snoozed."),
    inputs=(verbs.Input("minutes", "for how many minutes", required=True, kind=int),
            verbs.Input("reason", "why (recorded in the audit log)", on_page=False)),
    hint="Put the task aside; it waits paused", requested="Snooze requested for task #{id}.",
    done="Task #{id} snoozed.")


@pytest.fixture
def snooze():
    verbs.register(SNOOZE)
    yield SNOOZE
    verbs.unregister("snooze")


@pytest.fixture
def queued(db):
    return services.task_create(type="demo.pipeline", params={})


def status_of(task: Task) -> str:
    return Task.objects.values_list("status", flat=True).get(pk=task.pk)


# --- (a) the API ------------------------------------------------------------------------------

def test_a_registered_verb_is_in_the_openapi_schema_and_leaves_it_when_unregistered(client, snooze):
    schema = client.get("/api/openapi.json").json()
    operation = schema["paths"]["/api/tasks/{task_id}/snooze"]["post"]
    assert operation["operationId"] == "orchestrator_api_snooze_task"
    body = schema["components"]["schemas"]["SnoozeIn"]
    assert body["required"] == ["minutes"] and body["properties"]["minutes"]["type"] == "integer"
    assert "snooze" in schema["components"]["schemas"]["ActionOut"]["properties"]["name"]["enum"]
    # The built-in verbs keep their paths and operation ids.
    for path, operation_id in (("pause", "pause_task"), ("stop", "stop_task"), ("terminate", "terminate_task"),
                               ("skip-step", "skip_step")):
        assert schema["paths"][f"/api/tasks/{{task_id}}/{path}"]["post"]["operationId"] == (
            "orchestrator_api_" + operation_id)
    assert "/api/tasks/{task_id}/{verb}" not in schema["paths"]

    verbs.unregister("snooze")
    schema = client.get("/api/openapi.json").json()
    assert "/api/tasks/{task_id}/snooze" not in schema["paths"]
    assert "snooze" not in schema["components"]["schemas"]["ActionOut"]["properties"]["name"]["enum"]


def test_a_registered_verb_works_through_the_api_for_operators_only(client, operator, viewer, snooze, queued):
    url = f"/api/tasks/{queued.pk}/snooze"
    refused = client.post(url, {"minutes": 5}, content_type="application/json", **bearer(viewer))
    assert refused.status_code == 403, refused.content
    assert status_of(queued) == "queued"
    assert not AuditEntry.objects.filter(action="task.snooze").exists()

    invalid = client.post(url, {"minutes": "soon"}, content_type="application/json", **bearer(operator))
    assert invalid.status_code == 422
    assert invalid.json()["errors"][0]["field"] == "minutes"

    done = client.post(url, {"minutes": 5}, content_type="application/json", **bearer(operator))
    assert done.status_code == 200, done.content
    assert done.json()["status"] == "paused"
    assert {a["name"]: a["allowed"] for a in done.json()["actions"]}["snooze"] is False
    audit = AuditEntry.objects.get(action="task.snooze", task=queued)
    assert audit.actor == operator and audit.reason == "snoozed for 5 minutes"
    event = InboundEvent.objects.get(task=queued, type="snooze")
    assert (event.priority, event.state) == (1, "consumed")

    again = client.post(url, {"minutes": 5}, content_type="application/json", **bearer(operator))
    assert again.status_code == 409
    assert "only a queued task can be snoozed" in again.json()["detail"]
    assert client.post(f"/api/tasks/{queued.pk}/nap", {}, content_type="application/json",
                       **bearer(operator)).status_code == 404


def test_a_registered_verb_can_be_sent_as_an_inbox_event(client, operator, snooze, queued):
    sent = client.post(f"/api/tasks/{queued.pk}/events", {"type": "snooze", "payload": {"minutes": 3},
                                                          "source_event_id": "s-1"},
                       content_type="application/json", **bearer(operator))
    assert sent.status_code == 202, sent.content
    assert (sent.json()["type"], sent.json()["state"]) == ("snooze", "consumed")
    assert status_of(queued) == "paused"


# --- (b) the page -----------------------------------------------------------------------------

def test_a_registered_verb_has_its_button_on_the_task_page_and_the_page_posts_it(client, operator, viewer, snooze,
                                                                                  queued):
    client.force_login(operator)
    page = client.get(reverse("task_detail", kwargs={"task_id": queued.pk})).content.decode()
    assert 'data-testid="btn-snooze"' in page and 'data-action="snooze"' in page
    assert 'name="minutes"' in page
    assert "snooze" in page.split('data-allowed-actions="')[1].split('"')[0].split()

    url = reverse("task_control", kwargs={"task_id": queued.pk})
    body = client.post(url, {"action": "snooze", "minutes": "7"}, follow=True).content.decode()
    assert f"Task #{queued.pk} snoozed." in body
    assert status_of(queued) == "paused"
    page = client.get(reverse("task_detail", kwargs={"task_id": queued.pk})).content.decode()
    assert "snooze" not in page.split('data-allowed-actions="')[1].split('"')[0].split()

    client.force_login(viewer)
    assert 'data-testid="btn-snooze"' not in client.get(
        reverse("task_detail", kwargs={"task_id": queued.pk})).content.decode()
    assert client.post(url, {"action": "snooze", "minutes": "7"}).status_code == 403


# --- (c) the CLI ------------------------------------------------------------------------------

def test_a_registered_verb_is_a_cli_subcommand_with_its_inputs(snooze, queued):
    help_text = TasksCommand().create_parser("manage.py", "tasks").format_help()
    assert "snooze" in help_text
    subcommand_help = StringIO()
    with pytest.raises(SystemExit):
        call_command("tasks", "snooze", "--help", stdout=subcommand_help)
    with pytest.raises(CommandError, match="--minutes"):
        call_command("tasks", "snooze", str(queued.pk))
    with pytest.raises(CommandError, match="minutes: snooze for at least 1 minute"):
        call_command("tasks", "snooze", str(queued.pk), "--minutes", "0")
    out = StringIO()
    call_command("tasks", "snooze", str(queued.pk), "--minutes", "5", stdout=out)
    assert out.getvalue().strip() == f"task #{queued.pk}: paused"
    assert AuditEntry.objects.filter(action="task.snooze", task=queued).exists()


def test_an_unregistered_verb_is_nowhere(client, operator, queued):
    assert "snooze" not in actions.NAMES
    assert "snooze" not in TasksCommand().create_parser("manage.py", "tasks").format_help()
    assert client.post(f"/api/tasks/{queued.pk}/snooze", {"minutes": 5}, content_type="application/json",
                       **bearer(operator)).status_code == 404


# --- Force-terminate needs a reason, whoever asks ---------------------------------------------

def assert_unchanged(task: Task) -> None:
    assert status_of(task) == "queued"
    assert not AuditEntry.objects.filter(task=task, action="task.terminate").exists()
    assert not InboundEvent.objects.filter(task=task, type="terminate").exists()


@pytest.mark.parametrize("body", [{}, {"reason": ""}, {"reason": "   "}, ""], ids=["{}", "empty", "blank", "no body"])
def test_terminate_through_the_api_without_a_reason_is_refused_saying_what_to_do(client, operator, queued, body):
    response = client.post(f"/api/tasks/{queued.pk}/terminate", body, content_type="application/json",
                           **bearer(operator))
    assert response.status_code == 422, response.content
    assert "Force-terminate needs a reason" in response.json()["detail"]
    assert response.json()["errors"][0]["field"] == "reason"
    assert_unchanged(queued)

    done = client.post(f"/api/tasks/{queued.pk}/terminate", {"reason": "runaway"}, content_type="application/json",
                       **bearer(operator))
    assert done.status_code == 200 and done.json()["status"] == "terminated"
    assert AuditEntry.objects.get(task=queued, action="task.terminate").reason == "runaway"


def test_terminate_sent_as_an_inbox_event_needs_a_reason_too(client, operator, queued):
    url = f"/api/tasks/{queued.pk}/events"
    refused = client.post(url, {"type": "terminate"}, content_type="application/json", **bearer(operator))
    assert refused.status_code == 422 and "needs a reason" in refused.json()["detail"]
    assert_unchanged(queued)
    sent = client.post(url, {"type": "terminate", "payload": {"reason": "runaway"}}, content_type="application/json",
                       **bearer(operator))
    assert sent.status_code == 202, sent.content
    assert status_of(queued) == "terminated"


def test_terminate_through_the_cli_without_a_reason_is_refused(queued):
    with pytest.raises(CommandError, match="--reason"):
        call_command("tasks", "terminate", str(queued.pk))
    with pytest.raises(CommandError, match="Force-terminate needs a reason"):
        call_command("tasks", "terminate", str(queued.pk), "--reason", " ")
    assert_unchanged(queued)
    out = StringIO()
    call_command("tasks", "terminate", str(queued.pk), "--reason", "runaway", stdout=out)
    assert out.getvalue().strip() == f"task #{queued.pk}: terminated"


def test_a_state_the_verb_refuses_is_said_before_a_missing_reason(client, operator, queued):
    Task.objects.filter(pk=queued.pk).update(status="completed")
    response = client.post(f"/api/tasks/{queued.pk}/terminate", {}, content_type="application/json",
                           **bearer(operator))
    assert response.status_code == 409
    assert "a finished task cannot be force-terminated" in response.json()["detail"]
