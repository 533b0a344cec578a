"""Found by the soak (bench/soak.py): an email a reviewer said did not happen is sent again
with the same key (the same WAL entry); if that send is in doubt too, the task must get a
review item to decide again, not sit in awaiting_review with nothing to review."""
import pytest

from orchestrator.engine import services
from orchestrator.engine.worker import drive_inline
from orchestrator.models import Task
from review.models import ReviewItem
from review.services import review_decide

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_resent_email_in_doubt_again_is_reviewed_again(smtp, reviewer):
    smtp.mode, smtp.late_seconds = "reply_late", 2.5
    task = services.task_create(type="demo.notify", params={"recipients": ["ann@example.org"], "subject": "s"})
    drive_inline(task.pk)
    first = ReviewItem.objects.get(task=task, status="open")
    review_decide(item_id=first.pk, decision="not_happened", note="not in the log", actor=reviewer)

    drive_inline(task.pk)  # sent again with the same key; the answer is late again
    task = Task.objects.get(pk=task.pk)
    assert task.status == "awaiting_review", task.status_reason
    again = ReviewItem.objects.get(task=task, status="open")  # something to decide
    assert again.wal_entry_id == first.wal_entry_id

    smtp.mode = "ok"
    review_decide(item_id=again.pk, decision="happened", note="in the log this time", actor=reviewer)
    drive_inline(task.pk)
    assert Task.objects.get(pk=task.pk).status == "completed"
    assert smtp.keys() == [first.wal_entry.idempotency_key] * 2  # the one repeat the reviewer asked for
