"""Telling people that something waits for them (docs/notifications.md).

Five events: `approval.requested` (an agent's tool call waits for a reviewer),
`review.opened` (a side effect's outcome is unknown), `approval.expired` (nobody decided in
time), `task.needs_human` and `task.stalled` (running, but no progress for ORCH_STALL_FACTOR ×
its type's p95 step duration: engine/stalls.py, told once per stall). `notify(event, ...)` is
called by the code that creates the item, inside its transaction, and does two things:

- an email to the people of the role that can act (reviewers for approvals and review items,
  operators for needs_human; or the group an expiry escalates to), with a link to the item.
  Sent after the commit (`transaction.on_commit`, so nobody is told of an item that was rolled
  back), best effort, with its own short SMTP timeout (ORCH_NOTIFY_TIMEOUT_SECONDS): a dead
  mail server holds the committing process that long at most, and never fails it;
- a signed webhook delivery per enabled subscription that takes the event: a
  NotificationDelivery row written in the same transaction (an outbox: committed with the
  item or not at all), sent and retried by the sweeper's courier (outbox.py, courier.py).

Nothing here raises into the caller: a notification that cannot be queued or sent is logged.
"""
import logging

from django.db import transaction
from django.utils import timezone

from ..models import Task
from ..primitives.redaction import redact_text
from . import mail, outbox
from .events import (
    APPROVAL_EXPIRED, APPROVAL_REQUESTED, AUDIENCE, EVENTS, REVIEW_OPENED, TASK_NEEDS_HUMAN, TASK_STALLED, Notice,
    item_path, public_url,
)

__all__ = ["APPROVAL_EXPIRED", "APPROVAL_REQUESTED", "AUDIENCE", "EVENTS", "REVIEW_OPENED", "TASK_NEEDS_HUMAN",
           "TASK_STALLED", "Notice", "notify", "notify_needs_human"]

log = logging.getLogger(__name__)


def notify(event: str, *, task_id: int, item_id: int | None = None, tool: str = "", reason: str = "",
           role: str | None = None, extra: dict | None = None) -> Notice | None:
    """Tell the people who can act that `event` happened (see the module's docstring). Call it
    in the transaction that creates the item; `role` names another group than the event's
    (an expired approval escalated). Returns what was told, or None when it could not be."""
    try:
        if event not in EVENTS:
            raise ValueError(f"unknown notification event {event!r}; one of {', '.join(EVENTS)}")
        task_type, task_status = Task.objects.filter(pk=task_id).values_list("type", "status").first() or ("", "")
        notice = Notice(event=event, task_id=task_id, task_type=task_type, task_status=task_status,
                        role=role or AUDIENCE[event],
                        url=public_url(item_path(event, task_id=task_id, item_id=item_id)),
                        occurred_at=timezone.now(), item_id=item_id, tool=tool,
                        reason=redact_text(reason or "")[:1000], extra=dict(extra or {}))
    except Exception:
        log.exception("notification not sent", extra={"task_id": task_id, "notification_event": event})
        return None
    outbox.queue(notice)
    transaction.on_commit(lambda: mail.send(notice), robust=True)
    return notice


def notify_needs_human(task_id: int, reason: str = "") -> Notice | None:
    """A task became needs_human (or otherwise waits for an operator): its operators are told."""
    if not reason:
        reason = Task.objects.filter(pk=task_id).values_list("status_reason", flat=True).first() or ""
    return notify(TASK_NEEDS_HUMAN, task_id=task_id, reason=reason)
