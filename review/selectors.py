from django.db.models import Q, QuerySet

from orchestrator.agent.toolbox import known_names as agent_tool_names
from orchestrator.tools.catalog import all_tools

from orchestrator.models import WalEntry

from .models import ReviewItem, ReviewKind, ReviewStatus


def review_list(*, status: str = "open", task_id: int | None = None, tool: str = "") -> QuerySet[ReviewItem]:
    qs = (ReviewItem.objects.select_related("task", "wal_entry", "decided_by").prefetch_related("votes")
          .order_by("detected_at", "id"))
    if status in ReviewStatus.values:
        qs = qs.filter(status=status)
    if task_id:
        qs = qs.filter(task_id=task_id)
    tool = tool.replace("\x00", "")  # PostgreSQL refuses a NUL character in text (as selectors.task_list)
    if tool:
        qs = qs.filter(tool=tool)
    return qs


def review_page(qs: QuerySet[ReviewItem], *, after: int | None = None, limit: int) -> tuple[list[ReviewItem], int | None]:
    """Keyset pagination in queue order (oldest detected first): the items after item `after`,
    and the id to continue after (None on the last page). Fast at any depth, unlike OFFSET."""
    if after:
        last = ReviewItem.objects.filter(pk=after).values_list("detected_at", flat=True).first()
        if last is not None:
            qs = qs.filter(Q(detected_at__gt=last) | Q(detected_at=last, pk__gt=after))
    rows = list(qs[:limit + 1])
    return rows[:limit], (rows[limit - 1].pk if len(rows) > limit else None)


def tool_names() -> list[str]:
    """The queue's tool filter: every tool an item can be about (the harness's tools, whose
    effects can be in doubt, and the agent's, whose calls can wait for approval). Read from
    the registries: a DISTINCT over a year of items joined to their WAL rows is a random read
    per item (300 ms at 10,000 items, bench/list.py)."""
    return sorted(set(all_tools()) | set(agent_tool_names()))


def review_detail(review_id: int) -> ReviewItem:
    return ReviewItem.objects.select_related("task", "wal_entry", "decided_by").prefetch_related("votes").get(
        pk=review_id)


def settled_by_probes() -> dict:
    """How many side effects in doubt the tools' probes settled without a reviewer, of all
    that were in doubt (those, and those that went to review): the review queue's header."""
    probed = WalEntry.objects.filter(settled_by="probe").count()
    reviewed = ReviewItem.objects.filter(kind=ReviewKind.EFFECT).count()
    total = probed + reviewed
    return {"probed": probed, "in_doubt": total, "percent": round(100 * probed / total) if total else None}


def open_count() -> int:
    return ReviewItem.objects.filter(status=ReviewStatus.OPEN).count()
