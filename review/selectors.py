from django.db.models import Q, QuerySet

from .models import ReviewItem, ReviewStatus


def review_list(*, status: str = "open", task_id: int | None = None, tool: str = "") -> QuerySet[ReviewItem]:
    qs = ReviewItem.objects.select_related("task", "wal_entry", "decided_by").order_by("detected_at", "id")
    if status in ReviewStatus.values:
        qs = qs.filter(status=status)
    if task_id:
        qs = qs.filter(task_id=task_id)
    if tool:
        qs = qs.filter(Q(wal_entry__tool=tool) | Q(proposal__tool=tool))
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


RECENT_FOR_TOOLS = 10_000


def recent_tools() -> list[str]:
    """The tools of the newest RECENT_FOR_TOOLS review items (the queue's tool filter): a
    DISTINCT over a year of decided items would run on every view of the queue."""
    items = ReviewItem.objects.order_by()
    oldest = ReviewItem.objects.order_by("-pk").values_list("pk", flat=True)[RECENT_FOR_TOOLS - 1:RECENT_FOR_TOOLS].first()
    if oldest is not None:
        items = items.filter(pk__gte=oldest)
    found = set(items.values_list("wal_entry__tool", flat=True).distinct())
    found |= set(items.values_list("proposal__tool", flat=True).distinct())
    return sorted(found - {None})


def review_detail(review_id: int) -> ReviewItem:
    return ReviewItem.objects.select_related("task", "wal_entry", "decided_by").get(pk=review_id)


def open_count() -> int:
    return ReviewItem.objects.filter(status=ReviewStatus.OPEN).count()
