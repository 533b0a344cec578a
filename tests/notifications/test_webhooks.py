"""Outgoing webhooks (issue 21 item 4): each event reaches each subscriber as a Standard
Webhooks message that a receiver verifies with the `standardwebhooks` package; written with the
item (nothing for an item rolled back); bounded in time and in what is read back."""
import json
import socket
import threading
import time
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.utils import timezone
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from orchestrator.models import DeliveryStatus, NotificationDelivery, NotificationSubscription
from orchestrator.notifications import APPROVAL_REQUESTED, REVIEW_OPENED, TASK_NEEDS_HUMAN, notify, outbox
from tests.notifications.conftest import subscribe
from tests.review.conftest import make_review

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_review_item_reaches_the_subscriber_signed_and_verified(start_receiver, public_url):
    receiver = start_receiver()
    subscribe(receiver)
    with transaction.atomic():
        item = make_review(to="customer@example.org")
    [delivery] = NotificationDelivery.objects.all()
    assert (delivery.status, delivery.attempts, delivery.event) == (DeliveryStatus.PENDING, 0, REVIEW_OPENED)

    assert outbox.deliver_due() == [(delivery.pk, True)]

    [request] = receiver.requests()
    assert request.refusal == "" and request.payload is not None  # Webhook.verify accepted it
    assert request.headers["webhook-id"] == delivery.message_id
    assert request.headers["content-type"] == "application/json"
    assert abs(int(request.headers["webhook-timestamp"]) - time.time()) < 60
    assert request.payload["type"] == REVIEW_OPENED
    assert request.payload["data"] == {
        "task_id": item.task_id, "task_type": "demo.notify", "task_status": "awaiting_review", "item_id": item.pk,
        "tool": "email.send", "role": "reviewer", "url": f"{public_url}/review/{item.pk}/",
        "reason": "worker host:1 stopped heartbeating mid-send"}
    # What the call was about (the recipient, the body) is not told: the link leads to it.
    assert b"customer@example.org" not in request.body and b"hello" not in request.body
    # Signed with this receiver's secret and no other.
    with pytest.raises(WebhookVerificationError):
        Webhook(outbox.new_secret()).verify(request.body, request.headers)
    delivery.refresh_from_db()
    assert (delivery.status, delivery.attempts, delivery.last_status_code) == (DeliveryStatus.DELIVERED, 1, 200)
    assert delivery.delivered_at is not None and delivery.next_attempt_at is None
    assert outbox.deliver_due() == []  # delivered once


def test_nothing_is_told_of_an_item_whose_transaction_rolled_back(start_receiver, people, mailoutbox):
    subscribe(start_receiver())

    class Undone(Exception):
        pass

    with pytest.raises(Undone), transaction.atomic():
        make_review()
        assert NotificationDelivery.objects.count() == 1  # written with the item...
        raise Undone
    assert NotificationDelivery.objects.count() == 0  # ...and gone with it
    assert mailoutbox == []  # the email waits for the commit


def test_each_subscription_gets_the_events_it_takes_and_a_disabled_one_none(start_receiver):
    everything = subscribe(start_receiver(), name="everything")
    approvals = subscribe(start_receiver(), name="approvals", events=[APPROVAL_REQUESTED])
    subscribe(start_receiver(), name="off", enabled=False)
    item = make_review()
    with transaction.atomic():
        notify(APPROVAL_REQUESTED, task_id=item.task_id, item_id=item.pk, tool="email_send")
        notify(TASK_NEEDS_HUMAN, task_id=item.task_id)
    got = sorted(NotificationDelivery.objects.values_list("subscription__name", "event"))
    assert got == sorted([("everything", REVIEW_OPENED), ("everything", APPROVAL_REQUESTED),
                          ("everything", TASK_NEEDS_HUMAN), ("approvals", APPROVAL_REQUESTED)])
    assert len(set(NotificationDelivery.objects.values_list("message_id", flat=True))) == 4
    assert everything.deliveries.count() == 3 and approvals.deliveries.count() == 1


def test_an_unknown_event_or_a_broken_subscription_table_never_fails_the_caller(caplog):
    item = make_review()
    assert notify("approval.forgotten", task_id=item.task_id) is None
    assert "unknown notification event" in caplog.text
    # The outbox's insert fails inside the caller's transaction (a table that is not there):
    # the caller's transaction goes on and commits (a savepoint on PostgreSQL).
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute(f"ALTER TABLE {NotificationSubscription._meta.db_table} RENAME TO notify_away")
        try:
            assert notify(TASK_NEEDS_HUMAN, task_id=item.task_id) is not None
            NotificationDelivery.objects.filter(pk=-1).update(attempts=1)  # the transaction still works
        finally:
            with connection.cursor() as cursor:
                cursor.execute(f"ALTER TABLE notify_away RENAME TO {NotificationSubscription._meta.db_table}")
    assert "webhook deliveries not queued" in caplog.text


class RawServer:
    """A TCP server whose each connection is handled by `respond(conn)` (after reading the request)."""

    def __init__(self, respond):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.respond, self.stopped, self.conns = respond, threading.Event(), []
        threading.Thread(target=self.serve, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}/hook"

    def serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self.handle, args=(conn,), daemon=True).start()

    def handle(self, conn):
        data = b""
        try:
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            self.respond(conn, self.stopped)
        except OSError:
            pass

    def stop(self):
        self.stopped.set()
        self.sock.close()
        for conn in self.conns:
            conn.close()


def flood(conn, stopped):
    conn.sendall(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 100000000\r\n\r\n")
    chunk = b"x" * 65536
    while not stopped.is_set():
        conn.sendall(chunk)


def drip(conn, stopped):
    for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"y" * 10_000:
        if stopped.wait(0.1):
            return
        conn.sendall(bytes([byte]))


def attempt_against(url: str) -> tuple[NotificationDelivery, float]:
    item = make_review()
    NotificationSubscription.objects.create(name="raw", url=url, secret=outbox.new_secret())
    with transaction.atomic():
        notify(APPROVAL_REQUESTED, task_id=item.task_id, item_id=item.pk)
    started = time.monotonic()
    assert outbox.deliver_due() == [(NotificationDelivery.objects.get().pk, False)]
    return NotificationDelivery.objects.get(), time.monotonic() - started


@pytest.mark.parametrize("respond", [flood, drip])
def test_a_receiver_that_floods_or_drips_is_cut_at_the_cap_or_the_timeout(respond, settings):
    settings.ORCH_NOTIFY_TIMEOUT_SECONDS = 1.0
    server = RawServer(respond)
    try:
        delivery, took = attempt_against(server.url)
    finally:
        server.stop()
    assert took < 1.0 + 1.5  # the whole exchange, not each read, is bounded
    assert delivery.status == DeliveryStatus.PENDING and delivery.attempts == 1  # retried later
    if respond is flood:
        # Read up to the cap, long before the body's end; its first bytes are kept.
        assert delivery.last_status_code == 500
        assert delivery.last_error.startswith("HTTP 500: xxxx") and len(delivery.last_error) < 600
    else:
        assert delivery.last_status_code is None
        assert delivery.last_error == "TimeoutError: no complete answer within 1 s"


def test_a_refused_connection_and_a_redirect_are_failed_attempts(start_receiver):
    receiver = start_receiver(script=[302])
    port = socket.create_server(("127.0.0.1", 0))
    closed_url = f"http://127.0.0.1:{port.getsockname()[1]}/hook"
    port.close()
    item = make_review()
    NotificationSubscription.objects.create(name="closed", url=closed_url, secret=outbox.new_secret())
    subscribe(receiver, name="redirects")
    with transaction.atomic():
        notify(TASK_NEEDS_HUMAN, task_id=item.task_id)
    outcomes = outbox.deliver_due()
    assert len(outcomes) == 2 and not any(delivered for _, delivered in outcomes)
    errors = dict(NotificationDelivery.objects.filter(event=TASK_NEEDS_HUMAN).values_list("subscription__name",
                                                                                          "last_error"))
    assert errors["closed"].startswith("ConnectionRefusedError")
    assert errors["redirects"] == "HTTP 302: refused by the test receiver"


def test_two_couriers_never_send_the_same_attempt(start_receiver):
    receiver = start_receiver()
    subscribe(receiver)
    item = make_review()
    for _ in range(15):
        notify(APPROVAL_REQUESTED, task_id=item.task_id, item_id=item.pk)
    start = threading.Barrier(2)

    def courier():
        start.wait()
        try:
            outbox.deliver_due()
        finally:
            connection.close()

    threads = [threading.Thread(target=courier) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    ids = [r.headers["webhook-id"] for r in receiver.requests()]
    assert len(ids) == 16 and len(set(ids)) == 16
    assert set(NotificationDelivery.objects.values_list("status", "attempts")) == {(DeliveryStatus.DELIVERED, 1)}


def test_the_backoff_doubles_from_the_setting_and_is_capped(settings):
    settings.ORCH_NOTIFY_BACKOFF_SECONDS = 30
    waits = [outbox.backoff_seconds(n) for n in range(1, 8)]
    for n, wait in enumerate(waits, start=1):
        assert 30 * 2 ** (n - 1) <= wait <= 30 * 2 ** (n - 1) * 1.1
    assert outbox.backoff_seconds(30) == outbox.MAX_BACKOFF_SECONDS


def test_a_delivery_not_due_yet_is_not_sent(start_receiver):
    receiver = start_receiver()
    subscribe(receiver)
    make_review()
    NotificationDelivery.objects.update(next_attempt_at=timezone.now() + timedelta(minutes=5))
    assert outbox.deliver_due() == [] and receiver.requests() == []
    body = json.loads(outbox.body(NotificationDelivery.objects.get()))
    assert body["type"] == REVIEW_OPENED
