"""The inbox at a resume point: what each pending event means (every event type is dispatched
here), applied to the run's plan and committed as one checkpoint (checkpoint.commit_events).

Controls (pause, stop, ...) do not come this way: they act through the task's control column,
which the supervisor relays. Events a step waits for are taken by the wait, not here.
"""
import logging
from datetime import datetime

from django.utils import timezone

from ..conf import harness
from ..models import InboundState, StepStatus
from ..outage import DATABASE_DOWN, retry_while_down
from ..primitives.errors import HarnessError
from . import checkpoint, inbox, preemption
from .inbox import Applied
from .lease import LeaseLost
from .outcomes import diverge, step_failed
from .run_state import UNIT_FAILED, RunState

log = logging.getLogger("orchestrator.engine.runner")  # a run's lines keep the runner's logger


class UpstreamFailure(HarnessError):
    """A step's failure reported from outside the task (a P2 unit.failed event)."""


def due(state: RunState) -> bool:
    """Whether the loop's next resume point consumes the inbox."""
    if state.inbox_signal != state.inbox_consumed_at:
        return True
    return state.inbox_next_at is not None and timezone.now() >= state.inbox_next_at


def consume(state: RunState) -> None:
    """Apply the pending inbox events (P1 and below) as one checkpoint (checkpoint.commit_events)."""
    signal, now = state.inbox_signal, timezone.now()
    events = retry_while_down(lambda: inbox.due(state.lease.task_id, now, state.awaited),
                              seconds=harness.database_retry_seconds, logger=log, what="reading the inbox",
                              extra={"task_id": state.lease.task_id})
    consumed, stack = apply_all(state, events, now)
    if consumed:
        try:
            checkpoint.commit_events(lease=state.lease, plan=state.plan, consumed=consumed, stack=stack)
        except LeaseLost:
            state.lose_lease()
            return
        except DATABASE_DOWN:
            # Whether the consumption landed is unknown (its reply may be what was lost):
            # the next run reads it from the database instead of guessing.
            diverge(state, "the database went away while events were consumed", [])
            return
        log.info("inbox: %d event(s) consumed", len(consumed), extra={"task_id": state.lease.task_id})
    for step_id, failure in state.unit_failures_pending:
        step_failed(state, step_id, failure, None)
    state.unit_failures_pending = []
    if state.preempting and not any(e.type == "preempt" for e in events):
        pass  # the preempt is not visible to this resume point yet: keep holding
    elif state.preempting:
        state.preempting, state.interrupted = False, []
    state.inbox_consumed_at = signal
    state.inbox_next_at = None if len(events) == inbox.CONSUMED_PER_RESUME_POINT else retry_while_down(
        lambda: inbox.next_visible(state.lease.task_id, state.awaited), seconds=harness.database_retry_seconds,
        logger=log, what="reading the inbox", extra={"task_id": state.lease.task_id})
    if len(events) == inbox.CONSUMED_PER_RESUME_POINT:
        state.inbox_consumed_at = -1  # more are waiting: the next resume point takes them


def apply_all(state: RunState, events: list, now: datetime) -> tuple[list, list | None]:
    """(event, Applied) for each event, and the task stack the preempts among them leave (None:
    unchanged). The steps events add must join the plan together, or the event is rejected."""
    consumed, accepted, stack = [], [], None
    for event in events:
        frame = None
        if event.type == "preempt":
            depth = len(stack if stack is not None else state.plan.stack)
            applied, frame = preemption.apply(state.task_type, event, state.params, state.plan, depth=depth,
                                              interrupted=state.interrupted, seen_at=state.preempt_seen_at)
        else:
            applied = dispatch(state, event, now)
        if applied.add_steps:
            try:
                state.plan.validate_growth(f"{inbox.INBOX_ADDER}{event.seq}", accepted + applied.add_steps)
                accepted.extend(applied.add_steps)
            except checkpoint.InvalidPlanGrowth as exc:
                applied, frame = Applied(f"rejected: {exc}", state=InboundState.REJECTED), None
        if frame is not None:
            stack = [*(stack if stack is not None else state.plan.stack), frame]
        consumed.append((event, applied))
    return consumed, stack


def dispatch(state: RunState, event, now: datetime) -> Applied:
    """What consuming `event` (not a preempt, whose frame `apply_all` stacks) means: a step's
    failure reported from outside, an expired P4, recorded information, or what the task
    type's handler (`TaskType.handle_event`) decides."""
    task_type = state.task_type
    if event.type == "unit.failed":
        return fail_unit(state, event)
    if event.priority == 4 and (now - event.created_at).total_seconds() > harness.inbox["p4_ttl_seconds"]:
        return Applied(f"expired: not consumed within {harness.inbox['p4_ttl_seconds']:g} s",
                       state=InboundState.EXPIRED)
    if event.type in getattr(task_type, "event_types", ()):
        try:
            return task_type.handle_event(event)
        except Exception as exc:  # the handler's bug must not stop the task: the event says why
            log.warning("event handler failed", exc_info=True, extra={"task_id": event.task_id})
            return Applied(f"rejected: the handler failed ({type(exc).__name__}: {exc})"[:2000],
                           state=InboundState.REJECTED)
    if event.type == "progress.external":
        return Applied("recorded")
    return Applied(f"recorded: {event.type} changes nothing in a {task_type.name} task")


def fail_unit(state: RunState, event) -> Applied:
    """A `unit.failed` event at a resume point: the named step's retry policy applies as
    if it had failed with the event's error (a running step is cancelled first)."""
    step_id = event.payload["step"]
    status = state.plan.status.get(step_id)
    if status is None:
        return Applied(f"rejected: the task has no step {step_id!r}", state=InboundState.REJECTED)
    if status in (StepStatus.DONE, StepStatus.SKIPPED):
        return Applied(f"rejected: step {step_id} is {status} already; nothing is compensated (roll back "
                       f"to a version before it, or edit, to run it again)", state=InboundState.REJECTED)
    failure = UpstreamFailure(f"reported by event #{event.seq} ({event.source}): {event.payload['error']}")
    if step_id in state.flights:
        state.unit_failures[step_id] = failure
        state.flights[step_id].token.cancel(UNIT_FAILED)
        return Applied(f"step {step_id} was running: cancelled, and it counts as a failed attempt; its "
                       f"retry policy applies")
    state.unit_failures_pending.append((step_id, failure))
    return Applied(f"step {step_id} counts as a failed attempt; its retry policy applies")


def pop_frame(state: RunState) -> None:
    """The task stack's top frame finished (its urgent subtask is done): the interrupted work goes on."""
    try:
        preemption.pop(state.lease, state.plan)
    except LeaseLost:
        state.lose_lease()
    except DATABASE_DOWN:
        diverge(state, "the database went away while a frame was popped", [])
