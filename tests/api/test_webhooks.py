"""Signed events from outside systems (Standard Webhooks): a valid signature puts the event
in the task's inbox (a redelivery is answered, not applied twice); a bad one is 401,
audited, and creates nothing; secrets rotate; the source's rules bound what it may send."""
import json
from datetime import datetime, timedelta, timezone as dt_timezone

import pytest
from django.test import Client
from standardwebhooks.webhooks import Webhook

from orchestrator.engine import services, webhooks
from orchestrator.models import AuditEntry, InboundEvent, WebhookSource

pytestmark = pytest.mark.django_db


@pytest.fixture
def source():
    return WebhookSource.objects.create(name="warehouse", secrets=[webhooks.new_secret()],
                                        allowed_types=["upstream.ready", "progress.external"],
                                        task_types=["demo.pipeline"], priority_ceiling=3)


@pytest.fixture
def task():
    return services.task_create(type="demo.pipeline", params={})


def post(task_id, body: dict, *, secret: str, msg_id="msg_1", when=None, source="warehouse", signature=None):
    raw = json.dumps(body)
    when = when or datetime.now(dt_timezone.utc)
    headers = {"HTTP_WEBHOOK_ID": msg_id, "HTTP_WEBHOOK_TIMESTAMP": str(int(when.timestamp())),
               "HTTP_WEBHOOK_SIGNATURE": signature or Webhook(secret).sign(msg_id, when, raw)}
    return Client().post(f"/api/hooks/{source}/tasks/{task_id}/events", raw, content_type="application/json",
                         **headers)


READY = {"type": "upstream.ready", "payload": {"resource": "orders.csv"}}


def test_a_signed_event_joins_the_inbox_and_a_redelivery_is_answered_not_applied(source, task):
    first = post(task.pk, READY, secret=source.secrets[0])
    assert first.status_code == 202, first.content
    event = InboundEvent.objects.get(pk=first.json()["event_id"])
    assert (event.source, event.source_event_id, event.priority, event.state) == (
        "webhook:warehouse", "msg_1", 3, "pending")
    again = post(task.pk, READY, secret=source.secrets[0])
    assert again.status_code == 200 and again.json()["duplicate"] is True
    assert InboundEvent.objects.filter(task=task).count() == 1
    assert WebhookSource.objects.get(pk=source.pk).last_used_at is not None


@pytest.mark.parametrize("case", ["wrong secret", "tampered body", "stale timestamp", "unknown source",
                                  "no signature"])
def test_a_bad_signature_is_401_audited_and_creates_nothing(case, source, task):
    secret = source.secrets[0]
    if case == "wrong secret":
        response = post(task.pk, READY, secret=webhooks.new_secret())
    elif case == "tampered body":
        when = datetime.now(dt_timezone.utc)
        signature = Webhook(secret).sign("msg_1", when, json.dumps({**READY, "payload": {"resource": "other"}}))
        response = post(task.pk, READY, secret=secret, when=when, signature=signature)
    elif case == "stale timestamp":
        response = post(task.pk, READY, secret=secret, when=datetime.now(dt_timezone.utc) - timedelta(seconds=400))
    elif case == "unknown source":
        response = post(task.pk, READY, secret=secret, source="nobody")
    else:
        response = post(task.pk, READY, secret=secret, signature="v1,")
    assert response.status_code == 401, response.content
    assert "signature" in response.json()["detail"]
    assert not InboundEvent.objects.exists()
    rejected = AuditEntry.objects.get(action="webhook.rejected")
    assert rejected.task_id == task.pk and rejected.ip == "127.0.0.1"


def test_a_rotated_secret_keeps_the_old_one_working_until_it_is_dropped(source, task):
    old = source.secrets[0]
    new = webhooks.rotate(source)
    assert post(task.pk, READY, secret=new, msg_id="a").status_code == 202
    assert post(task.pk, READY, secret=old, msg_id="b").status_code == 202
    for _ in range(webhooks.SECRETS_KEPT):
        webhooks.rotate(source)
    assert post(task.pk, READY, secret=old, msg_id="c").status_code == 401


def test_the_source_rules_bound_types_task_types_and_priority(source, task):
    secret = source.secrets[0]
    assert post(task.pk, {"type": "user.message", "payload": {"text": "hi"}}, secret=secret,
                msg_id="1").status_code == 422
    urgent = post(task.pk, {**READY, "priority": 1}, secret=secret, msg_id="2")
    assert urgent.status_code == 422 and "P3 at most" in urgent.json()["detail"]
    other = services.task_create(type="demo.migrate_rows", params={"rows": 10})
    assert post(other.pk, READY, secret=secret, msg_id="3").status_code == 403
    assert not InboundEvent.objects.exists()


def test_a_signed_body_holding_a_nul_character_is_refused_with_400_and_creates_nothing(source, task):
    """PostgreSQL stores no NUL in jsonb: the event's insert failed with a 500, which a sender retries."""
    response = post(task.pk, {"type": "upstream.ready", "payload": {"resource": "orders\x00.csv"}},
                    secret=source.secrets[0])
    assert response.status_code == 400, response.content
    assert "NUL character" in response.json()["detail"] and "payload.resource" in response.json()["detail"]
    assert not InboundEvent.objects.filter(task=task).exists()


@pytest.mark.parametrize("content_type", ["multipart/form-data", "multipart/form-data; boundary=xyz",
                                          "application/x-www-form-urlencoded"])
def test_a_form_body_is_answered_as_a_bad_signature_not_a_500(source, task, content_type):
    """Found by tests/api/test_schemathesis.py: a multipart body made the NUL check read the
    form from the stream, and the webhook's read of the raw body (for its signature) failed."""
    body = b"--xyz\r\nContent-Disposition: form-data; name=\"a\"\r\n\r\nb\r\n--xyz--\r\n" \
        if "boundary" in content_type else b"a=b"
    when = datetime.now(dt_timezone.utc)
    response = Client().generic("POST", f"/api/hooks/warehouse/tasks/{task.pk}/events", body,
                                content_type=content_type, HTTP_WEBHOOK_ID="msg_1",
                                HTTP_WEBHOOK_TIMESTAMP=str(int(when.timestamp())),
                                HTTP_WEBHOOK_SIGNATURE=Webhook(source.secrets[0]).sign("msg_1", when, "{}"))
    assert response.status_code == 401, response.content
    assert not InboundEvent.objects.filter(task=task).exists()
