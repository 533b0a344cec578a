"""Retention: what a year of finished tasks keeps, by rules a person can read.

Only *finished* tasks (completed, failed, stopped, terminated) are touched, and never one with
an open review. Each rule runs in bounded batches from the sweeper (every
ORCH_RETAIN_EVERY_SECONDS, at most ORCH_RETAIN_BATCH_TASKS tasks per rule), one short
transaction per task; each run is a RetentionRun row (the admin lists them) and each task
records when a rule was applied to it. A window of 0 turns its rule off.

1. ORCH_RETAIN_STREAM_EVENTS_DAYS (7): the token-level stream events of an agent
   (`progress` events `agent.stream`) go first — the dialog itself is kept in AgentMessage.
2. ORCH_RETAIN_EVENTS_DAYS (30): the progress log is compacted. The bulky kinds (step_done,
   progress, inbox, winding_down, control_acknowledged, inbox_consumed) are deleted and one
   `compacted` event is appended saying how many of each there were, over which seqs and
   times. What tells the task's story (planned, status changes, recoveries, failures, skips,
   edits, rollbacks, subtasks) stays.
3. ORCH_RETAIN_WAL_DAYS (90): the WAL rows and the idempotency records of the task go, except
   the WAL rows a review refers to (the decision and its evidence are audit material).
   Why this is safe: a WAL row and an idempotency record are read only while their task can
   still run a step — to replay a recorded result after a crash, or to recognise a duplicate
   of an effect. A finished task cannot run again (it cannot be resumed, edited or rolled
   back), and every key is its task's own (`t<task>:<step>:<n>`), so after it finished nothing
   can ask for them. The window is for people: an auditor or a support engineer who wants the
   exact effects of a recent task (the task's export, taken before, has them all).
4. ORCH_RETAIN_NOTIFICATIONS_DAYS (30): webhook deliveries that are over (delivered, or given
   up after their last attempt) go this long after they were queued, at most DELETE_CHUNK per
   run (notifications.outbox.prune); a pending delivery is never touched. Without it, every
   approval and every task needing a human added rows forever.
5. ORCH_RETAIN_WEBHOOK_REJECTIONS_DAYS (30): rows of rejected incoming webhook requests
   (WebhookRejection, one per source, reason and address, counting repeats) go this long after
   their last repeat (engine/webhooks.prune_rejections); each one's first occurrence is an audit
   entry, which stays.
The audit log (AuditEntry) is never pruned.
"""
import logging
from datetime import timedelta

from django.db import transaction
from django.db.models import Count
from django.utils import timezone

from ..conf import harness
from ..models import IdempotencyRecord, RetentionRun, Task, TaskEvent, WalEntry
from ..notifications import outbox
from . import states, webhooks
from .events import append_event

log = logging.getLogger(__name__)

COMPACTED_KINDS = ("step_done", "progress", "inbox", "winding_down", "control_acknowledged", "inbox_consumed")
DELETE_CHUNK = 5000  # rows per DELETE statement: no statement holds its locks for long


def run(now=None) -> RetentionRun:
    """Apply each rule to a batch of the tasks it is due for; returns the run's record."""
    now = now or timezone.now()
    rules = harness.retention
    record = RetentionRun.objects.create(started_at=now, rules=rules)
    touched: set[int] = set()
    try:
        for task_id in _due("stream_events_dropped_at", rules["stream_events_days"], now, rules["batch_tasks"]):
            record.stream_events_deleted += _drop_stream_events(task_id, now)
            touched.add(task_id)
        for task_id in _due("events_compacted_at", rules["events_days"], now, rules["batch_tasks"]):
            record.events_deleted += _compact_events(task_id, now)
            touched.add(task_id)
        for task_id in _due("wal_pruned_at", rules["wal_days"], now, rules["batch_tasks"]):
            wal, keys = _prune_wal(task_id, now)
            record.wal_deleted += wal
            record.idempotency_deleted += keys
            touched.add(task_id)
        if rules["notifications_days"]:
            record.notifications_deleted = outbox.prune(now - timedelta(days=rules["notifications_days"]),
                                                        limit=DELETE_CHUNK)
        if rules["webhook_rejections_days"]:
            record.webhook_rejections_deleted = webhooks.prune_rejections(
                now - timedelta(days=rules["webhook_rejections_days"]), limit=DELETE_CHUNK)
    except Exception as exc:  # recorded, and the next run goes on from where this one stopped
        record.error = f"{type(exc).__name__}: {exc}"[:2000]
        log.exception("retention run failed")
    record.tasks, record.finished_at = len(touched), timezone.now()
    record.save()
    if touched or record.notifications_deleted or record.webhook_rejections_deleted:
        log.info("retention: %d task(s) pruned", len(touched),
                 extra={"stream_events": record.stream_events_deleted, "events": record.events_deleted,
                        "wal": record.wal_deleted, "idempotency": record.idempotency_deleted,
                        "webhook_deliveries": record.notifications_deleted,
                        "webhook_rejections": record.webhook_rejections_deleted})
    return record


def _due(done_field: str, days: float, now, limit: int) -> list[int]:
    if not days:
        return []
    return list(Task.objects.filter(status__in=states.TERMINAL, finished_at__lt=now - timedelta(days=days),
                                    **{f"{done_field}__isnull": True})
                .exclude(wal_entries__review_item__status="open")
                .order_by("finished_at").values_list("pk", flat=True)[:limit])


def _locked_finished(task_id: int) -> Task | None:
    """The task, locked, if it is still finished and has no open review (checked again inside
    the transaction: the batch was chosen outside it)."""
    task = states.lock_task(task_id)
    if task.status not in states.TERMINAL or task.wal_entries.filter(review_item__status="open").exists():
        return None
    return task


def _delete_in_chunks(queryset) -> int:
    deleted = 0
    while True:
        ids = list(queryset.values_list("pk", flat=True)[:DELETE_CHUNK])
        if not ids:
            return deleted
        deleted += queryset.model.objects.filter(pk__in=ids).delete()[0]


def _drop_stream_events(task_id: int, now) -> int:
    with transaction.atomic():
        task = _locked_finished(task_id)
        if task is None:
            return 0
        deleted = _delete_in_chunks(TaskEvent.objects.filter(task=task, kind="progress",
                                                             payload__message="agent.stream"))
        Task.objects.filter(pk=task.pk).update(stream_events_dropped_at=now)
    return deleted


def _compact_events(task_id: int, now) -> int:
    with transaction.atomic():
        task = _locked_finished(task_id)
        if task is None:
            return 0
        bulky = TaskEvent.objects.filter(task=task, kind__in=COMPACTED_KINDS)
        counts = dict(bulky.values_list("kind").annotate(n=Count("id")).values_list("kind", "n"))
        span = bulky.order_by("seq").values_list("seq", "created_at")
        first, last = span.first(), span.last()
        deleted = _delete_in_chunks(bulky)
        if deleted:
            append_event(task, "compacted", {
                "deleted": counts, "seqs": [first[0], last[0]],
                "from": first[1].isoformat(), "to": last[1].isoformat(),
                "rule": f"ORCH_RETAIN_EVENTS_DAYS={harness.retention['events_days']:g}"})
        Task.objects.filter(pk=task.pk).update(events_compacted_at=now)
    return deleted


def _prune_wal(task_id: int, now) -> tuple[int, int]:
    with transaction.atomic():
        task = _locked_finished(task_id)
        if task is None:
            return 0, 0
        # A task's keys are `t<id>:...`: a range on the unique index (';' follows ':').
        keys = _delete_in_chunks(IdempotencyRecord.objects.filter(key__gte=f"t{task.pk}:", key__lt=f"t{task.pk};"))
        wal = _delete_in_chunks(WalEntry.objects.filter(task=task, review_item__isnull=True))
        Task.objects.filter(pk=task.pk).update(wal_pruned_at=now)
    return wal, keys


def due_now(last_run_at, now=None) -> bool:
    """Whether the sweeper should run the rules again."""
    every = harness.retention["every_seconds"]
    return bool(every) and (last_run_at is None or (now or timezone.now()) - last_run_at >= timedelta(seconds=every))
