"""The smaller doors (issue 19, item 8) over real requests: priorities that are not 0-4 are
refused on every door that takes one, the task page's own priority select posts values the
server takes, titles and max_steps have bounds, and deeply nested JSON is a 400 or a
message, never a 500."""
import json
import re
from datetime import datetime, timezone as dt_timezone

import pytest
from django.test import Client
from standardwebhooks.webhooks import Webhook

from orchestrator.engine import services, webhooks
from orchestrator.models import InboundEvent, Task, WebhookSource
from tests.support.helpers import bearer

pytestmark = pytest.mark.django_db

DEEP = "[" * 100_000 + "]" * 100_000  # json.loads raises RecursionError on this


@pytest.fixture
def operator(make_user):
    return make_user("olga", "operator", "viewer")


@pytest.fixture
def task():
    return services.task_create(type="demo.pipeline", params={})


@pytest.fixture
def source():
    return WebhookSource.objects.create(name="warehouse", secrets=[webhooks.new_secret()],
                                        allowed_types=["upstream.ready", "progress.external"],
                                        task_types=["demo.pipeline"], priority_ceiling=1)


def signed_post(source, task_id, raw: str, msg_id="msg_1"):
    when = datetime.now(dt_timezone.utc)
    headers = {"HTTP_WEBHOOK_ID": msg_id, "HTTP_WEBHOOK_TIMESTAMP": str(int(when.timestamp())),
               "HTTP_WEBHOOK_SIGNATURE": Webhook(source.secrets[0]).sign(msg_id, when, raw)}
    client = Client(raise_request_exception=False)
    return client.post(f"/api/hooks/{source.name}/tasks/{task_id}/events", raw, content_type="application/json",
                       **headers)


def page_client(user) -> Client:
    client = Client(raise_request_exception=False)
    client.force_login(user)
    return client


def flash_messages(response) -> list[str]:
    return [str(m) for m in response.context["messages"]] if response.context else []


# --- priority: true -----------------------------------------------------------------------------

def test_priority_true_is_refused_on_every_door(client, operator, task, source):
    """pydantic reads `true` as 1: the API took it as P1."""
    for priority in (True, False):
        response = client.post(f"/api/tasks/{task.pk}/events", {"type": "progress.external", "priority": priority,
                                                                "payload": {"message": "hi"}},
                               content_type="application/json", **bearer(operator))
        assert response.status_code == 422, (priority, response.content)
        assert "priority" in response.json()["detail"]
    hook = signed_post(source, task.pk, json.dumps({"type": "upstream.ready", "priority": True,
                                                    "payload": {"resource": "a.csv"}}))
    assert hook.status_code == 422 and "priority" in hook.json()["detail"], hook.content
    for priority in ("true", "on", "1.0", "P"):
        form = page_client(operator).post(f"/tasks/{task.pk}/send/", {
            "type": "progress.external", "priority": priority, "payload": '{"message": "hi"}'}, follow=True)
        assert any("priority must be 0-4" in m for m in flash_messages(form)), (priority, flash_messages(form))
    assert not InboundEvent.objects.filter(task=task).exists()


# --- the task page's priority select ----------------------------------------------------------

def test_every_priority_the_task_page_offers_is_accepted(operator, task):
    client = page_client(operator)
    page = client.get(f"/tasks/{task.pk}/").content.decode()
    select = re.search(r'<select name="priority">(.*?)</select>', page, re.S)
    assert select, "the send form has a priority select"
    offered = re.findall(r'<option value="([^"]*)"', select.group(1))
    assert len(offered) >= 3, offered
    for value in offered:
        response = client.post(f"/tasks/{task.pk}/send/", {"type": "progress.external", "priority": value,
                                                             "payload": json.dumps({"message": f"p{value}"}),
                                                             "source_event_id": f"select-{value}"}, follow=True)
        assert any("sent" in m for m in flash_messages(response)), (value, flash_messages(response))
        event = InboundEvent.objects.get(task=task, source_event_id=f"select-{value}")
        if value:
            assert event.priority == int(value.lstrip("Pp"))


# --- titles and max_steps ---------------------------------------------------------------------

def test_a_title_over_200_characters_is_refused_not_cut(client, operator):
    response = client.post("/api/tasks", {"type": "demo.pipeline", "params": {}, "title": "t" * 201},
                           content_type="application/json", **bearer(operator))
    assert response.status_code == 422, response.content
    assert response.json()["errors"][0]["field"] == "title" and "200" in response.json()["detail"]
    assert not Task.objects.exists()
    ok = client.post("/api/tasks", {"type": "demo.pipeline", "params": {}, "title": "t" * 200},
                     content_type="application/json", **bearer(operator))
    assert ok.status_code == 201, ok.content


@pytest.mark.parametrize("max_steps", [True, 10**12, 2**70])
def test_max_steps_has_bounds(client, operator, max_steps):
    response = client.post("/api/tasks", {"type": "demo.pipeline", "params": {}, "limits": {"max_steps": max_steps}},
                           content_type="application/json", **bearer(operator))
    assert response.status_code == 422, response.content
    assert "limits.max_steps" in response.json()["detail"]
    assert not Task.objects.exists()


def test_the_new_task_form_explains_a_title_too_long(operator):
    response = page_client(operator).post("/tasks/new/",
                                          {"type": "demo.pipeline", "title": "t" * 500})
    assert response.status_code == 422, response.status_code
    assert "at most 200 characters" in response.content.decode()
    assert not Task.objects.exists()


# --- deeply nested JSON -----------------------------------------------------------------------

def test_a_deeply_nested_signed_webhook_body_is_400(source, task):
    response = signed_post(source, task.pk, DEEP)
    assert response.status_code == 400, response.content[:300]
    assert "nested" in response.json()["detail"]
    assert not InboundEvent.objects.exists()


def test_a_deeply_nested_api_body_is_400(client, operator, task):
    response = Client(raise_request_exception=False).post(
        f"/api/tasks/{task.pk}/events", '{"type": "progress.external", "payload": {"a": ' + DEEP + "}}",
        content_type="application/json", **bearer(operator))
    assert response.status_code == 400, response.content[:300]
    assert "nested more than 64 levels" in response.json()["detail"]


def test_a_deeply_nested_payload_in_the_send_form_is_a_message(operator, task):
    response = page_client(operator).post(f"/tasks/{task.pk}/send/", {
        "type": "progress.external", "payload": '{"a": ' + DEEP + "}"}, follow=True)
    assert response.status_code == 200
    assert any("nested" in m for m in flash_messages(response)), flash_messages(response)
    assert not InboundEvent.objects.exists()
