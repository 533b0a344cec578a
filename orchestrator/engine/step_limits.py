"""Limits inside running steps: a step's timeout, max_seconds and max_tokens running out while
steps run, and a Pause's grace. Checked by the supervisor's step clock (no database needed);
a step's options (timeout, safe_to_cancel) come from its StepSpec, else the defaults."""
import logging
import time

from django.conf import settings

from .run_state import LIMIT_CUT, PAUSE_CUT, STEP_TIMEOUT, RunState

log = logging.getLogger("orchestrator.engine.runner")  # a run's lines keep the runner's logger


def supervise_steps(state: RunState) -> None:
    """From the supervisor, while steps run: cancel a step past its timeout (a failed
    attempt); when max_seconds or max_tokens runs out inside a step, or a Pause's grace is
    over, cut the steps that are safe to cut (they run again on resume) and let the others
    finish; the task then pauses with its work kept."""
    if not state.flights:
        return
    now = time.monotonic()
    for step_id, (deadline, seconds) in list(state.deadlines.items()):
        ctx = state.flights.get(step_id)
        if ctx is not None and now >= deadline and ctx.token.cancel(STEP_TIMEOUT):
            log.warning("step timed out after %g s: cancelled", seconds,
                        extra={"task_id": state.lease.task_id, "step_id": step_id})
    reason = ""
    if not state.limit_hit:
        limit = limit_inside_steps(state, now)
        if limit:
            state.limit_hit = limit  # halts the loop: no step starts; the task pauses
            log.info("limit %s ran out inside a running step", limit, extra={"task_id": state.lease.task_id})
    if state.limit_hit in ("max_seconds", "max_tokens"):
        reason = LIMIT_CUT + state.limit_hit
    elif state.control == "pause" and now - state.control_seen_at >= settings.ORCH_PAUSE_GRACE_SECONDS:
        reason = PAUSE_CUT
    if reason:
        for step_id, ctx in list(state.flights.items()):
            if not ctx.token.cancelled and options_of(state, step_id)[1] and ctx.cut(reason):
                log.info("step cut (%s): it runs again on resume", reason,
                         extra={"task_id": state.lease.task_id, "step_id": step_id})


def limit_inside_steps(state: RunState, now: float) -> str:
    """max_seconds or max_tokens, if it ran out counting what the running steps used so far."""
    if state.base_active_seconds + (now - state.started) >= float(state.limits["max_seconds"]):
        return "max_seconds"
    running = sum(ctx.tokens_used for ctx in list(state.flights.values()))
    if running and state.base_tokens + state.tokens_this_run() + running >= int(state.limits["max_tokens"]):
        return "max_tokens"
    return ""


def options_of(state: RunState, step_id: str) -> tuple[float | None, bool]:
    """(timeout in seconds or None, safe_to_cancel) of a step: its StepSpec's, else the type's
    and the installation's defaults. The specs are the type's plan for the current params
    (the plan rows keep no options) plus the steps added in this run."""
    if state.spec_options is None:
        state.spec_options = {}
        try:
            note_specs(state, state.task_type.plan(state.params))
        except Exception:  # the rows are the plan; without its specs the defaults apply
            log.warning("the type's plan could not be read for its steps' options; the defaults apply",
                        exc_info=True, extra={"task_id": state.lease.task_id})
    timeout, safe = state.spec_options.get(step_id, (None, True))
    if timeout is None:
        timeout = getattr(state.task_type, "step_timeout", None)
    if timeout is None:
        timeout = settings.ORCH_STEP_TIMEOUT_SECONDS if settings.ORCH_STEP_TIMEOUT_SECONDS > 0 else None
    return timeout, safe


def note_specs(state: RunState, specs) -> None:
    if state.spec_options is None:
        return  # not read yet: the first read takes the plan (added specs come with the run)
    for spec in specs:
        timeout, safe = getattr(spec, "timeout", None), getattr(spec, "safe_to_cancel", True)
        if timeout is not None or not safe:
            state.spec_options[spec.id] = (timeout, safe)
