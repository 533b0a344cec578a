"""Webhooks (issue 19, item 8): forged requests cannot grow the audit log without bound —
each client address and each source's verified requests are rate-limited (429 with
Retry-After, nothing written), repeated rejections raise a counter on one row, and only a
short prefix of what the sender chose is kept; a leaked secret can be revoked at once."""
import json
from datetime import datetime, timezone as dt_timezone

import pytest
from django.contrib.auth.models import User
from django.core.cache import caches
from django.test import Client
from django.urls import reverse
from standardwebhooks.webhooks import Webhook

from orchestrator.engine import services, webhooks
from orchestrator.models import AuditEntry, InboundEvent, WebhookRejection, WebhookSource

pytestmark = pytest.mark.django_db

READY = {"type": "upstream.ready", "payload": {"resource": "orders.csv"}}


@pytest.fixture(autouse=True)
def fresh_rate_counts():
    caches["ratelimit"].clear()  # counts of other tests (transactional ones are not rolled back)
    yield
    caches["ratelimit"].clear()


@pytest.fixture
def source():
    return WebhookSource.objects.create(name="warehouse", secrets=[webhooks.new_secret()],
                                        allowed_types=["upstream.ready"], task_types=["demo.pipeline"],
                                        priority_ceiling=3)


@pytest.fixture
def task():
    return services.task_create(type="demo.pipeline", params={})


def post(task_id, body=READY, *, secret=None, msg_id="msg_1", source="warehouse", address="203.0.113.7",
         extra_headers=None):
    raw = json.dumps(body)
    when = datetime.now(dt_timezone.utc)
    signature = Webhook(secret).sign(msg_id, when, raw) if secret else "v1,AAAA"
    headers = {"HTTP_WEBHOOK_ID": msg_id, "HTTP_WEBHOOK_TIMESTAMP": str(int(when.timestamp())),
               "HTTP_WEBHOOK_SIGNATURE": signature, **(extra_headers or {})}
    return Client(REMOTE_ADDR=address).post(f"/api/hooks/{source}/tasks/{task_id}/events", raw,
                                             content_type="application/json", **headers)


def test_repeated_forgeries_raise_a_counter_on_one_row_and_write_one_audit_entry(source, task):
    for i in range(25):
        assert post(task.pk, msg_id=f"forged-{i}").status_code == 401
    [row] = WebhookRejection.objects.all()
    assert (row.source, row.reason, row.ip, row.count) == ("warehouse", "bad signature or timestamp",
                                                           "203.0.113.7", 25)
    assert row.last_webhook_id == "forged-24" and row.last_task_id == task.pk
    [entry] = AuditEntry.objects.filter(action="webhook.rejected")
    assert entry.ip == "203.0.113.7" and entry.after["rejection_id"] == row.pk
    # Another address, or another reason, is another row (and one more audit entry).
    assert post(task.pk, address="198.51.100.9").status_code == 401
    assert post(task.pk, source="nobody").status_code == 401
    assert post(task.pk, source="someone-else").status_code == 401  # unknown names share one row per address
    assert WebhookRejection.objects.count() == 3
    assert AuditEntry.objects.filter(action="webhook.rejected").count() == 3
    assert WebhookRejection.objects.get(source="", ip="203.0.113.7").count == 2
    assert not InboundEvent.objects.exists()


def test_only_a_short_prefix_of_attacker_chosen_headers_is_kept(source, task):
    huge = "x" * 6000
    assert post(task.pk, msg_id=huge, extra_headers={"HTTP_USER_AGENT": "y" * 6000}).status_code == 401
    row = WebhookRejection.objects.get()
    assert len(row.last_webhook_id) == 200 and len(row.last_user_agent) == 200
    entry = AuditEntry.objects.get(action="webhook.rejected")
    assert len(json.dumps(entry.after)) < 600 and len(entry.reason) < 300


def test_an_address_past_the_rate_gets_429_with_retry_after_and_nothing_is_written(settings, source, task):
    settings.ORCH_WEBHOOK_RATE = "5/h"  # per hour: no window boundary falls inside the test
    answers = [post(task.pk, msg_id=f"forged-{i}") for i in range(8)]
    assert [a.status_code for a in answers] == [401] * 5 + [429] * 3
    limited = answers[-1]
    assert 1 <= int(limited["Retry-After"]) <= 3600
    assert "ORCH_WEBHOOK_RATE" in limited.json()["detail"]
    assert WebhookRejection.objects.get().count == 5  # the refused requests wrote nothing
    assert AuditEntry.objects.filter(action="webhook.rejected").count() == 1
    # Another address is counted apart, and a genuine sender there is served.
    assert post(task.pk, secret=source.secrets[0], address="198.51.100.9").status_code == 202


def test_a_source_s_verified_requests_are_limited_across_addresses(settings, source, task):
    settings.ORCH_WEBHOOK_RATE = "3/h"
    codes = [post(task.pk, secret=source.secrets[0], msg_id=f"m{i}", address=f"198.51.100.{i}").status_code
             for i in range(5)]
    assert codes == [202, 202, 202, 429, 429]
    assert InboundEvent.objects.filter(task=task).count() == 3  # the refused ones were not sent


def test_forgeries_naming_a_source_do_not_use_up_its_rate(settings, source, task):
    settings.ORCH_WEBHOOK_RATE = "3/h"
    for i in range(6):
        post(task.pk, msg_id=f"forged-{i}", address=f"192.0.2.{i}")
    assert post(task.pk, secret=source.secrets[0], address="198.51.100.1").status_code == 202


# --- revoke now --------------------------------------------------------------------------------

def test_revoke_now_refuses_the_old_secrets_at_once_and_is_audited(source, task):
    leaked = source.secrets[0]
    webhooks.rotate(source)  # a rotation keeps the old one working...
    assert post(task.pk, secret=leaked, msg_id="a").status_code == 202
    admin_user = User.objects.create_superuser("root", "root@example.org", "pw")
    new = webhooks.revoke_now(source, actor=admin_user, ip="10.0.0.1")
    assert post(task.pk, secret=leaked, msg_id="b").status_code == 401  # ...revoke now does not
    assert post(task.pk, secret=new, msg_id="c").status_code == 202
    assert WebhookSource.objects.get(pk=source.pk).secrets == [new]
    entry = AuditEntry.objects.get(action="webhook_source.revoke")
    assert entry.actor == admin_user and entry.after == {"name": "warehouse", "secrets_revoked": 2, "secrets_kept": 1}
    assert new not in json.dumps(entry.after) + entry.reason


def test_the_admin_s_revoke_action_shows_the_new_secret_once(client, source, task):
    leaked = source.secrets[0]
    client.force_login(User.objects.create_superuser("root", "root@example.org", "pw"))
    changelist = reverse("admin:orchestrator_webhooksource_changelist")
    assert "revoke_secrets_now" in client.get(changelist).content.decode()
    response = client.post(changelist, {"action": "revoke_secrets_now", "_selected_action": [source.pk]}, follow=True)
    [new] = WebhookSource.objects.get(pk=source.pk).secrets
    assert new != leaked and new in response.content.decode()
    assert post(task.pk, secret=leaked, msg_id="x").status_code == 401
    assert post(task.pk, secret=new, msg_id="y").status_code == 202
    assert AuditEntry.objects.filter(action="webhook_source.revoke").count() == 1


@pytest.mark.django_db(transaction=True)
def test_the_rate_is_counted_across_web_processes(start_web, source, task):
    """Two real web servers: the limit is the installation's, not each process's (the
    counts are in a cache both share; a per-process cache would let through twice as many)."""
    import requests

    ports = [start_web(ORCH_WEBHOOK_RATE="4/h")[1] for _ in range(2)]
    raw = json.dumps(READY)
    headers = {"Content-Type": "application/json", "webhook-id": "forged", "webhook-timestamp": "1",
               "webhook-signature": "v1,AAAA"}
    codes = [requests.post(f"http://127.0.0.1:{ports[i % 2]}/api/hooks/warehouse/tasks/{task.pk}/events", data=raw,
                           headers=headers, timeout=30).status_code for i in range(6)]
    assert codes == [401, 401, 401, 401, 429, 429]
    assert WebhookRejection.objects.get().count == 4
