"""Retries by a real process: the sweeper (`manage.py recover --loop`) sends what is due. A
receiver that fails (500, then no answer at all) gets the same message again, with the same
webhook-id, after waits that grow; one that never takes it is marked failed after the last
attempt and gets no more."""
import pytest
from django.db import transaction

from orchestrator.models import DeliveryStatus, NotificationDelivery
from orchestrator.notifications import REVIEW_OPENED
from tests.conftest import wait_for
from tests.notifications.conftest import subscribe
from tests.review.conftest import make_review

pytestmark = [pytest.mark.workers, pytest.mark.django_db(transaction=True)]

BACKOFF, TIMEOUT = 0.5, 1.0
SWEEPER_ENV = {"ORCH_NOTIFY_BACKOFF_SECONDS": BACKOFF, "ORCH_NOTIFY_TIMEOUT_SECONDS": TIMEOUT}


def test_a_failing_receiver_gets_retries_with_backoff_and_the_same_webhook_id(start_receiver, start_sweeper):
    receiver = start_receiver(script=[500, "hang", 200], hang_seconds=TIMEOUT + 5)
    subscribe(receiver)
    start_sweeper(ORCH_NOTIFY_ATTEMPTS=5, **SWEEPER_ENV)
    with transaction.atomic():
        item = make_review()
    delivery = NotificationDelivery.objects.get()
    wait_for(lambda: NotificationDelivery.objects.get().status == DeliveryStatus.DELIVERED, timeout=60,
             message="the delivery to go through on its third attempt")
    first, second, third = receiver.requests()
    assert [r.answer for r in (first, second, third)] == [500, "hang", 200]
    # The same message each time: one webhook-id, one body, each attempt signed anew and verified.
    assert {r.headers["webhook-id"] for r in (first, second, third)} == {delivery.message_id}
    assert first.body == second.body == third.body
    assert all(r.payload is not None and r.refusal == "" for r in (first, second, third))
    assert third.payload["type"] == REVIEW_OPENED and third.payload["data"]["item_id"] == item.pk
    # Backoff: the first retry waited at least BACKOFF after the refusal; the second waited out
    # the attempt's timeout and then twice as long.
    assert second.at - first.at >= BACKOFF
    assert third.at - second.at >= TIMEOUT + 2 * BACKOFF
    delivery.refresh_from_db()
    assert (delivery.attempts, delivery.last_status_code, delivery.last_error) == (3, 200, "")


def test_a_receiver_that_never_takes_it_is_marked_failed_after_the_last_attempt(start_receiver, start_sweeper):
    refusing = start_receiver(script=[503])
    healthy = start_receiver()
    subscribe(refusing, name="refusing")
    start_sweeper(ORCH_NOTIFY_ATTEMPTS=3, **SWEEPER_ENV)
    with transaction.atomic():
        make_review()
    wait_for(lambda: NotificationDelivery.objects.get().status == DeliveryStatus.FAILED, timeout=60,
             message="the delivery to be given up")
    failed = NotificationDelivery.objects.get()
    assert (failed.attempts, failed.last_status_code, failed.next_attempt_at) == (3, 503, None)
    assert failed.last_error == "HTTP 503: refused by the test receiver"
    # The courier goes on (a later event reaches a healthy subscriber), and the failed one is
    # not tried again.
    subscribe(healthy, name="healthy")
    with transaction.atomic():
        make_review(step_id="send-002")
    wait_for(lambda: len(healthy.requests()) == 1, timeout=30, message="the healthy receiver's delivery")
    ids = [r.headers["webhook-id"] for r in refusing.requests()]
    assert ids[:3] == [failed.message_id] * 3 and ids.count(failed.message_id) == 3
    assert NotificationDelivery.objects.get(pk=failed.pk).attempts == 3
