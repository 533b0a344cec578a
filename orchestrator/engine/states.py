"""The task state machine: every allowed transition, in one place.

Nothing else assigns Task.status. A transition runs inside the caller's transaction with
the task row locked, appends a `status` event to the progress log and an audit entry.
"""
from django.db import connection, transaction
from django.utils import timezone

from ..models import Task, TaskStatus as S
from ..notifications import notify_needs_human
from . import approvals, inbox_counter, row_changes
from .audit import entry_fields
from .events import save_with_events
from ..primitives.errors import HarnessError

TERMINAL = frozenset({S.COMPLETED, S.FAILED, S.STOPPED, S.TERMINATED})
ACTIVE = frozenset({S.RUNNING, S.PAUSING, S.STOPPING})

TRANSITIONS: dict[str, frozenset[str]] = {
    # queued -> awaiting_review: a claimed task whose executor died before it ran, with
    # a side effect from an earlier run still in doubt.
    S.QUEUED: frozenset({S.RUNNING, S.PAUSED, S.STOPPED, S.TERMINATED, S.NEEDS_HUMAN, S.AWAITING_REVIEW}),
    # running -> queued: a recovered or time-sliced task waits for the next worker.
    S.RUNNING: frozenset({S.COMPLETED, S.FAILED, S.PAUSING, S.PAUSED, S.STOPPING, S.STOPPED,
                          S.TERMINATED, S.AWAITING_REVIEW, S.NEEDS_HUMAN, S.QUEUED, S.WAITING}),
    # waiting -> queued: the awaited event arrived, or the wait's timer fired.
    S.WAITING: frozenset({S.QUEUED, S.PAUSED, S.STOPPED, S.TERMINATED}),
    S.PAUSING: frozenset({S.PAUSED, S.STOPPING, S.STOPPED, S.TERMINATED, S.COMPLETED, S.FAILED,
                          S.AWAITING_REVIEW, S.NEEDS_HUMAN, S.QUEUED}),
    S.PAUSED: frozenset({S.QUEUED, S.STOPPED, S.TERMINATED}),
    S.STOPPING: frozenset({S.STOPPED, S.TERMINATED, S.NEEDS_HUMAN}),
    S.AWAITING_REVIEW: frozenset({S.QUEUED, S.FAILED, S.TERMINATED, S.STOPPED, S.NEEDS_HUMAN}),
    S.NEEDS_HUMAN: frozenset({S.QUEUED, S.FAILED, S.TERMINATED, S.STOPPED}),
    S.COMPLETED: frozenset(),
    S.FAILED: frozenset(),
    S.STOPPED: frozenset(),
    S.TERMINATED: frozenset(),
}


class InvalidTransition(HarnessError):
    """Refused state change; the message says why, for an operator to read (HTTP 409)."""

    def __init__(self, task: Task, to: str, why: str = ""):
        self.task_id, self.current, self.target = task.pk, task.status, to
        message = why or f"Task #{task.pk} is {task.status}; it cannot become {to}."
        super().__init__(message)


def can_transition(current: str, to: str) -> bool:
    return to in TRANSITIONS.get(current, frozenset())


def transition(task: Task, to: str, *, reason: str = "", actor=None, ip: str | None = None,
               action: str = "", extra: dict | None = None, then_events: tuple | list = (), **fields) -> Task:
    """Move a locked `task` to status `to`, saving `fields` with it; `then_events` ((kind,
    payload) pairs) are appended after the status event, in the same statements.

    The caller holds `select_for_update()` on the row inside `transaction.atomic()`.
    """
    if not transaction.get_connection().in_atomic_block:
        raise RuntimeError("transition() must run inside transaction.atomic()")
    if not can_transition(task.status, to):
        raise InvalidTransition(task, to)
    before = task.status
    now = timezone.now()
    task.status = to
    task.status_reason = reason[:500]
    if to == S.RUNNING and task.started_at is None:
        task.started_at = now
    if to in TERMINAL:
        task.finished_at = now
        task.lease_owner = ""
        task.control = ""
        inbox_counter.reject_pending(task, to, now)
    if to not in (S.QUEUED, S.RUNNING):
        task.recovering_since = None  # a recovery in progress ends when the task settles elsewhere
    task.paused_by_limit = ""  # set (in `fields`) only by the runner's pause for a limit
    for name, value in fields.items():
        setattr(task, name, value)
    # The columns set here are written whatever they held; the caller's other changes to the
    # row are found by comparing it with the row as lock_task read it (row_changes).
    # The change's audit entry is written with its events (one statement on PostgreSQL).
    audit = entry_fields(action=action or f"status:{to}", actor=actor, ip=ip, task=task, before={"status": before},
                         after={"status": to, **({"reason": reason} if reason else {})}, reason=reason)
    save_with_events(task, [("status", {"from": before, "to": to, "reason": task.status_reason, **(extra or {})}),
                            *then_events], always=TRANSITION_COLUMNS + tuple(fields), audit=audit)
    if to in TERMINAL:
        # An approval still open can never run now: revoked, so nobody decides it for nothing.
        approvals.revoke(task_id=task.pk, reason=f"the task {to}" + (f": {reason}" if reason else ""), actor=actor)
    if to == S.NEEDS_HUMAN:
        # In this transaction: the webhook deliveries are committed with the transition (the
        # email goes after the commit).
        notify_needs_human(task.pk, task.status_reason)
    return task


TRANSITION_COLUMNS = ("status", "status_reason", "started_at", "finished_at", "lease_owner", "control",
                      "recovering_since", "paused_by_limit")


def lock_task(task_id: int) -> Task:
    """The task row, locked for the rest of the transaction (a no-op lock on SQLite, whose
    IMMEDIATE transactions already serialise writers)."""
    if not transaction.get_connection().in_atomic_block:
        raise transaction.TransactionManagementError("lock_task() must run inside transaction.atomic()")
    # Written as SQL: twice in every run, and building the ORM's query cost ~0.4 ms of CPU of ~1.
    lock = " FOR UPDATE" if connection.features.has_select_for_update else ""
    for task in Task.objects.raw(f"SELECT * FROM {Task._meta.db_table} WHERE id = %s{lock}", [task_id]):
        row_changes.remember(task)  # a status change then saves only the columns that changed
        return task
    raise Task.DoesNotExist(f"Task matching query does not exist (id {task_id}).")
