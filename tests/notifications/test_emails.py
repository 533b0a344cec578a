"""The people who can act are emailed (issue 21 item 4): reviewers for approvals and review
items, operators for needs_human, the escalation group for an expired approval; each alone,
with a link to the item; after the commit; never failing or holding up the caller for long."""
import time
from datetime import timedelta

import pytest
from django.contrib.auth.models import Group
from django.db import transaction
from django.utils import timezone

from orchestrator.engine import approvals, services, states
from orchestrator.llm.standin import StandinServer
from orchestrator.models import DeliveryStatus, NotificationDelivery, Task, TaskStatus as S
from orchestrator.notifications import APPROVAL_EXPIRED, APPROVAL_REQUESTED, notify, outbox
from review.models import ReviewItem
from review.services import review_decide
from tests.conftest import wait_for
from tests.notifications.conftest import PUBLIC_URL, subscribe
from tests.review.conftest import make_review
from tests.support.helpers import settle

pytestmark = pytest.mark.django_db(transaction=True)


def smtp_to(settings, port: int) -> None:
    settings.EMAIL_BACKEND = "django.core.mail.backends.smtp.EmailBackend"
    settings.EMAIL_HOST, settings.EMAIL_PORT = "127.0.0.1", port


def test_a_new_review_item_emails_each_reviewer_alone_with_its_link(people, public_url, mailoutbox):
    with transaction.atomic():
        item = make_review()
        assert mailoutbox == []  # not before the commit
    assert sorted(m.to[0] for m in mailoutbox) == ["rex@example.org", "rita@example.org"]
    assert all(len(m.to) == 1 and not m.cc and not m.bcc for m in mailoutbox)  # nobody sees the others
    message = mailoutbox[0]
    assert message.subject == f"[orchestrator] review needed: did email.send happen? (task #{item.task_id})"
    assert f"Open it: {PUBLIC_URL}/review/{item.pk}/" in message.body
    assert "worker host:1 stopped heartbeating mid-send" in message.body
    assert "hello" not in message.body  # the call's content stays behind the link


def test_needs_human_emails_the_operators_over_smtp(people, public_url, smtp_server, settings):
    smtp_to(settings, smtp_server.port)
    task = services.task_create(type="demo.notify", params={"recipients": ["a@example.org"], "subject": "s"})
    with transaction.atomic():
        states.transition(states.lock_task(task.pk), S.NEEDS_HUMAN, reason="step send-001 failed 3 times")
    [message] = smtp_server.messages
    assert message["To"] == "otto@example.org"
    assert message["Subject"] == f"[orchestrator] task #{task.pk} needs a human"
    text = message.get_payload()
    assert f"Open it: {PUBLIC_URL}/tasks/{task.pk}/" in text
    assert f"{PUBLIC_URL}/api/tasks/{task.pk}/export" in text
    assert "Reason: step send-001 failed 3 times" in text


def test_an_expired_approval_escalated_to_a_group_emails_that_group(people, public_url, mailoutbox, make_user):
    lead = make_user("lena")
    lead.groups.add(Group.objects.create(name="leads"))
    item = make_review()
    mailoutbox.clear()
    notify(APPROVAL_EXPIRED, task_id=item.task_id, item_id=item.pk, tool="email_send", role="leads",
           reason="nobody decided within 24 h")
    [message] = mailoutbox
    assert message.to == ["lena@example.org"]
    assert message.subject == f"[orchestrator] approval expired: email_send in task #{item.task_id}"
    assert f"{PUBLIC_URL}/review/{item.pk}/" in message.body and "'leads' group" in message.body


def test_an_approval_that_expires_into_an_escalation_tells_that_group_by_email_and_webhook(
        people, public_url, mailoutbox, make_user, start_receiver):
    from review.approvals import expire_due_approvals

    lead = make_user("lena")
    lead.groups.add(Group.objects.create(name="leads"))
    receiver = start_receiver()
    subscribe(receiver, events=[APPROVAL_EXPIRED])
    task = services.task_create(type="demo.notify", params={"recipients": ["a@example.org"], "subject": "s"})
    approval_id = approvals.request(task_id=task.pk, step_id="tool-1", tool="email_send", call_id="call-1",
                                    arguments={"to": ["x@example.org"], "subject": "hi", "body": "b"})
    ReviewItem.objects.filter(pk=approval_id).update(
        expires_at=timezone.now() - timedelta(seconds=1), on_expiry="escalate", escalate_to="leads")
    mailoutbox.clear()
    assert expire_due_approvals() == [approval_id]
    [message] = mailoutbox
    assert message.to == ["lena@example.org"]
    assert message.subject == f"[orchestrator] approval expired: email_send in task #{task.pk}"
    assert f"Open it: {PUBLIC_URL}/review/{approval_id}/" in message.body
    [(delivery_id, delivered)] = outbox.deliver_due()
    [request] = receiver.requests()
    assert delivered and request.payload["type"] == APPROVAL_EXPIRED
    data = request.payload["data"]
    assert (data["item_id"], data["role"], data["fallback"], data["url"]) == (
        approval_id, "leads", "escalate", f"{PUBLIC_URL}/review/{approval_id}/")


def test_a_mail_server_that_never_answers_neither_fails_nor_holds_up_the_step(people, silent_http, settings, caplog):
    smtp_to(settings, int(silent_http.url.split(":")[2].split("/")[0]))
    settings.EMAIL_TIMEOUT, settings.ORCH_NOTIFY_TIMEOUT_SECONDS = 30, 0.5
    task = services.task_create(type="demo.notify", params={"recipients": ["a@example.org"], "subject": "s"})
    started = time.monotonic()
    approval_id = approvals.request(task_id=task.pk, step_id="tool-1", tool="email_send", call_id="call-1",
                                    arguments={"to": ["x@example.org"], "subject": "hi", "body": "b"})
    assert time.monotonic() - started < 0.5 + 1.5  # its own short timeout, not EMAIL_TIMEOUT
    assert ReviewItem.objects.get(pk=approval_id).status == "open"
    assert "could not email the reviewer group" in caplog.text


@pytest.mark.workers
def test_an_approval_asked_by_a_real_agent_emails_the_reviewers_and_reaches_the_webhook_signed(
        people, start_workers, start_sweeper, smtp_server, start_receiver, tmp_path):
    receiver = start_receiver()
    subscription = subscribe(receiver, events=[APPROVAL_REQUESTED])
    env = {"EMAIL_HOST": "127.0.0.1", "EMAIL_PORT": smtp_server.port, "ORCH_PUBLIC_URL": PUBLIC_URL,
           "LLM_API_KEY": "standin", "LLM_MODEL": "standin-planner"}
    with StandinServer(token_seconds=0.0005) as model:
        start_workers(1, LLM_BASE_URL=model.base_url, **env)
        start_sweeper(**env)
        task = services.task_create(type="agent.plan_execute", actor=people["otto"],
                                    params={"goal": "Parse the 3 contracts and email a summary to ops@example.org",
                                            "tools": ["contracts_list", "contracts_read", "email_send"]})
        wait_for(lambda: ReviewItem.objects.filter(task=task, kind="approval").exists(), timeout=90,
                 message="the agent's email to wait for approval")
        [item] = ReviewItem.objects.filter(task=task, kind="approval")
        link = f"{PUBLIC_URL}/review/{item.pk}/"
        # The reviewers' emails, sent by the worker after its commit, over real SMTP.
        wait_for(lambda: len(smtp_server.messages) >= 2, timeout=30, message="the reviewers' emails")
        assert sorted(m["To"] for m in smtp_server.messages) == ["rex@example.org", "rita@example.org"]
        for message in smtp_server.messages:
            assert message["Subject"] == f"[orchestrator] approval needed: email_send in task #{task.pk}"
            assert f"Open it: {link}" in message.get_payload()
        # The webhook, signed, sent by the sweeper's courier.
        wait_for(lambda: receiver.requests(), timeout=30, message="the webhook")
        [request] = receiver.requests()
        assert request.payload is not None, request.refusal
        assert request.payload["type"] == APPROVAL_REQUESTED
        data = request.payload["data"]
        assert (data["task_id"], data["task_type"], data["item_id"], data["tool"], data["role"], data["url"]) == (
            task.pk, "agent.plan_execute", item.pk, "email_send", "reviewer", link)
        delivery = NotificationDelivery.objects.get(subscription=subscription)
        assert request.headers["webhook-id"] == delivery.message_id
        wait_for(lambda: NotificationDelivery.objects.get(pk=delivery.pk).status == DeliveryStatus.DELIVERED,
                 timeout=10, message="the delivery recorded")
        # The reviewer acts on it; the task goes on and the operator was never emailed about it.
        review_decide(item_id=item.pk, decision="approve", note="summary is fine", actor=people["rita"])
        assert settle(task.pk, timeout=90).status == "completed", Task.objects.get(pk=task.pk).status_reason
    assert "otto@example.org" not in [m["To"] for m in smtp_server.messages]
