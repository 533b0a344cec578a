"""Outgoing webhooks: one NotificationDelivery per event and subscription, signed with the
Standard Webhooks scheme (https://www.standardwebhooks.com; the `standardwebhooks` package)
and retried with exponential backoff.

- `queue` writes the rows in the transaction that creates the item (an outbox): a receiver
  hears of an item only if it was committed, and of every one that was, even if the process
  dies right after the commit.
- `deliver_due` sends what is due; the sweeper's courier thread calls it (courier.py), so
  neither a worker's step nor the sweep's recovery ever waits on a receiver.
- Each attempt is signed anew (webhook-timestamp is the attempt's time: receivers refuse old
  timestamps) under the same webhook-id, which is the receiver's key to drop duplicates.
- An attempt is claimed by a compare-and-set (attempts and next_attempt_at unchanged) that
  moves next_attempt_at past the attempt's timeout: two sweepers never send the same attempt,
  and an attempt cut by a crash is due again after that and sent with the same webhook-id.
- 2xx is delivered; anything else (3xx too: redirects are not followed), a timeout or a
  refused connection is a failed attempt: again after ORCH_NOTIFY_BACKOFF_SECONDS × 2^(n-1)
  (+ up to 10 % jitter, capped at 6 h), and `failed` after ORCH_NOTIFY_ATTEMPTS attempts.

Egress: only an admin can make a subscription (the admin site; orchestrator/admin.py), so its
URL may be anything an admin chooses, loopback and private addresses included (the agents'
egress policy, orchestrator/tools/egress.py, is for destinations a model chooses). What the
installation still bounds: each attempt's time (ORCH_NOTIFY_TIMEOUT_SECONDS, connect to last
byte), the response read (MAX_RESPONSE_BYTES; only its status and first bytes are kept), no
redirects followed, no proxy from the environment.

The secret signs and is never sent, stored in a delivery, or logged; the payload holds the
event's ids, tool name, reason (redacted) and link, never the call's arguments."""
import base64
import http.client
import json
import logging
import random
import secrets as random_secrets
import socket
import ssl
import threading
import time
import urllib.parse
import uuid
from contextlib import nullcontext
from datetime import datetime, timedelta, timezone as dt_timezone

from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone
from standardwebhooks.webhooks import Webhook

from ..models import DeliveryStatus, NotificationDelivery, NotificationSubscription
from ..primitives.redaction import redact_text
from .events import Notice

log = logging.getLogger(__name__)

MAX_RESPONSE_BYTES = 64 * 1024
KEPT_RESPONSE_CHARACTERS = 500
MAX_BACKOFF_SECONDS = 6 * 3600
CLAIM_MARGIN_SECONDS = 30
DUE_PER_PASS = 50
SECRET_BYTES = 32
USER_AGENT = "orchestrator-webhooks/1"


def new_secret() -> str:
    return "whsec_" + base64.b64encode(random_secrets.token_bytes(SECRET_BYTES)).decode()


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def takes(subscription: NotificationSubscription, event: str) -> bool:
    return not subscription.events or event in subscription.events


def payload(notice: Notice) -> dict:
    """The Standard Webhooks payload shape: type, timestamp, data."""
    return {"type": notice.event, "timestamp": notice.occurred_at.astimezone(dt_timezone.utc).isoformat(),
            "data": notice.data()}


def body(delivery: NotificationDelivery) -> str:
    """The exact text that is signed and sent: the same bytes on every attempt."""
    return json.dumps(delivery.payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def queue(notice: Notice) -> list[NotificationDelivery]:
    """A pending delivery for each enabled subscription that takes the event, in the caller's
    transaction. Never raises: inside a transaction the rows go in a savepoint, so a failure
    leaves the caller's transaction usable (PostgreSQL) and the item is created all the same."""
    try:
        with transaction.atomic() if connection.in_atomic_block else nullcontext():
            subscriptions = [s for s in NotificationSubscription.objects.filter(enabled=True) if takes(s, notice.event)]
            if not subscriptions:
                return []
            now, sent = timezone.now(), payload(notice)
            return NotificationDelivery.objects.bulk_create([
                NotificationDelivery(subscription=s, message_id=new_message_id(), event=notice.event, payload=sent,
                                     next_attempt_at=now) for s in subscriptions])
    except Exception:
        log.exception("webhook deliveries not queued", extra={"task_id": notice.task_id,
                                                              "notification_event": notice.event})
        return []


def prune(queued_before: datetime, *, limit: int) -> int:
    """Delete up to `limit` deliveries that are over (delivered, or given up) and were queued
    before `queued_before`, oldest first; a pending one is never deleted (retention's rule 4)."""
    over = NotificationDelivery.objects.filter(status__in=(DeliveryStatus.DELIVERED, DeliveryStatus.FAILED),
                                               created_at__lt=queued_before)
    ids = list(over.order_by("created_at").values_list("pk", flat=True)[:limit])
    return NotificationDelivery.objects.filter(pk__in=ids).delete()[0] if ids else 0


def backoff_seconds(attempts: int) -> float:
    """The wait after failed attempt number `attempts` (1 for the first)."""
    wait = settings.ORCH_NOTIFY_BACKOFF_SECONDS * 2 ** (attempts - 1)
    return min(MAX_BACKOFF_SECONDS, wait * (1 + random.uniform(0, 0.1)))


def signed_headers(delivery: NotificationDelivery, text: str, *, secret: str) -> dict[str, str]:
    seconds = int(time.time())
    signature = Webhook(secret).sign(delivery.message_id, datetime.fromtimestamp(seconds, tz=dt_timezone.utc), text)
    return {"webhook-id": delivery.message_id, "webhook-timestamp": str(seconds), "webhook-signature": signature}


def post(url: str, text: str, headers: dict[str, str], *, timeout: float) -> tuple[int, str]:
    """POST `text` to `url`; (status, the response's first characters). Raises OSError (a
    timeout, a refused connection) or http.client.HTTPException on a broken answer. The whole
    exchange, connect to last byte read, is cut at `timeout`: a socket timeout alone bounds
    each read, and a receiver that drips its headers a byte at a time would outlast it."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme == "https":
        conn = http.client.HTTPSConnection(parts.hostname, parts.port, timeout=timeout,
                                           context=ssl.create_default_context())
    elif parts.scheme == "http":
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    else:
        raise ValueError(f"not an http(s) URL (scheme {parts.scheme!r})")
    request_headers = {"Content-Type": "application/json", "User-Agent": USER_AGENT, **headers}
    if parts.username is not None:  # https://user:password@host/ : Basic authentication
        credentials = f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password or '')}"
        request_headers["Authorization"] = "Basic " + base64.b64encode(credentials.encode()).decode()
    cut = threading.Event()

    def cut_at_deadline():
        cut.set()
        if conn.sock is not None:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    timer = threading.Timer(timeout, cut_at_deadline)
    timer.daemon = True
    timer.start()
    try:
        conn.request("POST", urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, "")),
                     body=text.encode(), headers=request_headers)
        response = conn.getresponse()
        if 200 <= response.status < 300:
            return response.status, ""  # its status is the answer: the body is not read
        # A refusal's first bytes say why (kept in last_error): read until the cap or the deadline.
        received = bytearray()
        try:
            while len(received) < MAX_RESPONSE_BYTES and not cut.is_set():
                chunk = response.read1(MAX_RESPONSE_BYTES - len(received))
                if not chunk:
                    break
                received += chunk
        except (OSError, http.client.HTTPException):
            pass  # the status is known; a body cut short is still its first bytes
        return response.status, received.decode(errors="replace")[:KEPT_RESPONSE_CHARACTERS]
    except (OSError, http.client.HTTPException):
        if cut.is_set():
            raise TimeoutError(f"no complete answer within {timeout:g} s") from None
        raise
    finally:
        timer.cancel()
        conn.close()


def attempt(delivery: NotificationDelivery) -> bool:
    """One attempt of a claimed delivery, its outcome recorded; True when delivered."""
    subscription = delivery.subscription
    number = delivery.attempts + 1
    status_code, error = None, ""
    try:
        text = body(delivery)
        try:
            headers = signed_headers(delivery, text, secret=subscription.secret)
        except Exception:
            raise ValueError("the subscription's secret is not a whsec_<base64> secret") from None
        status_code, answer = post(subscription.url, text, headers, timeout=settings.ORCH_NOTIFY_TIMEOUT_SECONDS)
        if not 200 <= status_code < 300:
            error = f"HTTP {status_code}: {answer}".strip()
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    now = timezone.now()
    delivered = status_code is not None and not error
    fields = {"attempts": number, "last_status_code": status_code, "last_error": redact_text(error)[:2000]}
    if delivered:
        fields.update(status=DeliveryStatus.DELIVERED, delivered_at=now, next_attempt_at=None)
    elif number >= settings.ORCH_NOTIFY_ATTEMPTS:
        fields.update(status=DeliveryStatus.FAILED, next_attempt_at=None)
    else:
        fields.update(next_attempt_at=now + timedelta(seconds=backoff_seconds(number)))
    NotificationDelivery.objects.filter(pk=delivery.pk, attempts=delivery.attempts).update(**fields)
    extra = {"delivery_id": delivery.pk, "subscription": subscription.name, "notification_event": delivery.event,
             "attempt": number, "status_code": status_code}
    if delivered:
        log.info("webhook delivered", extra=extra)
    elif fields.get("status") == DeliveryStatus.FAILED:
        log.warning("webhook delivery failed after %d attempts: %s", number, fields["last_error"][:200], extra=extra)
    else:
        log.info("webhook attempt failed, retrying at %s: %s", fields["next_attempt_at"].isoformat(),
                 fields["last_error"][:200], extra=extra)
    return delivered


def claim(delivery: NotificationDelivery) -> bool:
    until = timezone.now() + timedelta(seconds=settings.ORCH_NOTIFY_TIMEOUT_SECONDS + CLAIM_MARGIN_SECONDS)
    return bool(NotificationDelivery.objects.filter(
        pk=delivery.pk, status=DeliveryStatus.PENDING, attempts=delivery.attempts,
        next_attempt_at=delivery.next_attempt_at).update(next_attempt_at=until))


def deliver_due(now=None, limit: int = DUE_PER_PASS) -> list[tuple[int, bool]]:
    """Send the deliveries that are due (oldest first); (delivery id, delivered) for each sent.
    A subscription whose attempt fails gets no second one in the same pass, so one receiver
    that times out delays the others by one timeout per pass, not one per delivery."""
    now = now or timezone.now()
    due = (NotificationDelivery.objects.filter(status=DeliveryStatus.PENDING, next_attempt_at__lte=now,
                                               subscription__enabled=True)
           .select_related("subscription").order_by("next_attempt_at", "id")[:limit])
    failing: set[int] = set()
    outcomes = []
    for delivery in due:
        if delivery.subscription_id in failing or not claim(delivery):
            continue
        delivered = attempt(delivery)
        outcomes.append((delivery.pk, delivered))
        if not delivered:
            failing.add(delivery.subscription_id)
    return outcomes


def deliver_again(deliveries) -> int:
    """An admin's "deliver again": each as new (its attempts from zero), with its webhook-id."""
    return NotificationDelivery.objects.filter(pk__in=[d.pk for d in deliveries]).update(
        status=DeliveryStatus.PENDING, attempts=0, next_attempt_at=timezone.now(), delivered_at=None)
