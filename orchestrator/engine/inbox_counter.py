"""Task.inbox_pending, the count of a task's events waiting for a resume point: written here and
nowhere else (tests/engine/test_one_writer.py). Below both the inbox (engine/inbox.py, which
sends and consumes events) and the state machine (engine/states.py, whose terminal transitions
reject what is still pending), so that neither imports the other to keep the count."""
from datetime import datetime

from django.db.models import F

from ..models import InboundEvent, InboundState, Task


def added(task: Task, *, merged: int = 0) -> tuple[str, ...]:
    """One event joined `task`'s queue (the caller's transaction holds the row), taking the place
    of `merged` events of its burst: the counter, changed on `task`. Returns the columns for the
    caller's own save of the row."""
    task.inbox_pending += 1 - merged
    return ("inbox_pending",)


def control_added(task: Task) -> None:
    """A control event (pause, stop, ...) recorded for `task` with sequence number
    `task.inbox_seq`: both columns written at once (the runner reads them without a lock)."""
    task.inbox_pending += 1
    Task.objects.filter(pk=task.pk).update(inbox_seq=task.inbox_seq, inbox_pending=F("inbox_pending") + 1)


def settled(task: Task, count: int) -> None:
    """`count` control events of `task` were settled by the service that applied them."""
    if count:
        Task.objects.filter(pk=task.pk).update(inbox_pending=F("inbox_pending") - count)
        task.inbox_pending -= count


def consumed(task: Task, count: int) -> tuple[str, ...]:
    """`count` of `task`'s pending events left the queue in the caller's transaction, which
    locked and read the row (checkpoint.commit_events, checkpoint._settle_wait): the counter,
    lowered on `task`. Returns the columns to save with the caller's own UPDATE of the row
    (no extra round trip)."""
    task.inbox_pending -= count
    return ("inbox_pending",)


def reject_pending(task: Task, to: str, now: datetime) -> None:
    """`task` (locked) ends as `to`: its inbox will never be read again, so each pending event
    says so, and the counter is zero on `task` (saved by the transition, states.transition)."""
    if task.inbox_pending:
        InboundEvent.objects.filter(task=task, state=InboundState.PENDING).update(
            state=InboundState.REJECTED, consumed_at=now,
            outcome=f"not applied: the task ended ({to}) before its next resume point")
        task.inbox_pending = 0
