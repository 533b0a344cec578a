"""How a run ends, decided from its state alone: `decide(state) -> Outcome`.

Pure: it reads the run's state (engine/run_state.py) and the clock, never the database, so
every ending is unit-tested without one (tests/engine/test_decide.py). `finishing.py` writes
the outcome in the finishing transaction, with the task row locked.
"""
from dataclasses import dataclass

from ..conf import harness
from ..models import TaskStatus as S
from .run_state import RunState

SLICED = "sliced"  # not a status: the task stays running and the next worker continues it


@dataclass(frozen=True)
class Outcome:
    status: str  # the task's next status, or SLICED
    reason: str = ""
    error: str | None = None  # written to Task.error when set
    # The task ends: every effect whose outcome is unknown goes to a reviewer under this cause,
    # and the reason says how many (engine/finishing.py review_unknown_effects).
    review_cause: str = ""
    # The effects a tool reported ambiguous go to review; the task waits for it.
    open_reviews: bool = False
    paused_by_limit: str = ""


def decide(state: RunState) -> Outcome:
    """The run's outcome, in order of precedence. A WAITING outcome holds only if no awaited
    event has arrived meanwhile: the writer checks that with the row locked, and slices the
    task instead when one has."""
    ended = operator_ending(state)
    if ended:
        return ended
    if state.all_done():
        # Whatever ends a task reviews what it left in doubt: an idempotent effect a tool
        # step gave up replaying (or a skipped step's) would otherwise stay pending for good.
        return Outcome(S.COMPLETED, "all steps done", review_cause="all steps done")
    if state.ambiguous:
        keys = ", ".join(a.entry.idempotency_key for a in state.ambiguous)
        return Outcome(S.AWAITING_REVIEW, f"side effect in doubt: {keys}", open_reviews=True)
    if state.needs_human:
        return Outcome(S.NEEDS_HUMAN, state.needs_human[:500], error=state.needs_human)
    if state.failure:
        return Outcome(S.FAILED, state.failure[:500], error=state.failure, review_cause="failed")
    if state.control == "pause":
        return Outcome(S.PAUSED, "paused by an operator")
    limit = state.limit_reached()
    if limit:
        detail = f" ({state.limit_detail})" if state.limit_detail and limit == state.limit_hit else ""
        return Outcome(S.PAUSED, f"limit: {limit}{detail}", paused_by_limit=limit)
    if state.parked and not state.plan.has_ready() and not state.waiting_for_retry():
        return Outcome(S.WAITING)
    # Time slice used up, or nothing runnable right now: hand the task to the next
    # worker through the queue (it keeps status running; the lease is released).
    return Outcome(SLICED)


def operator_ending(state: RunState) -> Outcome | None:
    """Force-terminate, a Stop escalated past its grace, or a Stop. Checked before the
    ambiguous list, but never instead of it: an effect cut in flight by the request is as
    unknown as one a dead worker left (the ending reviews every effect in doubt)."""
    if state.control == "terminate":
        why = "force-terminated by an operator"
        return Outcome(S.TERMINATED, why, review_cause=why)
    if state.escalated:
        why = f"stop escalated to force-terminate: steps ignored cancellation for {harness.grace_seconds:g} s"
        return Outcome(S.TERMINATED, why, review_cause=why)
    if state.control == "stop":
        why = "stopped by an operator"
        return Outcome(S.STOPPED, why, review_cause=why)
    return None
