"""The five events, who is told of each, and what a notice says (orchestrator/notifications)."""
from dataclasses import asdict, dataclass, field
from datetime import datetime

from django.conf import settings

from ..roles import OPERATOR, REVIEWER

APPROVAL_REQUESTED = "approval.requested"
REVIEW_OPENED = "review.opened"
APPROVAL_EXPIRED = "approval.expired"
TASK_NEEDS_HUMAN = "task.needs_human"
TASK_STALLED = "task.stalled"  # running, but no progress for k × its type's p95 step duration (engine/stalls.py)
EVENTS = (APPROVAL_REQUESTED, REVIEW_OPENED, APPROVAL_EXPIRED, TASK_NEEDS_HUMAN, TASK_STALLED)
TASK_EVENTS = (TASK_NEEDS_HUMAN, TASK_STALLED)  # about a task, linked to its page (not to a review item)

# The role whose people can act on each event (Django groups, orchestrator/roles.py).
AUDIENCE = {APPROVAL_REQUESTED: REVIEWER, REVIEW_OPENED: REVIEWER, APPROVAL_EXPIRED: REVIEWER,
            TASK_NEEDS_HUMAN: OPERATOR, TASK_STALLED: OPERATOR}


@dataclass(frozen=True)
class Notice:
    """One event, as the email and the webhook payload tell it. Holds no arguments of the
    call and no secret: what it says is the tool's name, the reason (redacted) and a link."""

    event: str
    task_id: int
    task_type: str
    task_status: str
    role: str
    url: str
    occurred_at: datetime
    item_id: int | None = None
    tool: str = ""
    reason: str = ""
    extra: dict = field(default_factory=dict)

    def data(self) -> dict:
        """The webhook payload's `data` object."""
        found = asdict(self)
        for name in ("event", "occurred_at", "extra"):
            found.pop(name)
        return {**{k: v for k, v in found.items() if v not in (None, "")}, **self.extra}


def public_url(path: str) -> str:
    return settings.ORCH_PUBLIC_URL.rstrip("/") + path


def item_path(event: str, *, task_id: int, item_id: int | None) -> str:
    # The public pages (DESIGN.md "Pages"): written out rather than reversed, so that a worker's
    # executor does not import the whole URL configuration (pages and API) to send a link.
    return f"/review/{item_id}/" if item_id is not None and event not in TASK_EVENTS else f"/tasks/{task_id}/"
