"""What a step's code raises to the runner, or is raised at it: a limit ran out, a wait parks the
task, a timeout. Plain classes on the primitives' bases, so that any engine module can raise or
catch them without importing the step context (engine/context.py re-exports them)."""
from datetime import datetime

from ..primitives.errors import HarnessError, StepSignal


class LimitExceeded(StepSignal):
    """A task limit ran out inside a step: the task pauses with this reason, keeping its work."""

    def __init__(self, limit: str, detail: str = ""):
        # `detail` says why, for the operator (the task's status_reason: "limit: L (detail)").
        super().__init__(f"limit: {limit}" + (f" ({detail})" if detail else ""))
        self.limit, self.detail = limit, detail


class StepTimedOut(HarnessError, TimeoutError):
    """The step ran past its timeout (StepSpec.timeout) and was cancelled: a failed attempt."""

    def __init__(self, step_id: str, seconds: float):
        super().__init__(f"step {step_id} ran longer than its timeout of {seconds:g} s and was cancelled "
                         f"(raise StepSpec.timeout, the type's step_timeout or ORCH_STEP_TIMEOUT_SECONDS if it "
                         f"needs longer)")
        self.seconds = seconds


class WaitForEvent(StepSignal):
    """Raised by ctx.wait_for when the event has not arrived: the runner parks the task in
    `waiting` (no worker held) until it does or the deadline passes; the step runs again then."""

    def __init__(self, event_type: str, until: datetime | None, match: dict | None = None):
        super().__init__(f"waiting for {event_type}" + (f" with {match}" if match else "")
                         + (f" until {until.isoformat()}" if until else ""))
        # `match` is kept with the wait, so only an event that fits it wakes the task.
        self.event_type, self.until, self.match = event_type, until, dict(match or {})


class WaitTimedOut(HarnessError, TimeoutError):
    """ctx.wait_for's deadline passed before the event came (the step may catch it)."""
