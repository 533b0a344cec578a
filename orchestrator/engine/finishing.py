"""The end of a run: write its outcome (decision.decide) in one transaction with the task row
locked and fenced on the lease, review what it left in doubt, and release the lease."""
import logging
from datetime import datetime

from django.db import transaction

from ..conf import harness
from ..models import Task, TaskStatus as S
from ..outage import retry_while_down
from . import checkpoint, inbox, lease as leases, recovery, reviews, scheduler, states
from .decision import SLICED, Outcome, decide
from .lease import LEASE_LOST, LeaseLost
from .run_state import RunState

log = logging.getLogger("orchestrator.engine.runner")  # a run's lines keep the runner's logger


def finish(state: RunState) -> str:
    extra = {"task_id": state.lease.task_id, "lease_epoch": state.lease.epoch}
    if state.lease_lost:
        log.warning("lease lost: this worker stops without writing", extra=extra)
        return LEASE_LOST
    active_seconds = state.take_active_seconds()

    def write_outcome():
        with transaction.atomic():
            task = leases.lock_fenced(state.lease)
            if state.diverged:
                # Nothing of this run's memory is written: the next run loads the database's.
                task.lease_owner = ""
                task.save(update_fields=["lease_owner", "updated_at"])
                scheduler.enqueue(task.pk)
                return task, "restarted from the database"
            task.active_seconds += active_seconds
            task.tokens_used = state.base_tokens + state.tokens_this_run()
            outcome = write(state, task, decide(state))
            # The run's last versions become full snapshot rows (cheap to read at rest).
            checkpoint.compact_snapshots(task, state.plan)
            return task, outcome

    try:
        task, outcome = retry_while_down(write_outcome, seconds=harness.database_retry_seconds, logger=log,
                                         what="the run's outcome", extra=extra)
    except LeaseLost:
        log.warning("lease lost before the task's outcome was written", extra=extra)
        return LEASE_LOST
    log.info("run finished: %s", outcome, extra={**extra, "checkpoint_version": task.checkpoint_version})
    return outcome


def write(state: RunState, task: Task, outcome: Outcome) -> str:
    """Write the run's outcome; runs in the finishing transaction with the row locked."""
    released = {"lease_owner": "", "control": "", "activities": []}
    reason = outcome.reason
    if outcome.review_cause:
        reason += recovery.in_doubt_note(review_unknown_effects(state, task, outcome.review_cause))
    if outcome.open_reviews:
        for ambiguous in state.ambiguous:
            reviews.effect_open(entry=ambiguous.entry, dead_worker=ambiguous.entry.worker, reason=ambiguous.reason,
                                evidence=ambiguous.evidence)
    if outcome.status == S.WAITING:
        if not any(inbox.awaited_arrived(task.pk, w["type"], match=w.get("match")) for w in state.parked.values()):
            # Nothing else to run and the awaited events have not come (checked with the row
            # locked: a sender that comes later sees `waiting` and wakes the task).
            park(state, task, released)
            return S.WAITING
        outcome = Outcome(SLICED)
    if outcome.status == SLICED:
        task.lease_owner = ""
        task.save(update_fields=["lease_owner", "active_seconds", "tokens_used", "updated_at"])
        scheduler.enqueue(task.pk)
        return SLICED
    fields = {"paused_by_limit": outcome.paused_by_limit} if outcome.paused_by_limit else {}
    if outcome.error is not None:
        fields["error"] = outcome.error
    states.transition(task, outcome.status, reason=reason, **fields, **released)
    return outcome.status


def park(state: RunState, task: Task, released: dict) -> None:
    """The task goes `waiting` for the events its parked steps wait for, until the first deadline."""
    waits = list(state.parked.values())
    deadlines = [datetime.fromisoformat(w["until"]) for w in waits if w["until"]]
    # An awaited event sent already but held back (a mergeable one's merge window):
    # the sweeper wakes the task when it becomes visible, as at a deadline.
    deadlines += [visible for visible in [inbox.awaited_visible_at(task.pk, waits)] if visible]
    what = ", ".join(f"{w['step']} waits for {w['type']}" for w in waits)
    states.transition(task, S.WAITING, reason=what[:500], waiting_for=waits,
                      waiting_until=min(deadlines) if deadlines else None, **released)


def review_unknown_effects(state: RunState, task: Task, cause: str) -> list:
    """The task ends now: every effect whose outcome is unknown goes in front of a reviewer,
    whose decision records what happened (nothing runs again). Those the tools reported
    ambiguous keep their evidence; the WAL's other pending rows (steps abandoned in flight
    by Force-terminate) are settled as recovery does."""
    reported = {}
    for ambiguous in state.ambiguous:
        reviews.effect_open(entry=ambiguous.entry, dead_worker=ambiguous.entry.worker, evidence=ambiguous.evidence,
                            reason=f"{ambiguous.reason} The task then ended ({cause}) and runs nothing again: "
                                   f"say whether it happened, for the record.")
        reported[ambiguous.entry.pk] = ambiguous.entry
    opened = recovery.settle_pending_wal(task, dead_worker=state.lease.owner, cause=cause, ended=True,
                                         extra={"task_id": task.pk, "lease_epoch": state.lease.epoch})
    return [*reported.values(), *(entry for entry in opened if entry.pk not in reported)]
