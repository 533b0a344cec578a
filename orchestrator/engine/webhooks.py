"""Signed events from outside systems: `POST /api/hooks/{source}/tasks/{id}/events`.

The Standard Webhooks scheme (the `standardwebhooks` package): `webhook-id` (becomes the
event's `source_event_id`, so a redelivery is answered, not applied twice),
`webhook-timestamp` (within ±300 s) and `webhook-signature: v1,<base64 HMAC-SHA256(secret,
"{id}.{timestamp}.{body}")>`, several space-separated values allowed. The signature is
checked over the raw body before anything is parsed, with a constant-time compare, against
each of the source's secrets (rotation). A bad signature — or an unknown or disabled
source, which answers the same so as not to tell which names exist — is 401, an audit
row, and no event.
"""
import base64
import logging
import secrets as random_secrets

from django.db import transaction
from django.utils import timezone
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from ..models import Task, WebhookSource
from ..primitives import jsonlimits
from . import inbox
from .audit import audit

log = logging.getLogger(__name__)

SECRET_BYTES = 32
SECRETS_KEPT = 3  # rotating adds one; the oldest beyond this is dropped


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
    source = WebhookSource.objects.filter(name=source_name, enabled=True).first()
    if source is None or not _signed_by(source, body, headers):
        why = "unknown or disabled source" if source is None else "bad signature or timestamp"
        with transaction.atomic():
            audit(action="webhook.rejected", ip=ip, task=Task.objects.filter(pk=task_id).first(),
                  reason=f"{source_name}: {why}", after={"source": source_name, "webhook_id": headers.get("webhook-id", "")})
        log.warning("webhook rejected: %s", why, extra={"task_id": task_id})
        raise WebhookRejected(401, "The webhook signature does not verify for this source (or the timestamp is more "
                                   "than 300 s off): check the secret and the clock of the sender.")
    try:
        event = jsonlimits.loads(body)
    except jsonlimits.TooDeep as exc:
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
