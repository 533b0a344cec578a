"""The runner: drives one task's steps in dependency order while holding its lease.

Independent steps run concurrently (up to the task's `max_subtasks`) in threads; only
this loop commits step checkpoints, so commits are serialised and fenced on the lease.
A supervisor thread heartbeats the lease and polls operator requests every ORCH_CONTROL_POLL_SECONDS (50 ms).

The loop ends when every step is done, a step fails for good, an effect is ambiguous
(review), an operator asked to pause/stop/terminate, a limit ran out (pause), the lease
was lost, or the time slice is used up (the task re-enqueues itself and any worker
continues it from its checkpoint).
"""
import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from django.db import transaction
from django.utils import timezone

from .. import telemetry
from ..conf import harness
from ..models import Step, StepStatus, Task
from ..outage import retry_while_down
from . import checkpoint, consumption, finishing, inbox, lease as leases, preemption, results, run_gate, step_limits, \
    step_threads
from .context import StepContext
from .events import append_event
from .lease import LEASE_LOST, Lease, LeaseLost
from .outcomes import settle
from .preemption import top_finished
from .run_state import PREEMPTED, InFlight, RunState
from .supervisor import Supervisor

log = logging.getLogger(__name__)


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
    """One run (slice) of a task. Its state is one RunState (engine/run_state.py); the pieces
    that act on it are functions of their own modules: settling a step (outcomes), the inbox
    (consumption), limits inside steps (step_limits), the ending (decision, finishing)."""

    def __init__(self, lease: Lease, *, watched: bool = False):
        self.lease = lease
        self.state = RunState(lease, watched=watched)

    # What tests and telemetry read of a run (the state holds it).
    @property
    def plan(self):
        return self.state.plan

    @property
    def not_before(self) -> dict[str, float]:
        return self.state.not_before

    # --- signals from the supervisor ------------------------------------------------
    def take_request(self, control: str) -> None:
        """An operator request the supervisor saw. No step starts from here on (so none starts
        after the acknowledgement); acknowledge before acting: once the steps wind down the run
        may end (and give up its lease) at any moment."""
        self.hold_starts()
        acknowledge(self.lease, control)
        self.request(control)

    def request(self, control: str) -> bool:
        """Take an operator request; True the first time it is seen."""
        state = self.state
        if control == state.control:
            return False
        state.control = control
        state.control_seen_at = time.monotonic()
        log.info("operator request: %s", control, extra={"task_id": self.lease.task_id, "worker": self.lease.owner})
        if control in ("stop", "terminate"):
            state.token.cancel(control)
        return True

    def hold_starts(self) -> None:
        with self.state.start_gate:
            self.state.starts_held = True

    def supervise_steps(self) -> None:
        step_limits.supervise_steps(self.state)

    def lose_lease(self) -> None:
        self.state.lose_lease()

    def request_preempt(self) -> None:
        """A preempt is pending: cancel the steps in flight (P0); the loop starts nothing new
        and applies it once they have wound down."""
        state = self.state
        if state.preempting:
            return
        state.preempting, state.preempt_seen_at = True, timezone.now()
        flights = list(state.flights.values())
        log.info("preempt: interrupting %d step(s) in flight", len(flights), extra={"task_id": self.lease.task_id})
        for ctx in flights:
            ctx.token.cancel(PREEMPTED)

    # --- the loop -----------------------------------------------------------------------
    @telemetry.traced_run
    def run(self) -> str:
        state = self.state
        # An executor started while the database is away waits for it rather than crash
        # (a crash would cost the task a recovery attempt).
        task = retry_while_down(lambda: Task.objects.get(pk=self.lease.task_id),
                                seconds=harness.database_retry_seconds, logger=log, what="the run's start",
                                extra={"task_id": self.lease.task_id})
        state.load(task)
        try:
            # Code changed since the task last ran (a deploy): the type's policy first (engine/run_gate.py).
            gate = retry_while_down(
                lambda: run_gate.at_run_start(lease=self.lease, task=task, task_type=state.task_type),
                seconds=harness.database_retry_seconds, logger=log, what="the compatibility gate",
                extra={"task_id": task.pk})
            if gate.held:
                return gate.held
            if gate.params is not None:
                state.params = state.task_type.Params.model_validate(gate.params)
            state.plan = retry_while_down(
                lambda: checkpoint.ensure_plan(lease=self.lease, task_type=state.task_type, params=state.params),
                seconds=harness.database_retry_seconds, logger=log, what="loading the plan",
                extra={"task_id": task.pk})
        except LeaseLost:
            log.info("lease lost before the run started", extra={"task_id": task.pk, "lease_epoch": self.lease.epoch})
            return LEASE_LOST
        # Results are loaded when a dependant needs them (a long plan's results are not all
        # held in memory); those of the latest steps stay cached for their dependants.
        state.results = results.ResultCache(task.pk)
        supervisor = self.start_supervisor(task)
        size = max(1, int(state.limits["max_subtasks"]))
        pool = step_threads.take(size)  # kept between runs: its threads' connections stay open
        try:
            self.loop(pool)
        finally:
            supervisor.stop()
            step_threads.give_back(pool, size, abandon=state.control == "terminate" or state.escalated)
        return finishing.finish(state)

    def start_supervisor(self, task: Task) -> Supervisor:
        """The lease is held from here on: heartbeat it (and relay requests) while the rest loads."""
        state = self.state

        def load_the_rest():
            # The errors of the skipped steps (their dependants may read them): the plan's rows say
            # whether there are any, so a run with none (nearly every run) asks nothing.
            if StepStatus.SKIPPED in state.plan.status.values():
                state.skipped = dict(Step.objects.filter(task_id=task.pk, status=StepStatus.SKIPPED)
                                     .values_list("step_id", "error"))
            if task.recovering_since is not None:
                # Its state loaded and its lease held: the recovery got the task going again.
                self.lease.fenced().update(recovering_since=None)

        supervisor = Supervisor(self)
        supervisor.start()
        try:
            # Like the plan: the database going away now is waited out, not a crash.
            retry_while_down(load_the_rest, seconds=harness.database_retry_seconds, logger=log,
                             what="loading the run's state", extra={"task_id": task.pk})
        except BaseException:
            supervisor.stop()
            raise
        return supervisor

    def loop(self, pool: ThreadPoolExecutor) -> None:
        """Start ready steps, settle finished ones, consume the inbox at resume points, until
        the run halts (or nothing can run now) and no step is in flight."""
        state = self.state
        in_flight: dict[Future, InFlight] = {}
        while True:
            if top_finished(state.plan) and not state.lease_lost and not state.diverged:
                consumption.pop_frame(state)
            halt = state.halt_reason()
            # A preempt waits for the steps in flight to wind down: that is its resume point.
            held = state.preempting and bool(in_flight)
            if not halt and not held and consumption.due(state):
                consumption.consume(state)  # a resume point: before the next steps start
                halt = state.halt_reason()
            if not halt and not held and self.submit_ready(pool, in_flight):
                continue  # a step ran on this thread: look again at once
            if not in_flight:
                if state.starts_held and not halt:
                    time.sleep(0.02)  # a request is being acknowledged: the supervisor hands it over next
                    continue
                if halt or state.all_done() or not state.waiting_for_retry():
                    return
                time.sleep(0.05)
                continue
            if state.grace_expired():
                # The steps ignored the cancellation for the whole grace period: stop
                # waiting for them (in an isolated executor, the worker kills the tree).
                state.escalated = True
                return
            finished, _ = wait(in_flight, timeout=0.1, return_when=FIRST_COMPLETED)
            for future in finished:
                settle(state, future, in_flight.pop(future))

    def submit_ready(self, pool: ThreadPoolExecutor, in_flight: dict) -> bool:
        """Start the steps that are ready; True when one ran (and settled) on this thread."""
        state, plan = self.state, self.state.plan
        # max_steps bounds what starts: the steps done and those in flight never exceed it.
        capacity = min(max(1, int(state.limits["max_subtasks"])) - len(in_flight),
                       int(state.limits["max_steps"]) - plan.done_count() - len(in_flight))
        if capacity <= 0 or state.starts_held:
            return False
        now = time.monotonic()
        # The ready queue holds pending steps whose dependencies are finished (a skipped
        # dependency counts: dependants that do not run after skipped steps were skipped with it).
        ready = plan.take_ready(capacity, lambda sid: state.not_before.get(sid, 0) <= now
                                and preemption.runs_now(plan, sid))
        alone = state.watched and len(ready) == 1 and not in_flight and not plan.has_ready()
        for index, step_id in enumerate(ready):
            timeout = step_limits.options_of(state, step_id)[0]
            deps = plan.depends_on[step_id]
            # The step's context asks its run (the state) for limits, waits and subtask slots.
            ctx = StepContext(task_id=self.lease.task_id, step_id=step_id, params=state.params,
                              deps=state.results.get_many(deps),
                              skipped={d: state.skipped[d] for d in deps if d in state.skipped},
                              lease=self.lease, token=state.token.child(step_id), runner=state,
                              generation=plan.generations.get(step_id, 0),
                              defer_effects=step_id not in state.effects_in_place)
            with state.start_gate:
                if state.starts_held:  # an operator request came in: this step and the rest stay pending
                    state.token.discard_child(ctx.token)
                    for held in ready[index:]:
                        plan.requeue(held)
                    return False
                flight = InFlight(step_id, ctx, timezone.now())
                state.flights[step_id] = ctx
                if timeout is not None:
                    state.deadlines[step_id] = (time.monotonic() + timeout, timeout)
            plan.running.add(step_id)
            if alone:
                settle(state, self.execute_here(ctx), flight)
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
            step_threads.before_step(self.state)
        try:
            with ctx.token.track("step", ctx.step_id):
                return self.state.task_type.run_step(ctx, ctx.step_id)
        finally:
            ctx.close()
