"""What one step's end means for the run: commit its result, or count a failed attempt and
retry it with backoff or give up (its failure policy), or park it (a wait, a limit, an
ambiguous effect, a cut or an interruption: not the step's fault).

The retry decision is a value (`retry_or_give_up` -> `Retry` or `GiveUp`), computed without
the database; `settle` and `step_failed` apply it to the run's state and commit it.
"""
import hashlib
import logging
import re
import time
import traceback
from concurrent.futures import Future
from dataclasses import dataclass

from django.db import transaction
from django.utils import timezone

from .. import outage
from ..conf import harness
from ..models import StepStatus
from ..primitives.cancellation import Cancelled
from . import at_commit, checkpoint, lease as leases, wal
from .context import LimitExceeded, StepContext, StepTimedOut, WaitForEvent
from .lease import LeaseLost
from .run_state import LIMIT_CUT, PAUSE_CUT, PREEMPTED, STEP_TIMEOUT, UNIT_FAILED, InFlight, RunState
from .step_limits import note_specs, options_of
from .wal import AmbiguousEffect, EffectFailed

log = logging.getLogger("orchestrator.engine.runner")  # a run's lines keep the runner's logger

RETRY_BACKOFF_BASE_SECONDS = 0.5
RETRY_BACKOFF_MAX_SECONDS = 30.0


@dataclass(frozen=True)
class Retry:
    """Run the step again, not before `delay` seconds from now."""
    delay: float


@dataclass(frozen=True)
class GiveUp:
    """The step failed for good: its failure policy applies, with this reason."""
    why: str


def failure_fingerprint(exc: BaseException) -> str:
    """Exception type + message with the volatile parts (numbers, hex ids, addresses)
    normalised: two failures with one fingerprint are the same failure."""
    message = re.sub(r"0x[0-9a-fA-F]+|\b[0-9a-f]{8,}\b|\d+", "#", str(exc))
    return hashlib.sha256(f"{type(exc).__module__}.{type(exc).__qualname__}:{message}".encode()).hexdigest()[:32]


def retry_or_give_up(step_id: str, cause: BaseException, *, attempts: int, repeated: bool,
                     winding_down: bool, max_attempts: int) -> Retry | GiveUp:
    """After a failed attempt (the `attempts`-th; `repeated`: it failed like the one before).
    While a request winds the task down a failure is left for the next run to retry:
    no policy applies to a step that was being interrupted."""
    if winding_down or (attempts < max_attempts and not repeated):
        return Retry(min(RETRY_BACKOFF_BASE_SECONDS * 2 ** (attempts - 1), RETRY_BACKOFF_MAX_SECONDS))
    return GiveUp(f"step {step_id} failed " + (
        f"twice the same way ({type(cause).__name__}: {str(cause)[:200]}); retrying will not help"
        if repeated else f"after {attempts} attempts: {type(cause).__name__}: {str(cause)[:300]}"))


# --- settling a finished step -------------------------------------------------------------
def settle(state: RunState, future: Future, flight: InFlight) -> None:
    ctx, step_id = flight.ctx, flight.step_id
    state.token.discard_child(ctx.token)
    state.flights.pop(step_id, None)
    state.deadlines.pop(step_id, None)
    state.plan.running.discard(step_id)
    extra = {"task_id": state.lease.task_id, "step_id": step_id, "lease_epoch": state.lease.epoch}
    if future.exception() is not None:
        # The step will not commit, but the tokens it spent are spent (a stream cut by a Stop,
        # a failed attempt): counted now, once, and written with the run's outcome.
        state.spent_tokens, ctx.tokens_used = state.spent_tokens + ctx.tokens_used, 0
    try:
        result = future.result()
    except LeaseLost:
        state.lose_lease()
        return
    except Cancelled as exc:
        settle_cancelled(state, exc, flight)
        return
    except WaitForEvent as wait:
        # Not a failure: the step runs again when the event comes (or its deadline passes).
        state.parked[step_id] = {"step": step_id, "type": wait.event_type,
                                 "until": wait.until.isoformat() if wait.until else None,
                                 **({"match": wait.match} if wait.match else {})}
        if ctx.completed_effects:  # effects before the wait did happen: commit their `done`
            record_failure(state, flight, str(wait), retrying=True)
        return
    except LimitExceeded as exc:
        # Not the step's fault: it runs again after the limit is raised and the task resumed.
        state.limit_hit, state.limit_detail = exc.limit, exc.detail
        if ctx.completed_effects:
            record_failure(state, flight, str(exc), retrying=True)
        return
    except AmbiguousEffect as exc:
        log.warning("ambiguous effect: waiting for review", extra={**extra, "wal_entry_id": exc.entry.pk})
        state.ambiguous.append(exc)
        if ctx.completed_effects:  # earlier effects of this step did happen: commit their `done`
            record_failure(state, flight, str(exc), retrying=True)
        return
    except Exception as exc:
        settle_error(state, exc, flight)
        return
    commit_result(state, flight, result)


def settle_cancelled(state: RunState, exc: Cancelled, flight: InFlight) -> None:
    """A step that ended on its token's cancellation; its reason says why."""
    ctx, step_id = flight.ctx, flight.step_id
    if exc.reason == UNIT_FAILED and step_id in state.unit_failures and not state.token.cancelled:
        step_failed(state, step_id, state.unit_failures.pop(step_id), flight)
        return
    if exc.reason == STEP_TIMEOUT and not state.token.cancelled:
        step_failed(state, step_id, timed_out(state, step_id), flight)
        return
    if was_cut(state, ctx):
        cut_settled(state, flight)
        return
    if ctx.completed_effects and not state.lease_lost:
        record_failure(state, flight, "cancelled", retrying=True)
    if exc.reason == PREEMPTED and not state.token.cancelled:
        # Interrupted for an urgent subtask: it runs again once the frame is popped.
        state.interrupted.append(step_id)
        state.plan.requeue(step_id)


def settle_error(state: RunState, exc: Exception, flight: InFlight) -> None:
    """A step that raised: a failed attempt, unless its token's cancellation made it give up."""
    ctx, step_id = flight.ctx, flight.step_id
    if ctx.token.reason == STEP_TIMEOUT and not state.token.cancelled:
        # Its tool gave up because the timeout cancelled it: the timeout is the failure.
        step_failed(state, step_id, timed_out(state, step_id), flight)
        return
    if was_cut(state, ctx):
        cut_settled(state, flight)
        return
    if ctx.token.reason == PREEMPTED and not state.token.cancelled:
        # Its tool gave up because the token was cancelled: an interruption, not a failure.
        record_failure(state, flight, f"interrupted by a preempt: {type(exc).__name__}: {exc}", retrying=True)
        state.interrupted.append(step_id)
        return
    step_failed(state, step_id, exc, flight)


def commit_result(state: RunState, flight: InFlight, result) -> None:
    """A step that returned: its result, reads and effects become one checkpoint."""
    ctx, step_id = flight.ctx, flight.step_id
    extra = {"task_id": state.lease.task_id, "step_id": step_id, "lease_epoch": state.lease.epoch}
    state.spent_tokens += ctx.tokens_used
    try:
        version = checkpoint.commit_step(
            lease=state.lease, plan=state.plan, step_id=step_id, result=result,
            reads=ctx.params.keys_read, effects=ctx.completed_effects, started_at=flight.started_at,
            tokens_used=ctx.tokens_used, active_seconds=state.take_active_seconds(), added=ctx.added_steps,
            consumed=ctx.consumed_events, ends_wait=step_id in state.waits, at_commit=ctx.at_commit,
            rows=ctx.rows_at_commit)
    except at_commit.RecordedEarlier:
        # Not a failure: the step runs again at once, its effects in place (the recorded result).
        log.info("an effect at commit was recorded by an earlier execution: the step runs again", extra=extra)
        state.effects_in_place.add(step_id)
        state.plan.requeue(step_id)
        return
    except at_commit.FailedAtCommit as exc:
        log.warning("checkpoint with effects at commit refused: the step's next attempt performs them in place",
                    extra=extra)
        state.effects_in_place.add(step_id)
        step_failed(state, step_id, exc, flight)
        return
    except LeaseLost:
        log.warning("lease lost: step result discarded", extra=extra)
        state.lose_lease()
        return
    except checkpoint.CheckpointDiverged as exc:
        diverge(state, str(exc), ctx.completed_effects)
        return
    except checkpoint.InvalidPlanGrowth as exc:
        # The step's code asked for an impossible plan: running it again asks the same.
        log.warning("step added steps that cannot join the plan", extra=extra)
        record_failure(state, flight, f"InvalidPlanGrowth: {exc}", retrying=False,
                       fingerprint=failure_fingerprint(exc))
        if not state.lease_lost:
            give_up(state, step_id, f"step {step_id} failed: {exc}")
        return
    note_specs(state, ctx.added_steps)
    state.results.put(step_id, result)
    state.not_before.pop(step_id, None)
    log.debug("step committed", extra={**extra, "checkpoint_version": version})


def timed_out(state: RunState, step_id: str) -> StepTimedOut:
    return StepTimedOut(step_id, options_of(state, step_id)[0] or 0)


def was_cut(state: RunState, ctx: StepContext) -> bool:
    """Cancelled by a Pause's grace or a limit (not by a Stop, which cancels the whole run)."""
    reason = ctx.token.reason or ""
    return not state.token.cancelled and (reason == PAUSE_CUT or reason.startswith(LIMIT_CUT))


def cut_settled(state: RunState, flight: InFlight) -> None:
    """A step cut by a Pause or a limit: not a failure, no attempt counted; it runs again on
    resume (its completed effects are committed `done`, and replay from the WAL then).
    What it streamed was counted against max_tokens as it settled."""
    ctx = flight.ctx
    if ctx.completed_effects and not state.lease_lost:
        record_failure(state, flight, f"cancelled: {ctx.token.reason}", retrying=True)
    elif state.plan.status.get(flight.step_id) == StepStatus.PENDING:
        state.plan.requeue(flight.step_id)


# --- failed attempts ------------------------------------------------------------------------
def step_failed(state: RunState, step_id: str, exc: Exception, flight: InFlight | None) -> None:
    """A failed attempt (the step's own, or one an inbox event reported: `flight` is then
    None for a step that was not running): retry with backoff, then its failure policy."""
    extra = {"task_id": state.lease.task_id, "step_id": step_id, "lease_epoch": state.lease.epoch}
    attempts = state.plan.attempts.get(step_id, 0) + 1
    cause = exc.error if isinstance(exc, EffectFailed) else exc
    fingerprint = failure_fingerprint(cause)
    if isinstance(cause, StepTimedOut) and flight is not None and \
            outage.database_unreachable_since(flight.started_at.timestamp()):
        # Its time may have gone waiting for the database (a restart, a failover), not on its
        # own work: never "the same way" as another attempt, so an outage does not turn a
        # timeout that happens once into a step that needs a human.
        fingerprint = hashlib.sha256(f"{step_id} timed out during a database outage: attempt {attempts}"
                                     .encode()).hexdigest()[:32]
    repeated = state.plan.fingerprints.get(step_id) == fingerprint
    verdict = retry_or_give_up(step_id, cause, attempts=attempts, repeated=repeated,
                               winding_down=state.token.cancelled, max_attempts=harness.step_max_attempts)
    retrying = isinstance(verdict, Retry)
    error = f"{type(exc).__name__}: {exc}\n{''.join(traceback.format_tb(exc.__traceback__)[-3:])}"
    log.warning("step failed (attempt %s)%s", attempts, ", retrying" if retrying else "", extra=extra)
    record_failure(state, flight, error, retrying=retrying, fingerprint=fingerprint, step_id=step_id)
    if retrying:
        state.not_before[step_id] = time.monotonic() + verdict.delay
    elif not state.lease_lost:
        give_up(state, step_id, verdict.why)


def give_up(state: RunState, step_id: str, why: str) -> None:
    """A step failed for good: apply its failure policy (FAILURE_POLICIES)."""
    policy = state.plan.on_failure.get(step_id) or state.task_type.on_step_failure
    if policy == "skip":
        try:
            with transaction.atomic():
                task = leases.lock_fenced(state.lease)
                skipped = checkpoint.skip_steps(task, state.plan, step_id, why, by="policy")
        except LeaseLost:
            state.lose_lease()
            return
        state.plan.version += 1
        for sid in skipped:
            state.plan.set_status(sid, StepStatus.SKIPPED)
            state.skipped[sid] = why if sid == step_id else f"skipped: depends on {step_id}, which was skipped"
        log.warning("step skipped by its failure policy; the task goes on",
                    extra={"task_id": state.lease.task_id, "step_id": step_id, "skipped": skipped})
    elif policy == "fail":
        state.failure = why
    else:
        state.needs_human = f"{why}. Fix the cause and resume, or skip the step."


def record_failure(state: RunState, flight: InFlight | None, error: str, *, retrying: bool,
                   fingerprint: str = "", step_id: str = "") -> None:
    try:
        checkpoint.commit_step_failure(
            lease=state.lease, plan=state.plan, step_id=flight.step_id if flight else step_id, error=error,
            retrying=retrying, effects=flight.ctx.completed_effects if flight else [],
            started_at=flight.started_at if flight else timezone.now(),
            reads=flight.ctx.params.keys_read if flight else [], fingerprint=fingerprint)
    except LeaseLost:
        state.lose_lease()


def diverge(state: RunState, why: str, effects: list) -> None:
    """The database lost checkpoints this run had committed (checkpoint.CheckpointDiverged):
    record the effects that did happen, stop, and let the next run start from the
    database's state (pure steps are recomputed; effects replay from the WAL)."""
    log.warning("checkpoint diverged: the run restarts from the database (%s)", why,
                extra={"task_id": state.lease.task_id, "lease_epoch": state.lease.epoch})
    state.diverged = why
    state.token.cancel("restart from the database")
    if any(not e.committed for e in effects):
        try:
            with transaction.atomic():
                leases.hold_fenced(state.lease)
                wal.mark_done(effects)
        except LeaseLost:
            state.lose_lease()
