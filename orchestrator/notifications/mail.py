"""The email half of a notification: to the active members of the group that can act, with a
link to the item. Best effort: the item's page, the queue's count and the webhook (retried)
are the reliable signals; an email that cannot be sent is logged and dropped."""
import logging

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.mail import EmailMessage, get_connection

from .events import (
    APPROVAL_EXPIRED, APPROVAL_REQUESTED, REVIEW_OPENED, TASK_NEEDS_HUMAN, TASK_STALLED, Notice, public_url,
)

log = logging.getLogger(__name__)


def recipients(role: str) -> list[str]:
    """The addresses of the active users in group `role` (members only: a superuser who wants
    these emails joins the group)."""
    User = get_user_model()
    return sorted({u.email for u in User.objects.filter(is_active=True, groups__name=role) if u.email})


def subject(notice: Notice) -> str:
    what = notice.tool or "a tool"
    return "[orchestrator] " + {
        APPROVAL_REQUESTED: f"approval needed: {what} in task #{notice.task_id}",
        REVIEW_OPENED: f"review needed: did {what} happen? (task #{notice.task_id})",
        APPROVAL_EXPIRED: f"approval expired: {what} in task #{notice.task_id}",
        TASK_NEEDS_HUMAN: f"task #{notice.task_id} needs a human",
        TASK_STALLED: f"task #{notice.task_id} is stalled",
    }[notice.event]


def body(notice: Notice) -> str:
    task = f"Task #{notice.task_id} ({notice.task_type})"
    lead = {
        APPROVAL_REQUESTED: f"{task} wants to call {notice.tool} and waits for a reviewer's approval.",
        REVIEW_OPENED: (f"{task} performed {notice.tool}, and whether it happened is unknown: a reviewer "
                        "decides before the task goes on."),
        APPROVAL_EXPIRED: f"Nobody decided the approval of {notice.tool} in {task} in time.",
        TASK_NEEDS_HUMAN: f"{task} needs a human.",
        TASK_STALLED: (f"{task} is running, but its current step has made no progress for much longer than "
                       f"this type's steps take: it may hang on a call, an upstream or a lock."),
    }[notice.event]
    lines = [lead, ""]
    if notice.reason:
        lines += [f"Reason: {notice.reason}", ""]
    lines.append(f"Open it: {notice.url}")
    if notice.event == TASK_NEEDS_HUMAN:
        lines.append(f"Full context (JSON): {public_url(f'/api/tasks/{notice.task_id}/export')}")
    lines += ["", f"You get this email as a member of the '{notice.role}' group."]
    return "\n".join(lines) + "\n"


def send(notice: Notice) -> int:
    """Send the notice's email; the number of messages sent (0: nobody to tell, or it failed).
    Never raises: it runs after the item's commit, in whatever process created the item."""
    try:
        to = recipients(notice.role)
        if not to:
            return 0
        # Its own timeout, shorter than EMAIL_TIMEOUT: a worker's step may be the one waiting.
        connection = get_connection(timeout=settings.ORCH_NOTIFY_TIMEOUT_SECONDS)
        # One message each (over one connection): a reviewer is not shown the others' addresses.
        return connection.send_messages([EmailMessage(subject(notice), body(notice), settings.DEFAULT_FROM_EMAIL, [address])
                                         for address in to]) or 0
    except Exception as exc:
        log.warning("could not email the %s group: %s: %s", notice.role, type(exc).__name__, exc,
                    extra={"task_id": notice.task_id, "notification_event": notice.event})
        return 0
