"""Signed events from outside systems: `POST /api/hooks/{source}/tasks/{id}/events`.

The Standard Webhooks scheme (the `standardwebhooks` package): `webhook-id` (becomes the
event's `source_event_id`, so a redelivery is answered, not applied twice),
`webhook-timestamp` (within ±300 s) and `webhook-signature: v1,<base64 HMAC-SHA256(secret,
"{id}.{timestamp}.{body}")>`, several space-separated values allowed. The signature is
checked over the raw body before anything is parsed, with a constant-time compare, against
each of the source's secrets (rotation; `revoke_now` drops every secret but a new one). A
bad signature — or an unknown or disabled source, which answers the same so as not to tell
which names exist — is 401 and no event.

Forged requests must not cost more than they can carry: each client address, and each
source's verified requests, get ORCH_WEBHOOK_RATE (django-ratelimit, counted in the cache
settings.CACHES["ratelimit"] that every web process shares); past it, 429 with Retry-After
and nothing written. A rejection is counted on one WebhookRejection row per source, reason
and address within REJECTION_WINDOW (an audit entry for the first only), keeping at most a
short prefix of what the sender chose.
"""
import base64
import logging
import secrets as random_secrets
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import F
from django.utils import timezone
from django_ratelimit.core import get_usage
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from ..models import Task, WebhookRejection, WebhookSource
from ..primitives import jsonlimits
from . import inbox
from .audit import audit

log = logging.getLogger(__name__)

SECRET_BYTES = 32
SECRETS_KEPT = 3  # rotating adds one; the oldest beyond this is dropped
REJECTION_WINDOW = timedelta(hours=1)  # repeats within it raise one row's count
KEPT_CHARS = 200  # of a header the sender chose, in a rejection record


class WebhookRejected(inbox.InboxRefused):
    pass


def new_secret() -> str:
    return "whsec_" + base64.b64encode(random_secrets.token_bytes(SECRET_BYTES)).decode()


def rotate(source: WebhookSource) -> str:
    """A new secret for `source` (the older ones keep working until dropped); shown once."""
    secret = new_secret()
    source.secrets = [secret, *source.secrets][:SECRETS_KEPT]
    source.save(update_fields=["secrets"])
    return secret


def revoke_now(source: WebhookSource, *, actor=None, ip: str | None = None) -> str:
    """A new secret for `source`, and every previous one refused from now on (a leaked
    secret: `rotate` would keep it working until dropped). Audited; the new secret is shown once."""
    secret = new_secret()
    with transaction.atomic():
        source = WebhookSource.objects.select_for_update().get(pk=source.pk)
        revoked = len(source.secrets)
        source.secrets = [secret]
        source.save(update_fields=["secrets"])
        audit(action="webhook_source.revoke", actor=actor, ip=ip,
              reason=f"{revoked} previous secret(s) revoked at once",
              after={"name": source.name, "secrets_revoked": revoked, "secrets_kept": 1})
    log.warning("webhook secrets revoked", extra={"source": source.name})
    return secret


def _throttle(bucket: str, value: str, what: str) -> None:
    """Count a request in `bucket` for `value`; past ORCH_WEBHOOK_RATE, 429 with Retry-After."""
    rate = settings.ORCH_WEBHOOK_RATE
    usage = get_usage(None, group=f"webhook.{bucket}", key=lambda group, request: value, rate=rate, increment=True)
    if usage and usage["should_limit"]:
        retry_after = max(1, int(usage["time_left"]))
        raise WebhookRejected(429, f"Too many webhook requests {what} (at most {rate}, setting ORCH_WEBHOOK_RATE): "
                                   f"retry in {retry_after} s.", retry_after=retry_after)


def _record_rejection(*, source: WebhookSource | None, asked_for: str, why: str, task_id: int, headers: dict,
                      ip: str | None) -> None:
    """One row per source, reason and address within REJECTION_WINDOW: a repeat raises its
    count; only the first is an audit entry."""
    now = timezone.now()
    name = source.name if source is not None else ""
    latest = {"last_at": now, "last_task_id": task_id if 0 < task_id < 2**63 else None,
              "last_webhook_id": str(headers.get("webhook-id", ""))[:KEPT_CHARS],
              "last_user_agent": str(headers.get("user-agent", ""))[:KEPT_CHARS]}
    with transaction.atomic():
        row_id = (WebhookRejection.objects.filter(source=name, reason=why, ip=ip, last_at__gte=now - REJECTION_WINDOW)
                  .order_by("-last_at").values_list("pk", flat=True).first())
        if row_id is not None:
            WebhookRejection.objects.filter(pk=row_id).update(count=F("count") + 1, **latest)
            return
        row = WebhookRejection.objects.create(source=name, asked_for=asked_for[:60], reason=why, ip=ip, **latest)
        audit(action="webhook.rejected", ip=ip, task=Task.objects.filter(pk=latest["last_task_id"] or 0).first(),
              reason=f"{asked_for[:60]}: {why} (repeats within {int(REJECTION_WINDOW.total_seconds()) // 60} min "
                     f"are counted on webhook rejection #{row.pk})",
              after={"source": asked_for[:60], "webhook_id": latest["last_webhook_id"], "rejection_id": row.pk})


def prune_rejections(last_seen_before, *, limit: int) -> int:
    """Delete up to `limit` rejection rows not seen again since `last_seen_before`, oldest first
    (retention's rule 5). Each one's first occurrence stays in the audit log."""
    ids = list(WebhookRejection.objects.filter(last_at__lt=last_seen_before).order_by("last_at")
               .values_list("pk", flat=True)[:limit])
    return WebhookRejection.objects.filter(pk__in=ids).delete()[0] if ids else 0


def _signed_by(source: WebhookSource, body: bytes, headers: dict) -> bool:
    for secret in source.secrets:
        try:
            Webhook(secret).verify(body, headers, json_parse=False)
            return True
        except (WebhookVerificationError, UnicodeDecodeError, ValueError):
            continue
    return False


def receive(*, source_name: str, task_id: int, body: bytes, headers: dict, ip: str | None = None) -> inbox.Sent:
    """Verify, then put the event in the task's inbox. Raises WebhookRejected / InboxRefused."""
    headers = {k.lower(): v for k, v in headers.items()}
    _throttle("address", ip or "", "from this address")
    source = WebhookSource.objects.filter(name=source_name, enabled=True).first()
    if source is None or not _signed_by(source, body, headers):
        why = "unknown or disabled source" if source is None else "bad signature or timestamp"
        _record_rejection(source=source, asked_for=source_name, why=why, task_id=task_id, headers=headers, ip=ip)
        log.warning("webhook rejected: %s", why, extra={"task_id": task_id})
        raise WebhookRejected(401, "The webhook signature does not verify for this source (or the timestamp is more "
                                   "than 300 s off): check the secret and the clock of the sender.")
    _throttle("source", source.name, f"for source {source.name}")
    try:
        event = jsonlimits.loads(body)
    except jsonlimits.Unreadable as exc:
        raise WebhookRejected(400, f"The body cannot be read: {exc}.") from None
    except ValueError:
        raise WebhookRejected(400, "The body is not JSON: send {\"type\": ..., \"payload\": {...}}.") from None
    if not isinstance(event, dict) or not isinstance(event.get("type"), str):
        raise WebhookRejected(422, "The body must be a JSON object with a `type` (and a `payload`).", field="type")
    task = Task.objects.filter(pk=task_id).first()
    if task is None:
        raise WebhookRejected(404, f"There is no task #{task_id}.")
    if event["type"] not in source.allowed_types:
        raise WebhookRejected(422, f"source {source.name} may not send {event['type']!r} events; it may send: "
                                   f"{', '.join(source.allowed_types) or 'none'}", field="type")
    if task.type not in source.task_types:
        raise WebhookRejected(403, f"source {source.name} may not post to {task.type} tasks")
    priority = inbox.parse_priority(event.get("priority"))
    if priority is None and event["type"] in inbox.REGISTRY:  # the type's default, within the source's ceiling
        priority = max(inbox.REGISTRY[event["type"]].default_priority, source.priority_ceiling)
    if priority is not None and priority < source.priority_ceiling:
        raise WebhookRejected(422, f"source {source.name} may ask for P{source.priority_ceiling} at most "
                                   f"(asked for P{priority})", field="priority")
    payload = event.get("payload", {})
    if not isinstance(payload, dict):
        raise WebhookRejected(422, "`payload` must be a JSON object.", field="payload")
    sent = inbox.send(task_id=task_id, type=event["type"], payload=payload, priority=priority,
                      source=f"webhook:{source.name}", ip=ip, source_event_id=headers.get("webhook-id", ""),
                      merge_key=str(event.get("merge_key") or ""))
    WebhookSource.objects.filter(pk=source.pk).update(last_used_at=timezone.now())
    return sent
