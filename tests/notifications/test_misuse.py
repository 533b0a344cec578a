"""Misuse: a subscription's secret signs and is never sent, stored in a delivery, logged or shown
again; only admins (superusers) can see or change subscriptions and deliveries, whatever model
permissions a staff user was given."""
import logging
import re

import pytest
from django.contrib.auth.models import Permission, User
from django.db import transaction
from django.test import Client

from orchestrator.models import DeliveryStatus, NotificationDelivery, NotificationSubscription
from orchestrator.notifications import outbox
from tests.conftest import wait_for
from tests.notifications.conftest import subscribe
from tests.review.conftest import make_review

pytestmark = pytest.mark.django_db(transaction=True)

ADMIN_PAGES = ("/admin/orchestrator/notificationsubscription/", "/admin/orchestrator/notificationsubscription/add/",
               "/admin/orchestrator/notificationsubscription/{sub}/change/",
               "/admin/orchestrator/notificationsubscription/{sub}/delete/",
               "/admin/orchestrator/notificationdelivery/", "/admin/orchestrator/notificationdelivery/{delivery}/change/")


def forms_of(secret: str) -> list[str]:
    return [secret, secret.removeprefix("whsec_")]


@pytest.mark.workers
def test_the_secret_is_never_sent_stored_in_a_delivery_or_logged(start_receiver, start_sweeper, caplog):
    caplog.set_level(logging.DEBUG)
    receiver = start_receiver(script=[500, 200])
    good = subscribe(receiver, name="good")
    # A malformed secret (pasted in the database by hand): its error must not quote it.
    broken = NotificationSubscription.objects.create(name="broken", url=receiver.url,
                                                     secret="whsec_secret-words-XY")
    sweeper = start_sweeper(ORCH_NOTIFY_BACKOFF_SECONDS=0.2, ORCH_NOTIFY_ATTEMPTS=2, ORCH_LOG_LEVEL="DEBUG")
    with transaction.atomic():
        make_review()
    wait_for(lambda: set(NotificationDelivery.objects.values_list("status", flat=True)) == {
        DeliveryStatus.DELIVERED, DeliveryStatus.FAILED}, timeout=60, message="one delivered, one given up")
    assert NotificationDelivery.objects.get(subscription=broken).last_error == (
        "ValueError: the subscription's secret is not a whsec_<base64> secret")
    assert len(receiver.requests()) == 2  # the broken one never left
    # The sweeper logs an attempt after committing its status: the line may trail the row.
    wait_for(lambda: all(line in sweeper.output() + caplog.text
                         for line in ("webhook delivered", "retrying at", "failed after 2 attempts")),
             timeout=10, message="the three attempts' log lines")
    logs = sweeper.output() + caplog.text
    stored = "".join(f"{d.payload}{d.last_error}{d.message_id}" for d in NotificationDelivery.objects.all())
    sent = b"".join(r.body + repr(r.headers).encode() for r in receiver.requests()).decode()
    for secret in forms_of(good.secret) + forms_of(broken.secret) + ["secret-words"]:
        assert secret not in logs and secret not in stored and secret not in sent


def admin_client(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def test_an_admin_makes_a_subscription_and_sees_its_secret_once(make_user):
    admin = make_user("ada", superuser=True)
    client = admin_client(admin)
    form = client.get("/admin/orchestrator/notificationsubscription/add/").content.decode()
    assert 'name="url"' in form and 'name="events"' in form and 'name="secret"' not in form
    answer = client.post("/admin/orchestrator/notificationsubscription/add/", {
        "name": "pager", "url": "http://127.0.0.1:9/hook", "events": ["approval.requested", "task.needs_human"],
        "enabled": "on", "_save": "Save"}, follow=True)
    subscription = NotificationSubscription.objects.get(name="pager")
    assert re.fullmatch(r"whsec_[A-Za-z0-9+/]{43}=", subscription.secret)
    assert subscription.events == ["approval.requested", "task.needs_human"]
    assert answer.content.decode().count(subscription.secret) == 1  # shown this once
    for page in (f"/admin/orchestrator/notificationsubscription/{subscription.pk}/change/",
                 "/admin/orchestrator/notificationsubscription/"):
        text = client.get(page).content.decode()
        assert "pager" in text and all(form not in text for form in forms_of(subscription.secret))
    # Saving it again (no secret field) keeps its secret.
    client.post(f"/admin/orchestrator/notificationsubscription/{subscription.pk}/change/", {
        "name": "pager", "url": "http://127.0.0.1:9/hook", "events": [], "enabled": "on", "_save": "Save"})
    assert NotificationSubscription.objects.get(pk=subscription.pk).secret == subscription.secret


def test_a_subscription_url_must_be_http_or_https(make_user):
    client = admin_client(make_user("ada", superuser=True))
    answer = client.post("/admin/orchestrator/notificationsubscription/add/", {
        "name": "files", "url": "ftp://files.example.org/drop", "enabled": "on", "_save": "Save"})
    assert answer.status_code == 200 and "errorlist" in answer.content.decode()
    assert not NotificationSubscription.objects.exists()


def test_non_admins_cannot_see_or_change_subscriptions_or_deliveries(make_user, start_receiver):
    subscription = subscribe(start_receiver())
    make_review()
    delivery = NotificationDelivery.objects.get()
    pages = [p.format(sub=subscription.pk, delivery=delivery.pk) for p in ADMIN_PAGES]
    # A staff user holding every model permission on both: still refused.
    staff = User.objects.create_user("stan", "stan@example.org", "pw", is_staff=True)
    staff.user_permissions.set(Permission.objects.filter(
        content_type__model__in=["notificationsubscription", "notificationdelivery"]))
    client = admin_client(staff)
    for page in pages:
        assert client.get(page).status_code == 403, page
    assert client.post(pages[1], {"name": "mine", "url": "http://127.0.0.1:9/", "enabled": "on"}).status_code == 403
    assert client.post(pages[3], {"post": "yes"}).status_code == 403
    assert "Notification subscriptions" not in client.get("/admin/").content.decode()
    # Reviewers and operators (not staff) are sent to the admin's login.
    for role in ("reviewer", "operator"):
        answer = admin_client(make_user(f"{role}-user", role)).get(pages[0])
        assert answer.status_code == 302 and "/admin/login/" in answer["Location"]
    assert NotificationSubscription.objects.get().url == subscription.url and NotificationSubscription.objects.count() == 1
    # An admin sees both lists, with the delivery's status and attempts.
    admin = admin_client(make_user("ada", superuser=True))
    assert all(admin.get(page).status_code == 200 for page in pages)
    listing = admin.get(pages[4]).content.decode()
    assert "review.opened" in listing and "pending" in listing


def test_an_admin_delivers_a_failed_delivery_again_under_its_webhook_id(make_user, start_receiver):
    receiver = start_receiver()
    subscribe(receiver)
    make_review()
    NotificationDelivery.objects.update(status=DeliveryStatus.FAILED, attempts=8, next_attempt_at=None)
    delivery = NotificationDelivery.objects.get()
    admin = admin_client(make_user("ada", superuser=True))
    admin.post("/admin/orchestrator/notificationdelivery/", {"action": "deliver_again",
                                                            "_selected_action": [delivery.pk]})
    assert outbox.deliver_due() == [(delivery.pk, True)]
    assert [r.headers["webhook-id"] for r in receiver.requests()] == [delivery.message_id]
