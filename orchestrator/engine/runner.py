"""The runner: drives one task's steps in dependency order while holding its lease.

Independent steps run concurrently (up to the task's `max_subtasks`) in threads; only
this loop commits step checkpoints, so commits are serialised and fenced on the lease.
A supervisor thread heartbeats the lease and polls operator requests every ORCH_CONTROL_POLL_SECONDS (50 ms).

The loop ends when every step is done, a step fails for good, an effect is ambiguous
(review), an operator asked to pause/stop/terminate, a limit ran out (pause), the lease
was lost, or the time slice is used up (the task re-enqueues itself and any worker
continues it from its checkpoint).
"""
import hashlib
import logging
import re
import threading
import time
import traceback
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from datetime import datetime

from django.conf import settings
from django.db import DatabaseError, close_old_connections, connection, transaction
from django.db.models import Exists
from django.utils import timezone

from .. import telemetry
from ..conf import harness
from ..outage import DATABASE_DOWN, OutageWatch, retry_while_down
from ..models import InboundState, Step, StepStatus, Task, TaskStatus as S
from ..tasktypes import get_type
from . import checkpoint, inbox, lease as leases, preemption, recovery, results, reviews, run_gate, scheduler, states, wal
from ..primitives.cancellation import CancellationToken, Cancelled
from .context import LimitExceeded, StepContext, StepTimedOut, WaitForEvent
from .lease import Lease, LeaseLost
from .wal import AmbiguousEffect, EffectFailed
from .events import append_event
from .preemption import top_finished
from ..primitives.errors import HarnessError

log = logging.getLogger(__name__)

PREEMPTED = "preempted"  # the cancellation reason of a step interrupted by a preempt event
UNIT_FAILED = "failed outside the task"  # ... of a running step a unit.failed event names
STEP_TIMEOUT = "step timeout"  # ... of a step that ran past its timeout (a failed attempt)
PAUSE_CUT = "pause grace over"  # ... of a step cut by a Pause after its grace (it runs again on resume)
LIMIT_CUT = "limit: "  # + the limit: ... of a step cut by a limit running out (runs again on resume)


class UpstreamFailure(HarnessError):
    """A step's failure reported from outside the task (a P2 unit.failed event)."""

RETRY_BACKOFF_BASE_SECONDS = 0.5
RETRY_BACKOFF_MAX_SECONDS = 30.0


@dataclass
class InFlight:
    step_id: str
    ctx: StepContext
    started_at: datetime


def failure_fingerprint(exc: BaseException) -> str:
    """Exception type + message with the volatile parts (numbers, hex ids, addresses)
    normalised: two failures with one fingerprint are the same failure."""
    message = re.sub(r"0x[0-9a-fA-F]+|\b[0-9a-f]{8,}\b|\d+", "#", str(exc))
    return hashlib.sha256(f"{type(exc).__module__}.{type(exc).__qualname__}:{message}".encode()).hexdigest()[:32]


def close_thread_connections(pool: ThreadPoolExecutor) -> None:
    """Close the database connection each pool thread opened (Django connections are
    per thread; a long-lived worker process must not leak one per task run). The barrier
    makes every thread take exactly one close job."""
    threads = len(getattr(pool, "_threads", ()))
    if not threads:
        return
    barrier = threading.Barrier(threads)

    def close():
        connection.close()
        try:
            barrier.wait(timeout=5)
        except threading.BrokenBarrierError:
            pass

    for future in [pool.submit(close) for _ in range(threads)]:
        future.result(timeout=10)


class Supervisor(threading.Thread):
    """Heartbeats the lease, relays operator requests to the runner (polled every
    ORCH_CONTROL_POLL_SECONDS, so a Stop reaches a step without waiting for it to end), acknowledges them,
    and while a request winds down publishes what is still running."""

    def __init__(self, runner: "Runner"):
        super().__init__(name=f"supervisor-task-{runner.lease.task_id}", daemon=True)
        self.runner = runner
        self._stopped = threading.Event()
        self.published_activities = -1
        self.beat_activities = -1

    def run(self) -> None:
        lease = self.runner.lease
        database = OutageWatch(log, f"supervisor of task {lease.task_id}")
        next_beat = time.monotonic() + harness.heartbeat_seconds
        threading.Thread(target=self.step_clock, name=f"step-clock-task-{lease.task_id}", daemon=True).start()
        try:
            while not self._stopped.wait(harness.control_poll_seconds):
                try:
                    row = (Task.objects.filter(pk=lease.task_id)
                           .annotate(recovered_waiting=Exists(leases.recovered_waiting()))
                           .values("control", "lease_epoch", "lease_owner", "inbox_seq", "recovered_waiting").first())
                    if row is None or row["lease_epoch"] != lease.epoch or row["lease_owner"] != lease.owner:
                        self.runner.lose_lease()
                        return
                    if row["control"] and row["control"] != self.runner.control:
                        # No step starts from here on (so none starts after the acknowledgement);
                        # acknowledge before acting: once the steps wind down the run may end
                        # (and give up its lease) at any moment.
                        self.runner.hold_starts()
                        acknowledge(lease, row["control"])
                        self.runner.request(row["control"])
                    if row["inbox_seq"] != self.runner.inbox_signal:
                        self.runner.inbox_signal = row["inbox_seq"]  # the runner consumes at its next resume point
                        if inbox.preempt_pending(lease.task_id):
                            self.runner.request_preempt()
                    if self.runner.control:
                        self.publish_activities()
                    if time.monotonic() >= next_beat:
                        if not leases.heartbeat(lease, self.activities_changed()):
                            self.runner.lose_lease()
                            return
                        next_beat = time.monotonic() + harness.heartbeat_seconds
                    if (row["recovered_waiting"] and not self.runner.yield_slot
                            and leases.should_yield_to_recovered(lease.task_id)):
                        self.runner.yield_slot = True  # ends the slice at the next step boundary
                except LeaseLost:
                    self.runner.lose_lease()
                    return
                except DATABASE_DOWN as exc:  # an outage must not kill the heartbeat: keep trying
                    database.failed(exc, task_id=lease.task_id)
                except DatabaseError:
                    log.warning("supervisor: database error", exc_info=True, extra={"task_id": lease.task_id})
                else:
                    database.succeeded(task_id=lease.task_id)
        finally:
            connection.close()

    def step_clock(self) -> None:
        """Step timeouts, limits inside steps and a Pause's grace (Runner.supervise_steps), on a
        thread of their own: they need no database, and the poll above waits on it — with the
        database down or hanging, a step ran past its timeout until it was back (found by the
        soak: a POST held 6 s by its upstream, its step's 3 s timeout never cut it)."""
        while not self._stopped.wait(harness.control_poll_seconds):
            try:
                self.runner.supervise_steps()
            except Exception:  # a fault in the in-step checks must not stop the clock
                log.exception("supervisor: checking the running steps failed",
                              extra={"task_id": self.runner.lease.task_id})

    def activities_changed(self) -> list[dict] | None:
        """What runs now, if it changed since the last heartbeat (None: unchanged)."""
        version = self.runner.token.activities_version
        if version == self.beat_activities:
            return None
        self.beat_activities = version
        return self.runner.token.activities()

    def publish_activities(self) -> None:
        """While a request winds down: what still runs, durable and in the event log (so
        the task page, which follows events, shows it live)."""
        version = self.runner.token.activities_version
        if version == self.published_activities:
            return
        activities = self.runner.token.activities()
        with transaction.atomic():
            task = leases.lock_fenced(self.runner.lease)
            task.activities = activities
            task.save(update_fields=["activities"])
            append_event(task, "winding_down", {"still_running": [f"{a['kind']}: {a['label']}" for a in activities]})
        self.published_activities = version

    def stop(self) -> None:
        self._stopped.set()


def acknowledge(lease: Lease, control: str) -> None:
    """Record that the runner saw an operator request (the Stop -> acknowledge latency)."""
    with transaction.atomic():
        task = leases.lock_fenced(lease)
        task.control_acknowledged_at = timezone.now()
        task.save(update_fields=["control_acknowledged_at"])
        append_event(task, "control_acknowledged", {"control": control, "worker": lease.owner})
        inbox.settle_control(task, control, f"acknowledged by worker {lease.owner}: the running steps are "
                                            f"{'cancelled' if control in ('stop', 'terminate') else 'let finish'}")


class Runner:
    def __init__(self, lease: Lease, *, watched: bool = False):
        self.lease = lease
        # In an isolated executor a watchdog kills the process tree when a Stop outlives
        # its grace period, so a step that is the only one that can run may run on this
        # thread (no thread-pool hop). Unwatched, steps always run in the pool, so this
        # loop can escalate a Stop that a step ignores.
        self.watched = watched
        self.token = CancellationToken(f"task-{lease.task_id}")
        self.control: str = ""
        self.lease_lost = False
        self.diverged: str = ""  # why this run's plan is ahead of the database (it restarts from it)
        self.failure: str = ""
        self.needs_human: str = ""
        self.ambiguous: list = []
        self.not_before: dict[str, float] = {}
        self.started = time.monotonic()
        self.accounted = self.started
        self.control_seen_at = 0.0
        self.escalated = False
        self.limit_hit = ""
        self.limit_detail = ""  # a step's LimitExceeded.detail: said in the pause's reason
        # Set by the supervisor while recovered tasks wait for a slot (leases.should_yield_to_recovered).
        self.yield_slot = False
        self._subtasks_lock = threading.Lock()
        self.live_subtasks = 0
        # The inbox: the supervisor copies Task.inbox_seq here; the loop consumes at its next
        # resume point when it moved (or when a merging event becomes visible).
        self.inbox_signal = 0
        self.inbox_consumed_at = -1
        self.inbox_next_at = None
        # Durable waits: those recorded on the task (deadlines kept across runs), and the
        # steps that asked to wait in this run (the task goes `waiting` when nothing else runs).
        self.waits: dict[str, dict] = {}
        self.parked: dict[str, dict] = {}
        # Preemption (engine/preemption.py): the contexts of the steps in flight (cancelled
        # when a preempt arrives), and the steps it interrupted (recorded in the frame).
        self.flights: dict[str, StepContext] = {}
        self.preempting = False
        self.preempt_seen_at = None
        self.interrupted: list[str] = []
        # P2 unit.failed: failures reported for steps in flight (applied when they settle)
        # and for pending steps (applied once the consumption committed).
        self.unit_failures: dict[str, Exception] = {}
        self.unit_failures_pending: list[tuple[str, Exception]] = []
        # Starting a step and holding the starts (an operator request seen) exclude each other:
        # once held, no step starts, so none has a start after the request's acknowledgement.
        self._start_gate = threading.Lock()
        self.starts_held = False
        # In-step limits: each running step's deadline (its timeout) and the options of the
        # steps that declare their own (StepSpec.timeout / safe_to_cancel), read lazily.
        self.deadlines: dict[str, tuple[float, float]] = {}
        self.spec_options: dict[str, tuple[float | None, bool]] | None = None

    # --- signals from the supervisor ------------------------------------------------
    def request(self, control: str) -> bool:
        """Take an operator request; True the first time it is seen."""
        if control == self.control:
            return False
        self.control = control
        self.control_seen_at = time.monotonic()
        log.info("operator request: %s", control, extra={"task_id": self.lease.task_id, "worker": self.lease.owner})
        if control in ("stop", "terminate"):
            self.token.cancel(control)
        return True

    def hold_starts(self) -> None:
        with self._start_gate:
            self.starts_held = True

    def supervise_steps(self) -> None:
        """From the supervisor, while steps run: cancel a step past its timeout (a failed
        attempt); when max_seconds or max_tokens runs out inside a step, or a Pause's grace is
        over, cut the steps that are safe to cut (they run again on resume) and let the others
        finish; the task then pauses with its work kept."""
        if not self.flights:
            return
        now = time.monotonic()
        for step_id, (deadline, seconds) in list(self.deadlines.items()):
            ctx = self.flights.get(step_id)
            if ctx is not None and now >= deadline and ctx.token.cancel(STEP_TIMEOUT):
                log.warning("step timed out after %g s: cancelled", seconds,
                            extra={"task_id": self.lease.task_id, "step_id": step_id})
        reason = ""
        if not self.limit_hit:
            limit = self.limit_inside_steps(now)
            if limit:
                self.limit_hit = limit  # halts the loop: no step starts; the task pauses
                log.info("limit %s ran out inside a running step", limit, extra={"task_id": self.lease.task_id})
        if self.limit_hit in ("max_seconds", "max_tokens"):
            reason = LIMIT_CUT + self.limit_hit
        elif self.control == "pause" and now - self.control_seen_at >= settings.ORCH_PAUSE_GRACE_SECONDS:
            reason = PAUSE_CUT
        if reason:
            for step_id, ctx in list(self.flights.items()):
                if not ctx.token.cancelled and self.options_of(step_id)[1] and ctx.cut(reason):
                    log.info("step cut (%s): it runs again on resume", reason,
                             extra={"task_id": self.lease.task_id, "step_id": step_id})

    def limit_inside_steps(self, now: float) -> str:
        """max_seconds or max_tokens, if it ran out counting what the running steps used so far."""
        if self.base_active_seconds + (now - self.started) >= float(self.limits["max_seconds"]):
            return "max_seconds"
        running = sum(ctx.tokens_used for ctx in list(self.flights.values()))
        if running and self.base_tokens + self.tokens_this_run() + running >= int(self.limits["max_tokens"]):
            return "max_tokens"
        return ""

    def options_of(self, step_id: str) -> tuple[float | None, bool]:
        """(timeout in seconds or None, safe_to_cancel) of a step: its StepSpec's, else the type's
        and the installation's defaults. The specs are the type's plan for the current params
        (the plan rows keep no options) plus the steps added in this run."""
        if self.spec_options is None:
            self.spec_options = {}
            try:
                self.note_specs(self.task_type.plan(self.params))
            except Exception:  # the rows are the plan; without its specs the defaults apply
                log.warning("the type's plan could not be read for its steps' options; the defaults apply",
                            exc_info=True, extra={"task_id": self.lease.task_id})
        timeout, safe = self.spec_options.get(step_id, (None, True))
        if timeout is None:
            timeout = getattr(self.task_type, "step_timeout", None)
        if timeout is None:
            timeout = settings.ORCH_STEP_TIMEOUT_SECONDS if settings.ORCH_STEP_TIMEOUT_SECONDS > 0 else None
        return timeout, safe

    def note_specs(self, specs) -> None:
        if self.spec_options is None:
            return  # not read yet: the first read takes the plan (added specs come with the run)
        for spec in specs:
            timeout, safe = getattr(spec, "timeout", None), getattr(spec, "safe_to_cancel", True)
            if timeout is not None or not safe:
                self.spec_options[spec.id] = (timeout, safe)

    # --- subtasks -------------------------------------------------------------------------
    def reserve_subtask(self) -> None:
        with self._subtasks_lock:
            if self.live_subtasks >= int(self.limits["max_subtasks"]):
                raise LimitExceeded("max_subtasks")
            self.live_subtasks += 1

    def release_subtask(self) -> None:
        with self._subtasks_lock:
            self.live_subtasks -= 1

    def lose_lease(self) -> None:
        self.lease_lost = True
        self.token.cancel("lease lost")

    def request_preempt(self) -> None:
        """A preempt is pending: cancel the steps in flight (P0); the loop starts nothing new
        and applies it once they have wound down."""
        if self.preempting:
            return
        self.preempting, self.preempt_seen_at = True, timezone.now()
        flights = list(self.flights.values())
        log.info("preempt: interrupting %d step(s) in flight", len(flights), extra={"task_id": self.lease.task_id})
        for ctx in flights:
            ctx.token.cancel(PREEMPTED)

    def diverge(self, why: str, effects: list) -> None:
        """The database lost checkpoints this run had committed (checkpoint.CheckpointDiverged):
        record the effects that did happen, stop, and let the next run start from the
        database's state (pure steps are recomputed; effects replay from the WAL)."""
        log.warning("checkpoint diverged: the run restarts from the database (%s)", why,
                    extra={"task_id": self.lease.task_id, "lease_epoch": self.lease.epoch})
        self.diverged = why
        self.token.cancel("restart from the database")
        if any(not e.committed for e in effects):
            try:
                with transaction.atomic():
                    leases.lock_fenced(self.lease)
                    wal.mark_done(effects)
            except LeaseLost:
                self.lose_lease()

    # --- the loop -----------------------------------------------------------------------
    @telemetry.traced_run
    def run(self) -> str:
        # An executor started while the database is away waits for it rather than crash
        # (a crash would cost the task a recovery attempt).
        task = retry_while_down(lambda: Task.objects.get(pk=self.lease.task_id),
                                seconds=harness.database_retry_seconds, logger=log, what="the run's start",
                                extra={"task_id": self.lease.task_id})
        task_type = get_type(task.type)
        self.params = task_type.Params.model_validate(task.params)
        self.task_type = task_type
        self.limits = {**harness.default_limits, **task.limits}
        self.base_active_seconds, self.base_tokens = task.active_seconds, task.tokens_used
        self.waits = {w["step"]: w for w in task.waiting_for or [] if isinstance(w, dict) and w.get("step")}
        self.awaited = tuple(getattr(task_type, "awaited_event_types", ()))
        self.inbox_signal = task.inbox_seq
        self.inbox_consumed_at = -1 if task.inbox_pending else task.inbox_seq  # events sent while it waited
        self.starts_held = bool(task.control)  # a request made between slices: the supervisor acknowledges it
        try:
            # Code changed since the task last ran (a deploy): the type's policy first (engine/run_gate.py).
            gate = retry_while_down(
                lambda: run_gate.at_run_start(lease=self.lease, task=task, task_type=task_type),
                seconds=harness.database_retry_seconds, logger=log, what="the compatibility gate",
                extra={"task_id": task.pk})
            if gate.held:
                return gate.held
            if gate.params is not None:
                self.params = task_type.Params.model_validate(gate.params)
            self.plan = retry_while_down(
                lambda: checkpoint.ensure_plan(lease=self.lease, task_type=task_type, params=self.params),
                seconds=harness.database_retry_seconds, logger=log, what="loading the plan",
                extra={"task_id": task.pk})
        except LeaseLost:
            log.info("lease lost before the run started", extra={"task_id": task.pk, "lease_epoch": self.lease.epoch})
            return "lease lost"
        # Results are loaded when a dependant needs them (a long plan's results are not all
        # held in memory); those of the latest steps stay cached for their dependants.
        self.results = results.ResultCache(task.pk)

        def load_the_rest():
            self.skipped = dict(Step.objects.filter(task_id=task.pk, status=StepStatus.SKIPPED)
                                .values_list("step_id", "error"))
            if task.recovering_since is not None:
                # Its state loaded and its lease held: the recovery got the task going again.
                self.lease.fenced().update(recovering_since=None)

        # The lease is held from here on: heartbeat it (and relay requests) while the rest loads.
        supervisor = Supervisor(self)
        supervisor.start()
        try:
            # Like the plan: the database going away now is waited out, not a crash.
            retry_while_down(load_the_rest, seconds=harness.database_retry_seconds, logger=log,
                             what="loading the run's state", extra={"task_id": task.pk})
        except BaseException:
            supervisor.stop()
            raise
        pool = ThreadPoolExecutor(max_workers=max(1, int(self.limits["max_subtasks"])),
                                  thread_name_prefix=f"task-{task.pk}-step")
        in_flight: dict[Future, InFlight] = {}
        try:
            while True:
                if top_finished(self.plan) and not self.lease_lost and not self.diverged:
                    self.pop_frame()
                halt = self.halt_reason()
                # A preempt waits for the steps in flight to wind down: that is its resume point.
                held = self.preempting and bool(in_flight)
                if not halt and not held and self.inbox_due():
                    self.consume_inbox()  # a resume point: before the next steps start
                    halt = self.halt_reason()
                if not halt and not held and self.submit_ready(pool, in_flight):
                    continue  # a step ran on this thread: look again at once
                if not in_flight:
                    if self.starts_held and not halt:
                        time.sleep(0.02)  # a request is being acknowledged: the supervisor hands it over next
                        continue
                    if halt or self.all_done() or not self.waiting_for_retry():
                        break
                    time.sleep(0.05)
                    continue
                if self.grace_expired():
                    # The steps ignored the cancellation for the whole grace period: stop
                    # waiting for them (in an isolated executor, the worker kills the tree).
                    self.escalated = True
                    break
                finished, _ = wait(in_flight, timeout=0.1, return_when=FIRST_COMPLETED)
                for future in finished:
                    self.settle(future, in_flight.pop(future))
        finally:
            supervisor.stop()
            abandon = self.control == "terminate" or self.escalated
            if not abandon:
                close_thread_connections(pool)
            pool.shutdown(wait=not abandon, cancel_futures=True)
        return self.finish()

    # --- the inbox ---------------------------------------------------------------------------
    def inbox_due(self) -> bool:
        if self.inbox_signal != self.inbox_consumed_at:
            return True
        return self.inbox_next_at is not None and timezone.now() >= self.inbox_next_at

    def consume_inbox(self) -> None:
        """Apply the pending inbox events (P1 and below) as one checkpoint (checkpoint.commit_events)."""
        signal, now = self.inbox_signal, timezone.now()
        events = retry_while_down(lambda: inbox.due(self.lease.task_id, now, self.awaited),
                                  seconds=harness.database_retry_seconds, logger=log, what="reading the inbox",
                                  extra={"task_id": self.lease.task_id})
        consumed, accepted, stack = [], [], None
        for event in events:
            frame = None
            if event.type == "unit.failed":
                applied = self.fail_unit(event)
            elif event.type == "preempt":
                depth = len(stack if stack is not None else self.plan.stack)
                applied, frame = preemption.apply(self.task_type, event, self.params, self.plan, depth=depth,
                                                  interrupted=self.interrupted, seen_at=self.preempt_seen_at)
            else:
                applied = inbox.apply(self.task_type, event, now)
            if applied.add_steps:
                try:
                    self.plan.validate_growth(f"{inbox.INBOX_ADDER}{event.seq}", accepted + applied.add_steps)
                    accepted.extend(applied.add_steps)
                except checkpoint.InvalidPlanGrowth as exc:
                    applied, frame = inbox.Applied(f"rejected: {exc}", state=InboundState.REJECTED), None
            if frame is not None:
                stack = [*(stack if stack is not None else self.plan.stack), frame]
            consumed.append((event, applied))
        if consumed:
            try:
                checkpoint.commit_events(lease=self.lease, plan=self.plan, consumed=consumed, stack=stack)
            except LeaseLost:
                self.lose_lease()
                return
            except DATABASE_DOWN:
                # Whether the consumption landed is unknown (its reply may be what was lost):
                # the next run reads it from the database instead of guessing.
                self.diverge("the database went away while events were consumed", [])
                return
            log.info("inbox: %d event(s) consumed", len(consumed), extra={"task_id": self.lease.task_id})
        for step_id, failure in self.unit_failures_pending:
            self.step_failed(step_id, failure, None)
        self.unit_failures_pending = []
        if self.preempting and not any(e.type == "preempt" for e in events):
            pass  # the preempt is not visible to this resume point yet: keep holding
        elif self.preempting:
            self.preempting, self.interrupted = False, []
        self.inbox_consumed_at = signal
        self.inbox_next_at = None if len(events) == inbox.CONSUMED_PER_RESUME_POINT else retry_while_down(
            lambda: inbox.next_visible(self.lease.task_id, self.awaited), seconds=harness.database_retry_seconds,
            logger=log, what="reading the inbox", extra={"task_id": self.lease.task_id})
        if len(events) == inbox.CONSUMED_PER_RESUME_POINT:
            self.inbox_consumed_at = -1  # more are waiting: the next resume point takes them

    def pop_frame(self) -> None:
        try:
            preemption.pop(self.lease, self.plan)
        except LeaseLost:
            self.lose_lease()
        except DATABASE_DOWN:
            self.diverge("the database went away while a frame was popped", [])

    def recorded_wait(self, step_id: str, event_type: str) -> datetime | None:
        """The deadline of `step_id`'s wait for `event_type`, if an earlier run recorded one."""
        wait = self.waits.get(step_id)
        if not wait or wait.get("type") != event_type or not wait.get("until"):
            return None
        return datetime.fromisoformat(wait["until"])

    def grace_expired(self) -> bool:
        if self.control == "terminate":
            return True
        return self.control == "stop" and time.monotonic() - self.control_seen_at > harness.grace_seconds

    def halt_reason(self) -> str:
        if self.lease_lost:
            return "lease lost"
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

    def tokens_this_run(self) -> int:
        return getattr(self, "_tokens_this_run", 0)

    def all_done(self) -> bool:
        return self.plan.all_finished()

    def waiting_for_retry(self) -> bool:
        return any(self.plan.status[s] == StepStatus.PENDING for s in self.not_before)

    def submit_ready(self, pool: ThreadPoolExecutor, in_flight: dict) -> bool:
        """Start the steps that are ready; True when one ran (and settled) on this thread."""
        # max_steps bounds what starts: the steps done and those in flight never exceed it.
        capacity = min(max(1, int(self.limits["max_subtasks"])) - len(in_flight),
                       int(self.limits["max_steps"]) - self.plan.done_count() - len(in_flight))
        if capacity <= 0 or self.starts_held:
            return False
        now = time.monotonic()
        # The ready queue holds pending steps whose dependencies are finished (a skipped
        # dependency counts: dependants that do not run after skipped steps were skipped with it).
        ready = self.plan.take_ready(capacity, lambda sid: self.not_before.get(sid, 0) <= now
                                     and preemption.runs_now(self.plan, sid))
        alone = self.watched and len(ready) == 1 and not in_flight and not self.plan.has_ready()
        for index, step_id in enumerate(ready):
            timeout = self.options_of(step_id)[0]
            deps = self.plan.depends_on[step_id]
            ctx = StepContext(task_id=self.lease.task_id, step_id=step_id, params=self.params,
                              deps=self.results.get_many(deps),
                              skipped={d: self.skipped[d] for d in deps if d in self.skipped},
                              lease=self.lease, token=self.token.child(step_id), runner=self,
                              generation=self.plan.generations.get(step_id, 0))
            with self._start_gate:
                if self.starts_held:  # an operator request came in: this step and the rest stay pending
                    self.token.discard_child(ctx.token)
                    for held in ready[index:]:
                        self.plan.requeue(held)
                    return False
                flight = InFlight(step_id, ctx, timezone.now())
                self.flights[step_id] = ctx
                if timeout is not None:
                    self.deadlines[step_id] = (time.monotonic() + timeout, timeout)
            self.plan.running.add(step_id)
            if alone:
                self.settle(self.execute_here(ctx), flight)
                return True
            in_flight[pool.submit(self.execute, ctx)] = flight
        return False

    def execute_here(self, ctx: StepContext) -> Future:
        """Run a step on this thread; its outcome as a finished future, as the pool gives it."""
        future: Future = Future()
        try:
            future.set_result(self.execute(ctx, pooled=False))
        except BaseException as exc:  # delivered to settle(), as from the pool
            future.set_exception(exc)
        return future

    @telemetry.traced_step
    def execute(self, ctx: StepContext, pooled: bool = True):
        if pooled:  # a pool thread's connection may have gone stale between steps
            close_old_connections()
        try:
            with ctx.token.track("step", ctx.step_id):
                return self.task_type.run_step(ctx, ctx.step_id)
        finally:
            ctx.close()

    # --- outcomes of one step -------------------------------------------------------
    def settle(self, future: Future, flight: InFlight) -> None:
        ctx, step_id = flight.ctx, flight.step_id
        self.token.discard_child(ctx.token)
        self.flights.pop(step_id, None)
        self.deadlines.pop(step_id, None)
        self.plan.running.discard(step_id)
        extra = {"task_id": self.lease.task_id, "step_id": step_id, "lease_epoch": self.lease.epoch}
        if future.exception() is not None:
            # The step will not commit, but the tokens it spent are spent (a stream cut by a Stop,
            # a failed attempt): counted now, once, and written with the run's outcome.
            self._tokens_this_run, ctx.tokens_used = self.tokens_this_run() + ctx.tokens_used, 0
        try:
            result = future.result()
        except LeaseLost:
            self.lose_lease()
            return
        except Cancelled as exc:
            if exc.reason == UNIT_FAILED and step_id in self.unit_failures and not self.token.cancelled:
                self.step_failed(step_id, self.unit_failures.pop(step_id), flight)
                return
            if exc.reason == STEP_TIMEOUT and not self.token.cancelled:
                self.step_failed(step_id, self.timed_out(step_id), flight)
                return
            if self.was_cut(ctx):
                self.cut_settled(flight)
                return
            if ctx.completed_effects and not self.lease_lost:
                self.record_failure(flight, "cancelled", retrying=True)
            if exc.reason == PREEMPTED and not self.token.cancelled:
                # Interrupted for an urgent subtask: it runs again once the frame is popped.
                self.interrupted.append(step_id)
                self.plan.requeue(step_id)
            return
        except WaitForEvent as wait:
            # Not a failure: the step runs again when the event comes (or its deadline passes).
            self.parked[step_id] = {"step": step_id, "type": wait.event_type,
                                    "until": wait.until.isoformat() if wait.until else None,
                                    **({"match": wait.match} if wait.match else {})}
            if ctx.completed_effects:  # effects before the wait did happen: commit their `done`
                self.record_failure(flight, str(wait), retrying=True)
            return
        except LimitExceeded as exc:
            # Not the step's fault: it runs again after the limit is raised and the task resumed.
            self.limit_hit, self.limit_detail = exc.limit, exc.detail
            if ctx.completed_effects:
                self.record_failure(flight, str(exc), retrying=True)
            return
        except AmbiguousEffect as exc:
            log.warning("ambiguous effect: waiting for review", extra={**extra, "wal_entry_id": exc.entry.pk})
            self.ambiguous.append(exc)
            if ctx.completed_effects:  # earlier effects of this step did happen: commit their `done`
                self.record_failure(flight, str(exc), retrying=True)
            return
        except Exception as exc:
            if ctx.token.reason == STEP_TIMEOUT and not self.token.cancelled:
                # Its tool gave up because the timeout cancelled it: the timeout is the failure.
                self.step_failed(step_id, self.timed_out(step_id), flight)
                return
            if self.was_cut(ctx):
                self.cut_settled(flight)
                return
            if ctx.token.reason == PREEMPTED and not self.token.cancelled:
                # Its tool gave up because the token was cancelled: an interruption, not a failure.
                self.record_failure(flight, f"interrupted by a preempt: {type(exc).__name__}: {exc}", retrying=True)
                self.interrupted.append(step_id)
                return
            self.step_failed(step_id, exc, flight)
            return
        self._tokens_this_run = self.tokens_this_run() + ctx.tokens_used
        try:
            version = checkpoint.commit_step(
                lease=self.lease, plan=self.plan, step_id=step_id, result=result,
                reads=ctx.params.keys_read, effects=ctx.completed_effects, started_at=flight.started_at,
                tokens_used=ctx.tokens_used, active_seconds=self.take_active_seconds(), added=ctx.added_steps,
                consumed=ctx.consumed_events, ends_wait=step_id in self.waits)
        except LeaseLost:
            log.warning("lease lost: step result discarded", extra=extra)
            self.lose_lease()
            return
        except checkpoint.CheckpointDiverged as exc:
            self.diverge(str(exc), ctx.completed_effects)
            return
        except checkpoint.InvalidPlanGrowth as exc:
            # The step's code asked for an impossible plan: running it again asks the same.
            log.warning("step added steps that cannot join the plan", extra=extra)
            self.record_failure(flight, f"InvalidPlanGrowth: {exc}", retrying=False,
                                fingerprint=failure_fingerprint(exc))
            if not self.lease_lost:
                self.give_up(step_id, f"step {step_id} failed: {exc}")
            return
        self.note_specs(ctx.added_steps)
        self.results.put(step_id, result)
        self.not_before.pop(step_id, None)
        log.debug("step committed", extra={**extra, "checkpoint_version": version})

    def timed_out(self, step_id: str) -> StepTimedOut:
        return StepTimedOut(step_id, self.options_of(step_id)[0] or 0)

    def was_cut(self, ctx: StepContext) -> bool:
        """Cancelled by a Pause's grace or a limit (not by a Stop, which cancels the whole run)."""
        reason = ctx.token.reason or ""
        return not self.token.cancelled and (reason == PAUSE_CUT or reason.startswith(LIMIT_CUT))

    def cut_settled(self, flight: InFlight) -> None:
        """A step cut by a Pause or a limit: not a failure, no attempt counted; it runs again on
        resume (its completed effects are committed `done`, and replay from the WAL then).
        What it streamed was counted against max_tokens as it settled."""
        ctx = flight.ctx
        if ctx.completed_effects and not self.lease_lost:
            self.record_failure(flight, f"cancelled: {ctx.token.reason}", retrying=True)
        elif self.plan.status.get(flight.step_id) == StepStatus.PENDING:
            self.plan.requeue(flight.step_id)

    def give_up(self, step_id: str, why: str) -> None:
        """A step failed for good: apply its failure policy (FAILURE_POLICIES)."""
        policy = self.plan.on_failure.get(step_id) or self.task_type.on_step_failure
        if policy == "skip":
            try:
                with transaction.atomic():
                    task = leases.lock_fenced(self.lease)
                    skipped = checkpoint.skip_steps(task, self.plan, step_id, why, by="policy")
            except LeaseLost:
                self.lose_lease()
                return
            self.plan.version += 1
            for sid in skipped:
                self.plan.set_status(sid, StepStatus.SKIPPED)
                self.skipped[sid] = why if sid == step_id else f"skipped: depends on {step_id}, which was skipped"
            log.warning("step skipped by its failure policy; the task goes on",
                        extra={"task_id": self.lease.task_id, "step_id": step_id, "skipped": skipped})
        elif policy == "fail":
            self.failure = why
        else:
            self.needs_human = f"{why}. Fix the cause and resume, or skip the step."

    def step_failed(self, step_id: str, exc: Exception, flight: "InFlight | None") -> None:
        """A failed attempt (the step's own, or one an inbox event reported: `flight` is then
        None for a step that was not running): retry with backoff, then its failure policy."""
        extra = {"task_id": self.lease.task_id, "step_id": step_id, "lease_epoch": self.lease.epoch}
        attempts = self.plan.attempts.get(step_id, 0) + 1
        cause = exc.error if isinstance(exc, EffectFailed) else exc
        fingerprint = failure_fingerprint(cause)
        repeated = self.plan.fingerprints.get(step_id) == fingerprint
        # While a request winds the task down a failure is left for the next run to retry:
        # no policy applies to a step that was being interrupted.
        retrying = self.token.cancelled or (attempts < harness.step_max_attempts and not repeated)
        error = f"{type(exc).__name__}: {exc}\n{''.join(traceback.format_tb(exc.__traceback__)[-3:])}"
        log.warning("step failed (attempt %s)%s", attempts, ", retrying" if retrying else "", extra=extra)
        self.record_failure(flight, error, retrying=retrying, fingerprint=fingerprint, step_id=step_id)
        if retrying:
            delay = min(RETRY_BACKOFF_BASE_SECONDS * 2 ** (attempts - 1), RETRY_BACKOFF_MAX_SECONDS)
            self.not_before[step_id] = time.monotonic() + delay
        elif not self.lease_lost:
            self.give_up(step_id, f"step {step_id} failed " + (
                f"twice the same way ({type(cause).__name__}: {str(cause)[:200]}); retrying will not help"
                if repeated else f"after {attempts} attempts: {type(cause).__name__}: {str(cause)[:300]}"))

    def record_failure(self, flight: "InFlight | None", error: str, *, retrying: bool, fingerprint: str = "",
                       step_id: str = "") -> None:
        try:
            checkpoint.commit_step_failure(
                lease=self.lease, plan=self.plan, step_id=flight.step_id if flight else step_id, error=error,
                retrying=retrying, effects=flight.ctx.completed_effects if flight else [],
                started_at=flight.started_at if flight else timezone.now(),
                reads=flight.ctx.params.keys_read if flight else [], fingerprint=fingerprint)
        except LeaseLost:
            self.lose_lease()

    # --- P2: a step that failed outside the task --------------------------------------------
    def fail_unit(self, event) -> inbox.Applied:
        """A `unit.failed` event at a resume point: the named step's retry policy applies as
        if it had failed with the event's error (a running step is cancelled first)."""
        step_id = event.payload["step"]
        status = self.plan.status.get(step_id)
        if status is None:
            return inbox.Applied(f"rejected: the task has no step {step_id!r}", state=InboundState.REJECTED)
        if status in (StepStatus.DONE, StepStatus.SKIPPED):
            return inbox.Applied(f"rejected: step {step_id} is {status} already; nothing is compensated (roll back "
                                 f"to a version before it, or edit, to run it again)", state=InboundState.REJECTED)
        failure = UpstreamFailure(f"reported by event #{event.seq} ({event.source}): {event.payload['error']}")
        if step_id in self.flights:
            self.unit_failures[step_id] = failure
            self.flights[step_id].token.cancel(UNIT_FAILED)
            return inbox.Applied(f"step {step_id} was running: cancelled, and it counts as a failed attempt; its "
                                 f"retry policy applies")
        self.unit_failures_pending.append((step_id, failure))
        return inbox.Applied(f"step {step_id} counts as a failed attempt; its retry policy applies")

    def take_active_seconds(self) -> float:
        now = time.monotonic()
        delta, self.accounted = now - self.accounted, now
        return delta

    # --- the end of this run ----------------------------------------------------------
    def finish(self) -> str:
        extra = {"task_id": self.lease.task_id, "lease_epoch": self.lease.epoch}
        if self.lease_lost:
            log.warning("lease lost: this worker stops without writing", extra=extra)
            return "lease lost"
        active_seconds = self.take_active_seconds()

        def write_outcome():
            with transaction.atomic():
                task = leases.lock_fenced(self.lease)
                if self.diverged:
                    # Nothing of this run's memory is written: the next run loads the database's.
                    task.lease_owner = ""
                    task.save(update_fields=["lease_owner", "updated_at"])
                    scheduler.enqueue(task.pk)
                    return task, "restarted from the database"
                task.active_seconds += active_seconds
                task.tokens_used = self.base_tokens + self.tokens_this_run()
                outcome = self.decide(task)
                # The run's last versions become full snapshot rows (cheap to read at rest).
                checkpoint.compact_snapshots(task, self.plan)
                return task, outcome

        try:
            task, outcome = retry_while_down(write_outcome, seconds=harness.database_retry_seconds, logger=log,
                                             what="the run's outcome", extra=extra)
        except LeaseLost:
            log.warning("lease lost before the task's outcome was written", extra=extra)
            return "lease lost"
        log.info("run finished: %s", outcome, extra={**extra, "checkpoint_version": task.checkpoint_version})
        return outcome

    def review_unknown_effects(self, task: Task, cause: str) -> list:
        """The task ends now: every effect whose outcome is unknown goes in front of a reviewer,
        whose decision records what happened (nothing runs again). Those the tools reported
        ambiguous keep their evidence; the WAL's other pending rows (steps abandoned in flight
        by Force-terminate) are settled as recovery does."""
        reported = {}
        for ambiguous in self.ambiguous:
            reviews.effect_open(entry=ambiguous.entry, dead_worker=ambiguous.entry.worker, evidence=ambiguous.evidence,
                                reason=f"{ambiguous.reason} The task then ended ({cause}) and runs nothing again: "
                                       f"say whether it happened, for the record.")
            reported[ambiguous.entry.pk] = ambiguous.entry
        opened = recovery.settle_pending_wal(task, dead_worker=self.lease.owner, cause=cause, ended=True,
                                             extra={"task_id": task.pk, "lease_epoch": self.lease.epoch})
        return [*reported.values(), *(entry for entry in opened if entry.pk not in reported)]

    def note_effects_left_in_doubt(self, task: Task, cause: str) -> str:
        """For an ending with nothing ambiguous on record (completed, failed): the WAL's rows
        still pending go to their probe or a reviewer; the status reason says how many."""
        return recovery.in_doubt_note(self.review_unknown_effects(task, cause))

    def decide(self, task: Task) -> str:
        """Write the run's outcome; runs in the finishing transaction with the row locked."""
        released = {"lease_owner": "", "control": "", "activities": []}
        ended = ""
        if self.control == "terminate":
            ended, why = S.TERMINATED, "force-terminated by an operator"
        elif self.escalated:
            ended, why = S.TERMINATED, (f"stop escalated to force-terminate: steps ignored cancellation for "
                                        f"{harness.grace_seconds:g} s")
        elif self.control == "stop":
            ended, why = S.STOPPED, "stopped by an operator"
        if ended:
            # Checked before the ambiguous list, but never instead of it: an effect cut in
            # flight by the request is as unknown as one a dead worker left.
            why += recovery.in_doubt_note(self.review_unknown_effects(task, why))
            states.transition(task, ended, reason=why, **released)
            return ended
        if self.all_done():
            # Whatever ends a task reviews what it left in doubt: an idempotent effect a tool
            # step gave up replaying (or a skipped step's) would otherwise stay pending for good.
            why = "all steps done"
            states.transition(task, S.COMPLETED, reason=why + self.note_effects_left_in_doubt(task, why), **released)
            return S.COMPLETED
        if self.ambiguous:
            keys = ", ".join(a.entry.idempotency_key for a in self.ambiguous)
            for ambiguous in self.ambiguous:
                reviews.effect_open(entry=ambiguous.entry, dead_worker=ambiguous.entry.worker, reason=ambiguous.reason,
                                    evidence=ambiguous.evidence)
            states.transition(task, S.AWAITING_REVIEW, reason=f"side effect in doubt: {keys}", **released)
            return S.AWAITING_REVIEW
        if self.needs_human:
            states.transition(task, S.NEEDS_HUMAN, reason=self.needs_human[:500], error=self.needs_human, **released)
            return S.NEEDS_HUMAN
        if self.failure:
            reason = self.failure[:500] + self.note_effects_left_in_doubt(task, "failed")
            states.transition(task, S.FAILED, reason=reason, error=self.failure, **released)
            return S.FAILED
        if self.control == "pause":
            states.transition(task, S.PAUSED, reason="paused by an operator", **released)
            return S.PAUSED
        limit = self.limit_reached()
        if limit:
            detail = f" ({self.limit_detail})" if self.limit_detail and limit == self.limit_hit else ""
            states.transition(task, S.PAUSED, reason=f"limit: {limit}{detail}", paused_by_limit=limit, **released)
            return S.PAUSED
        if (self.parked and not self.plan.has_ready() and not self.waiting_for_retry()
                and not any(inbox.awaited_arrived(task.pk, w["type"], match=w.get("match"))
                            for w in self.parked.values())):
            # Nothing else to run and the awaited events have not come (checked with the row
            # locked: a sender that comes later sees `waiting` and wakes the task).
            waits = list(self.parked.values())
            deadlines = [datetime.fromisoformat(w["until"]) for w in waits if w["until"]]
            # An awaited event sent already but held back (a mergeable one's merge window):
            # the sweeper wakes the task when it becomes visible, as at a deadline.
            deadlines += [visible for visible in [inbox.awaited_visible_at(task.pk, waits)] if visible]
            what = ", ".join(f"{w['step']} waits for {w['type']}" for w in waits)
            states.transition(task, S.WAITING, reason=what[:500], waiting_for=waits,
                              waiting_until=min(deadlines) if deadlines else None, **released)
            return S.WAITING
        # Time slice used up, or nothing runnable right now: hand the task to the next
        # worker through the queue (it keeps status running; the lease is released).
        task.lease_owner = ""
        task.save(update_fields=["lease_owner", "active_seconds", "tokens_used", "updated_at"])
        scheduler.enqueue(task.pk)
        return "sliced"
