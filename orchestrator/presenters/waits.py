"""How long approvals and review items have waited for a person: the task list shows it per
task (its oldest open item of each kind), the review queue per item. Computed here, once per
render, from `detected_at` (when the item was opened, or reopened); the templates only show
the text ("waiting 3 h 12 min")."""
from dataclasses import dataclass
from datetime import datetime

from django.utils import timezone

from ..models import Task

KIND_WORDS = {"approval": ("approval", "approvals"), "effect": ("review", "reviews")}


def duration_text(seconds: float) -> str:
    """A wait as a person says it: "40 s", "12 min", "3 h 12 min", "2 d 5 h"."""
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds} s"
    minutes = seconds // 60
    if minutes < 60:
        return f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours} h {minutes} min" if minutes else f"{hours} h"
    days, hours = divmod(hours, 24)
    return f"{days} d {hours} h" if hours else f"{days} d"


@dataclass(frozen=True)
class ReviewWait:
    """A task's open items of one kind: how many, and the oldest one's wait."""

    kind: str
    count: int
    since: datetime
    seconds: float

    @property
    def text(self) -> str:
        singular, plural = KIND_WORDS.get(self.kind, (self.kind, self.kind + "s"))
        what = singular if self.count == 1 else f"{self.count} {plural}"
        return f"{what} waiting {duration_text(self.seconds)}"


def with_review_waits(tasks: list[Task], now: datetime | None = None) -> list[Task]:
    """Each task with `review_waits`: per kind of open item (approvals first), how many and how
    long the oldest has waited. One query for the whole list (a row per open item, as for the
    unreviewed-effects badge: a task has a few at a time)."""
    now = now or timezone.now()
    rows = (Task.objects.filter(pk__in=[task.pk for task in tasks], review_items__status="open")
            .values_list("pk", "review_items__kind", "review_items__detected_at")) if tasks else []
    found: dict[tuple[int, str], list[datetime]] = {}
    for task_id, kind, detected_at in rows:
        found.setdefault((task_id, kind), []).append(detected_at)
    waits: dict[int, list[ReviewWait]] = {}
    for (task_id, kind), opened in found.items():
        since = min(opened)
        waits.setdefault(task_id, []).append(ReviewWait(kind=kind, count=len(opened), since=since,
                                                        seconds=(now - since).total_seconds()))
    for task in tasks:
        task.review_waits = sorted(waits.get(task.pk, []), key=lambda wait: wait.kind != "approval")
    return tasks


def item_wait_text(item, now: datetime | None = None) -> str:
    """One review item's wait: "waiting 3 h 12 min" while open, "waited 5 min" once closed
    (until its decision, or its expiry)."""
    if item.status == "open":
        return f"waiting {duration_text(((now or timezone.now()) - item.detected_at).total_seconds())}"
    closed_at = getattr(item, "decided_at", None) or getattr(item, "expired_at", None)
    if closed_at is None:
        return ""
    return f"waited {duration_text((closed_at - item.detected_at).total_seconds())}"


def with_item_waits(items: list, now: datetime | None = None) -> list:
    """Each review item with `wait_text` (one clock for the whole page)."""
    now = now or timezone.now()
    for item in items:
        item.wait_text = item_wait_text(item, now)
    return items
