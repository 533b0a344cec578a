"""Retention prunes only what its rules allow: finished tasks past each window, never a
running task, never a task with an open review, never a record inside its window; the
audit log stays; each run is recorded."""
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.utils import timezone

from orchestrator import selectors
from orchestrator.engine import retention, services
from orchestrator.engine.worker import drive_inline
from orchestrator.models import AuditEntry, IdempotencyRecord, RetentionRun, Task, TaskEvent, WalEntry
from review.models import ReviewItem

pytestmark = pytest.mark.django_db(transaction=True)


def finished_task(days_ago: float, **params) -> Task:
    """A demo.migrate_rows task that really ran (steps, WAL, idempotency keys), finished `days_ago`."""
    task = services.task_create(type="demo.migrate_rows", params={"rows": 300, "batch_size": 100, **params})
    assert drive_inline(task.pk) == "completed"
    Task.objects.filter(pk=task.pk).update(finished_at=timezone.now() - timedelta(days=days_ago))
    TaskEvent.objects.create(task=task, seq=Task.objects.get(pk=task.pk).event_seq + 1000, kind="progress",
                             payload={"message": "agent.stream", "text": "tok"})  # a token-level stream event
    return Task.objects.get(pk=task.pk)


def keys_of(task: Task) -> int:
    return IdempotencyRecord.objects.filter(key__startswith=f"t{task.pk}:").count()


def test_each_rule_prunes_finished_tasks_past_its_window_and_nothing_else(settings):
    settings.ORCH_RETAIN_STREAM_EVENTS_DAYS, settings.ORCH_RETAIN_EVENTS_DAYS, settings.ORCH_RETAIN_WAL_DAYS = 7, 30, 90
    old = finished_task(100)            # past every window
    month = finished_task(40)           # past the stream and events windows, inside the WAL window
    recent = finished_task(1)           # inside every window
    running = services.task_create(type="demo.migrate_rows", params={"rows": 100, "batch_size": 100})
    Task.objects.filter(pk=running.pk).update(status="running", finished_at=timezone.now() - timedelta(days=200))
    before = {t.pk: (TaskEvent.objects.filter(task=t).count(), WalEntry.objects.filter(task=t).count(), keys_of(t))
              for t in (old, month, recent)}
    exported = selectors.task_export(old.pk)  # taken before pruning: it has everything
    assert len(exported["events"]) == before[old.pk][0] and len(exported["wal"]) == before[old.pk][1]
    audit_rows = AuditEntry.objects.count()

    record = retention.run()

    assert record.error == "" and record.tasks == 2 and record.finished_at is not None
    # Stream events: gone from both old tasks, kept for the recent one.
    streamed = TaskEvent.objects.filter(kind="progress", payload__message="agent.stream")
    assert sorted(streamed.values_list("task_id", flat=True)) == [recent.pk]
    # The progress log: compacted to a summary for both old tasks; the story kinds stay.
    for task in (old, month):
        kinds = set(TaskEvent.objects.filter(task=task).values_list("kind", flat=True))
        assert "step_done" not in kinds and {"planned", "compacted"} <= kinds
        summary = TaskEvent.objects.get(task=task, kind="compacted").payload
        assert summary["deleted"]["step_done"] == 4 and summary["rule"] == "ORCH_RETAIN_EVENTS_DAYS=30"
    assert TaskEvent.objects.filter(task=recent, kind="step_done").count() == 4
    # WAL and idempotency records: only for the task past 90 days.
    assert WalEntry.objects.filter(task=old).count() == 0 and keys_of(old) == 0
    assert (WalEntry.objects.filter(task=month).count(), keys_of(month)) == before[month.pk][1:]
    assert (WalEntry.objects.filter(task=recent).count(), keys_of(recent)) == before[recent.pk][1:]
    # A running task is never touched, however old its stamps; the audit log is never pruned.
    assert TaskEvent.objects.filter(task=running).count() >= 1 and Task.objects.get(pk=running.pk).events_compacted_at is None
    assert AuditEntry.objects.count() == audit_rows
    assert record.stream_events_deleted == 2 and record.wal_deleted == before[old.pk][1]
    assert record.idempotency_deleted == before[old.pk][2]
    # Each rule is applied once: a second run finds nothing due.
    again = retention.run()
    assert again.tasks == 0 and RetentionRun.objects.count() == 2


def test_a_task_with_an_open_review_is_never_touched_and_reviewed_wal_rows_are_kept(settings):
    settings.ORCH_RETAIN_EVENTS_DAYS, settings.ORCH_RETAIN_WAL_DAYS = 30, 90
    open_review = finished_task(100)
    decided = finished_task(100)
    for task, status in ((open_review, "open"), (decided, "decided")):
        entry = WalEntry.objects.filter(task=task).first()
        ReviewItem.objects.create(task=task, wal_entry=entry, status=status, reason="test: in doubt")
    retention.run()
    assert Task.objects.get(pk=open_review.pk).events_compacted_at is None
    assert TaskEvent.objects.filter(task=open_review, kind="step_done").count() == 4
    assert WalEntry.objects.filter(task=open_review).count() == 4  # prepare-source and 3 batches
    # Decided: pruned, but the WAL row its review refers to stays with the review.
    assert list(WalEntry.objects.filter(task=decided).values_list("review_item__status", flat=True)) == ["decided"]


def test_a_rule_set_to_zero_is_off_and_the_command_says_what_it_did(settings, capsys):
    settings.ORCH_RETAIN_STREAM_EVENTS_DAYS = settings.ORCH_RETAIN_EVENTS_DAYS = settings.ORCH_RETAIN_WAL_DAYS = 0
    task = finished_task(1000)
    call_command("retention")
    assert "retention: 0 task(s)" in capsys.readouterr().out
    assert TaskEvent.objects.filter(task=task, kind="step_done").count() == 4


@pytest.mark.workers
def test_the_sweeper_runs_the_rules_on_its_schedule(start_sweeper):
    from tests.conftest import wait_for

    task = finished_task(100)
    start_sweeper(ORCH_RETAIN_EVERY_SECONDS=0.5)
    wait_for(lambda: Task.objects.get(pk=task.pk).wal_pruned_at is not None, timeout=30, message="the WAL pruned")
    assert RetentionRun.objects.filter(tasks__gte=1).exists()
    assert WalEntry.objects.filter(task=task).count() == 0 and keys_of(task) == 0


def test_after_pruning_a_late_replay_is_refused_before_any_effect_and_a_late_event_gets_a_clear_409(settings):
    """What could still ask for a pruned task's WAL rows and keys: a straggler of its last run
    replaying an effect (its key no longer found), and a sender delivering a duplicate event.
    Neither gets what was pruned, and neither guesses: the fence refuses the straggler before
    it writes an intent or performs anything, and the inbox answers 409 with the reason."""
    from orchestrator.engine import inbox
    from orchestrator.engine.lease import Lease, LeaseLost
    from orchestrator.engine.wal import perform
    from demo.models import DemoDestination
    from orchestrator.primitives.cancellation import CancellationToken

    settings.ORCH_RETAIN_WAL_DAYS = 90
    task = finished_task(100)
    last_run = WalEntry.objects.filter(task=task).order_by("id").last()
    straggler = Lease(task_id=task.pk, epoch=last_run.lease_epoch, owner=last_run.worker, host="dead-host", pid=1)
    rows_before = list(DemoDestination.objects.order_by("pk").values_list("pk", "amount"))
    assert retention.run().wal_deleted >= 4 and WalEntry.objects.filter(task=task).count() == 0

    # The transactional tool: its rows would be written first, then rolled back by the fence.
    with pytest.raises(LeaseLost):
        perform(lease=straggler, step_id=last_run.step_id, call_index=0, tool_name="db.upsert",
                args={"table": "demo_destination", "columns": ["id", "amount"], "rows": [[1, "999.5"]]},
                token=CancellationToken(), completed=[])
    # A non-idempotent one: refused before its intent, so nothing was sent (port 9 listens to nothing:
    # had it been tried, the error would be the SMTP connection's, not the lease's).
    settings.EMAIL_HOST, settings.EMAIL_PORT = "127.0.0.1", 9
    with pytest.raises(LeaseLost):
        perform(lease=straggler, step_id="notify", call_index=0, tool_name="email.send",
                args={"to": ["ops@example.org"], "subject": "replayed", "body": "x"}, token=CancellationToken(), completed=[])
    assert WalEntry.objects.filter(task=task).count() == 0 and keys_of(task) == 0
    assert list(DemoDestination.objects.order_by("pk").values_list("pk", "amount")) == rows_before

    with pytest.raises(inbox.InboxRefused) as refused:
        inbox.send(task_id=task.pk, type="message", payload={"text": "hello again"}, source="webhook:crm",
                   source_event_id="crm-1")
    assert refused.value.status == 409 and "takes no more events" in str(refused.value)


def test_webhook_deliveries_that_are_over_go_after_their_window_and_pending_ones_never(settings, capsys):
    from orchestrator.models import DeliveryStatus, NotificationDelivery, NotificationSubscription

    settings.ORCH_RETAIN_NOTIFICATIONS_DAYS = 30
    subscription = NotificationSubscription.objects.create(name="ops", url="https://hooks.example.org/x",
                                                           secret="whsec_dGVzdA==")
    made = {}
    for name, status, days_ago in (("old delivered", DeliveryStatus.DELIVERED, 40),
                                   ("old given up", DeliveryStatus.FAILED, 31),
                                   ("old pending", DeliveryStatus.PENDING, 100),  # still to be sent: kept
                                   ("recent delivered", DeliveryStatus.DELIVERED, 29)):
        row = NotificationDelivery.objects.create(subscription=subscription, message_id=f"msg_{len(made)}",
                                                  event="approval.requested", status=status)
        NotificationDelivery.objects.filter(pk=row.pk).update(created_at=timezone.now() - timedelta(days=days_ago))
        made[name] = row.pk

    record = retention.run()

    assert record.error == "" and record.notifications_deleted == 2
    assert sorted(NotificationDelivery.objects.values_list("pk", flat=True)) == \
        sorted([made["old pending"], made["recent delivered"]])
    # 0 turns the rule off; the command says what it deleted.
    NotificationDelivery.objects.filter(pk=made["recent delivered"]).update(
        created_at=timezone.now() - timedelta(days=400))
    settings.ORCH_RETAIN_NOTIFICATIONS_DAYS = 0
    call_command("retention")
    assert "0 webhook deliveries, " in capsys.readouterr().out
    assert NotificationDelivery.objects.count() == 2
    settings.ORCH_RETAIN_NOTIFICATIONS_DAYS = 30
    call_command("retention")
    assert "1 webhook deliveries, " in capsys.readouterr().out
    assert list(NotificationDelivery.objects.values_list("pk", flat=True)) == [made["old pending"]]


def test_rows_of_rejected_webhooks_go_after_their_last_repeat_and_their_audit_entry_stays(settings):
    from orchestrator.models import WebhookRejection

    settings.ORCH_RETAIN_WEBHOOK_REJECTIONS_DAYS = 30
    now = timezone.now()
    old = WebhookRejection.objects.create(reason="bad signature", ip="203.0.113.9", count=500,
                                          last_at=now - timedelta(days=31))
    repeated = WebhookRejection.objects.create(reason="bad signature", ip="203.0.113.10", count=3,
                                               last_at=now - timedelta(days=2))  # first seen long ago, seen again
    WebhookRejection.objects.filter(pk=repeated.pk).update(first_at=now - timedelta(days=300))
    AuditEntry.objects.create(actor_name="system", action="webhook.rejected", after={"rejection_id": old.pk})
    record = retention.run()
    assert record.error == "" and record.webhook_rejections_deleted == 1
    assert list(WebhookRejection.objects.values_list("pk", flat=True)) == [repeated.pk]
    assert AuditEntry.objects.filter(action="webhook.rejected", after__rejection_id=old.pk).exists()
    settings.ORCH_RETAIN_WEBHOOK_REJECTIONS_DAYS = 0  # off
    WebhookRejection.objects.filter(pk=repeated.pk).update(last_at=now - timedelta(days=1000))
    assert retention.run().webhook_rejections_deleted == 0 and WebhookRejection.objects.count() == 1
