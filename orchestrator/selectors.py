"""Reads for pages, the API and the CLI (writes live in engine/services.py)."""
from django.db.models import Q, QuerySet

from .engine import llm_ledger, results, snapshots
from .models import ReviewItem, Task, TaskStatus
from .primitives.redaction import redact

PAGE_SIZE = 50


def task_list(*, status: str = "", type: str = "", text: str = "") -> QuerySet[Task]:
    # PostgreSQL refuses a NUL character in text: a filter cannot contain one.
    status, type, text = (value.replace("\x00", "") for value in (status, type, text))
    qs = Task.objects.all()
    if status:
        qs = qs.filter(status__in=[s for s in status.split(",") if s in TaskStatus.values])
    if type:
        qs = qs.filter(type=type)
    if text:
        qs = qs.filter(task_text_query(text))
    return qs.order_by("-id")


def task_text_query(text: str) -> Q:
    """A task list's text search: the title or the type contains it, or it is the task's id
    ("123" or "#123"). On PostgreSQL trigram indexes serve it (migration 0018)."""
    query = Q(title__icontains=text) | Q(type__icontains=text)
    number = text.lstrip("#")
    # ASCII digits only: str.isdigit() is true of "³" and "①", which int() refuses (found by
    # schemathesis: GET /api/tasks?q=%C2%B3 answered 500).
    if number.isascii() and number.isdigit() and int(number) < 2**63:
        query |= Q(pk=int(number))
    return query


def task_page(qs: QuerySet[Task], *, before: int | None = None, limit: int = PAGE_SIZE) -> tuple[list[Task], int | None]:
    """Keyset pagination on id (newest first): fast at any depth, unlike OFFSET."""
    if before:
        qs = qs.filter(pk__lt=before)
    rows = list(qs[:limit + 1])
    next_before = rows[limit - 1].pk if len(rows) > limit else None
    return rows[:limit], next_before


def task_detail(task_id: int) -> Task:
    return Task.objects.select_related("created_by").get(pk=task_id)


def task_export(task_id: int) -> dict:
    """The full context of a task, for a human to investigate (JSON-serialisable), with the
    installation's secrets redacted (orchestrator/primitives/redaction.py): the export leaves
    the installation, so it is redacted here, whoever asks for it."""
    from django.forms.models import model_to_dict

    from .models import AgentMessage, AuditEntry, InboundEvent, Snapshot, Step, TaskEvent, WalEntry

    task = Task.objects.get(pk=task_id)

    def rows(qs):
        return [model_to_dict(obj) | {"id": obj.pk} for obj in qs]

    last_snapshot = Snapshot.objects.filter(task=task).order_by("-version").first()
    if last_snapshot is not None:
        last_snapshot.state = snapshots.materialize(task.pk, last_snapshot.version)
        last_snapshot.full = True
    return redact({
        "task": model_to_dict(task) | {"id": task.pk, "created_at": task.created_at, "updated_at": task.updated_at},
        "steps": [model_to_dict(step) | {"id": step.pk, "result": results.result_of(step)}
                  for step in Step.objects.filter(task=task).order_by("position")],
        "wal": rows(WalEntry.objects.filter(task=task).order_by("id")),
        "last_snapshot": model_to_dict(last_snapshot) if last_snapshot else None,
        "events": list(TaskEvent.objects.filter(task=task).order_by("seq").values("seq", "kind", "payload", "created_at")),
        "audit": list(AuditEntry.objects.filter(task=task).order_by("at", "id").values(
            "at", "actor_name", "ip", "action", "before", "after", "reason")),
        "reviews": rows(ReviewItem.objects.filter(task=task).order_by("id")),
        "inbox": rows(InboundEvent.objects.filter(task=task).order_by("seq")),
        # An agent's transcript: every message as stored (interrupted attempts and earlier
        # generations included, each marked), in dialog order.
        "transcript": rows(AgentMessage.objects.filter(task=task).order_by("turn", "order", "id")),
        # Every model call attempt, as billed or estimated, and their sums (engine/llm_ledger.py).
        "model_attempts": llm_ledger.attempts_of(task.pk),
        "model_usage": llm_ledger.totals(task.pk),
    })
