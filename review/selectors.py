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


def review_detail(review_id: int) -> ReviewItem:
    return ReviewItem.objects.select_related("task", "wal_entry", "decided_by").get(pk=review_id)


def open_count() -> int:
    return ReviewItem.objects.filter(status=ReviewStatus.OPEN).count()
