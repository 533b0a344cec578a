"""The state of one run (slice) of a task: every field the runner and its pieces share,
declared here and loaded from the task row in one place (`RunState.load`).

The supervisor thread writes a few of them (`control`, `inbox_signal`, `yield_slot`,
`lease_lost`); everything else belongs to the runner's loop. Nothing here touches the
database, so `decision.decide` can judge a state built in a unit test.
"""
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from ..conf import harness
from ..models import StepStatus, Task
from ..primitives.cancellation import CancellationToken
from ..tasktypes import get_type
from .plan_state import PlanState
from .context import LimitExceeded, StepContext
from .lease import LEASE_LOST, Lease

# The cancellation reasons of one step's token, which tell its settlement what happened:
PREEMPTED = "preempted"  # the cancellation reason of a step interrupted by a preempt event
UNIT_FAILED = "failed outside the task"  # ... of a running step a unit.failed event names
STEP_TIMEOUT = "step timeout"  # ... of a step that ran past its timeout (a failed attempt)
PAUSE_CUT = "pause grace over"  # ... of a step cut by a Pause after its grace (it runs again on resume)
LIMIT_CUT = "limit: "  # + the limit: ... of a step cut by a limit running out (runs again on resume)


@dataclass
class InFlight:
    step_id: str
    ctx: StepContext
    started_at: datetime


@dataclass
class RunState:
    lease: Lease
    # In an isolated executor a watchdog kills the process tree when a Stop outlives
    # its grace period, so a step that is the only one that can run may run on this
    # thread (no thread-pool hop). Unwatched, steps always run in the pool, so this
    # loop can escalate a Stop that a step ignores.
    watched: bool = False
    token: CancellationToken = field(init=False)
    control: str = ""
    lease_lost: bool = False
    diverged: str = ""  # why this run's plan is ahead of the database (it restarts from it)
    failure: str = ""
    needs_human: str = ""
    ambiguous: list = field(default_factory=list)
    not_before: dict[str, float] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)
    accounted: float = field(init=False)
    control_seen_at: float = 0.0
    escalated: bool = False
    limit_hit: str = ""
    limit_detail: str = ""  # a step's LimitExceeded.detail: said in the pause's reason
    # Tokens spent in this run by steps that settled (written with the run's outcome).
    spent_tokens: int = 0
    # Set by the supervisor while recovered tasks wait for a slot (leases.should_yield_to_recovered).
    yield_slot: bool = False
    subtasks_lock: threading.Lock = field(default_factory=threading.Lock)
    live_subtasks: int = 0
    # The inbox: the supervisor copies Task.inbox_seq here; the loop consumes at its next
    # resume point when it moved (or when a merging event becomes visible).
    inbox_signal: int = 0
    inbox_consumed_at: int = -1
    inbox_next_at: datetime | None = None
    # Durable waits: those recorded on the task (deadlines kept across runs), and the
    # steps that asked to wait in this run (the task goes `waiting` when nothing else runs).
    waits: dict[str, dict] = field(default_factory=dict)
    parked: dict[str, dict] = field(default_factory=dict)
    # Preemption (engine/preemption.py): the contexts of the steps in flight (cancelled
    # when a preempt arrives), and the steps it interrupted (recorded in the frame).
    flights: dict[str, StepContext] = field(default_factory=dict)
    preempting: bool = False
    preempt_seen_at: datetime | None = None
    interrupted: list[str] = field(default_factory=list)
    # P2 unit.failed: failures reported for steps in flight (applied when they settle)
    # and for pending steps (applied once the consumption committed).
    unit_failures: dict[str, Exception] = field(default_factory=dict)
    unit_failures_pending: list[tuple[str, Exception]] = field(default_factory=list)
    # Starting a step and holding the starts (an operator request seen) exclude each other:
    # once held, no step starts, so none has a start after the request's acknowledgement.
    start_gate: threading.Lock = field(default_factory=threading.Lock)
    starts_held: bool = False
    # In-step limits: each running step's deadline (its timeout) and the options of the
    # steps that declare their own (StepSpec.timeout / safe_to_cancel), read lazily.
    deadlines: dict[str, tuple[float, float]] = field(default_factory=dict)
    spec_options: dict[str, tuple[float | None, bool]] | None = None
    # Loaded from the task row when the run starts (load), then the plan and its results.
    task_type: Any = None
    params: Any = None
    limits: dict = field(default_factory=dict)
    base_active_seconds: float = 0.0
    base_tokens: int = 0
    awaited: tuple[str, ...] = ()
    plan: PlanState = field(default_factory=PlanState)
    results: Any = None
    skipped: dict[str, str] = field(default_factory=dict)
    # Steps whose checkpoint with effects at commit was refused: their retries perform them in
    # place (engine/at_commit.py), so their code sees the error.
    effects_in_place: set[str] = field(default_factory=set)

    def __post_init__(self):
        self.token = CancellationToken(f"task-{self.lease.task_id}")
        self.accounted = self.started

    def load(self, task: Task) -> None:
        """What this run takes from the task row as it starts."""
        self.task_type = get_type(task.type)
        self.params = self.task_type.Params.model_validate(task.params)
        self.limits = {**harness.default_limits, **task.limits}
        self.base_active_seconds, self.base_tokens = task.active_seconds, task.tokens_used
        self.waits = {w["step"]: w for w in task.waiting_for or [] if isinstance(w, dict) and w.get("step")}
        self.awaited = tuple(getattr(self.task_type, "awaited_event_types", ()))
        self.inbox_signal = task.inbox_seq
        self.inbox_consumed_at = -1 if task.inbox_pending else task.inbox_seq  # events sent while it waited
        self.starts_held = bool(task.control)  # a request made between slices: the supervisor acknowledges it

    # --- what a step's context asks of its run (engine/context.py) --------------------------
    def tokens_this_run(self) -> int:
        return self.spent_tokens

    def recorded_wait(self, step_id: str, event_type: str) -> datetime | None:
        """The deadline of `step_id`'s wait for `event_type`, if an earlier run recorded one."""
        wait = self.waits.get(step_id)
        if not wait or wait.get("type") != event_type or not wait.get("until"):
            return None
        return datetime.fromisoformat(wait["until"])

    def reserve_subtask(self) -> None:
        with self.subtasks_lock:
            if self.live_subtasks >= int(self.limits["max_subtasks"]):
                raise LimitExceeded("max_subtasks")
            self.live_subtasks += 1

    def release_subtask(self) -> None:
        with self.subtasks_lock:
            self.live_subtasks -= 1

    # --- what the loop asks --------------------------------------------------------------------
    def lose_lease(self) -> None:
        self.lease_lost = True
        self.token.cancel("lease lost")

    def take_active_seconds(self) -> float:
        now = time.monotonic()
        delta, self.accounted = now - self.accounted, now
        return delta

    def all_done(self) -> bool:
        return self.plan.all_finished()

    def waiting_for_retry(self) -> bool:
        return any(self.plan.status[s] == StepStatus.PENDING for s in self.not_before)

    def grace_expired(self) -> bool:
        if self.control == "terminate":
            return True
        return self.control == "stop" and time.monotonic() - self.control_seen_at > harness.grace_seconds

    def halt_reason(self) -> str:
        if self.lease_lost:
            return LEASE_LOST
        if self.diverged:
            return "diverged"
        if self.control:
            return self.control
        if self.failure or self.ambiguous or self.needs_human:
            return "failure"
        if self.limit_reached():
            return "limit"
        if time.monotonic() - self.started > harness.slice_seconds or self.yield_slot:
            return "slice"
        return ""

    def limit_reached(self) -> str:
        if self.limit_hit:
            return self.limit_hit
        if self.plan.done_count() >= int(self.limits["max_steps"]) and not self.all_done():
            return "max_steps"
        if self.base_tokens + self.tokens_this_run() >= int(self.limits["max_tokens"]):
            return "max_tokens"
        if self.base_active_seconds + (time.monotonic() - self.started) >= float(self.limits["max_seconds"]):
            return "max_seconds"
        return ""
