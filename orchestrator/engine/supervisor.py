"""The supervisor of a run: a loop beside the runner's that heartbeats the lease, relays
operator requests and inbox signals to the runner, and (on a thread of its own, the step
clock) enforces the limits inside running steps. The loop runs on a thread kept between the
runs of this process, its database connection with it (engine/step_threads.py)."""
import logging
import threading
import time

from concurrent.futures import TimeoutError as FutureTimeout

from django.db import DatabaseError, close_old_connections, transaction

from ..conf import harness
from ..outage import DATABASE_DOWN, OutageWatch
from . import inbox, lease as leases, step_threads
from .events import append_event
from .lease import LeaseLost

log = logging.getLogger("orchestrator.engine.runner")  # a run's lines keep the runner's logger


# How long stop() waits for the loop to end (it wakes at once unless a query is under way): a
# loop still running after it is left behind, and an executor then retires (executor_process.py).
STOP_WAIT_SECONDS = 5.0


class Supervisor:
    """Heartbeats the lease, relays operator requests to the runner (polled every
    ORCH_CONTROL_POLL_SECONDS, so a Stop reaches a step without waiting for it to end), acknowledges them,
    and while a request winds down publishes what is still running."""

    def __init__(self, runner):
        # `runner` is the Runner it signals (engine/runner.py imports this module, not the reverse).
        self.runner = runner
        self._stopped = threading.Event()
        self._loop = None
        self.published_activities = -1
        self.beat_activities = -1

    def start(self) -> None:
        threading.Thread(target=self.step_clock, name=f"step-clock-task-{self.runner.lease.task_id}",
                         daemon=True).start()
        self._loop = step_threads.run_kept(self.run)

    def run(self) -> None:
        lease = self.runner.lease
        database = OutageWatch(log, f"supervisor of task {lease.task_id}")
        next_beat = time.monotonic() + harness.heartbeat_seconds
        # The kept thread's connection may have gone stale since its last run (checked once here,
        # CONN_HEALTH_CHECKS; a poll that fails later is an outage, handled below).
        close_old_connections()
        while not self._stopped.wait(harness.control_poll_seconds):
            try:
                row = leases.poll(lease.task_id)
                if row is None or row["lease_epoch"] != lease.epoch or row["lease_owner"] != lease.owner:
                    self.runner.lose_lease()
                    return
                if row["control"] and row["control"] != self.runner.state.control:
                    self.runner.take_request(row["control"])
                if row["inbox_seq"] != self.runner.state.inbox_signal:
                    self.runner.state.inbox_signal = row["inbox_seq"]  # the runner consumes at its next resume point
                    if inbox.preempt_pending(lease.task_id):
                        self.runner.request_preempt()
                if self.runner.state.control:
                    self.publish_activities()
                if time.monotonic() >= next_beat:
                    if not leases.heartbeat(lease, self.activities_changed()):
                        self.runner.lose_lease()
                        return
                    next_beat = time.monotonic() + harness.heartbeat_seconds
                if (row["recovered_waiting"] and not self.runner.state.yield_slot
                        and leases.should_yield_to_recovered(lease.task_id)):
                    self.runner.state.yield_slot = True  # ends the slice at the next step boundary
            except LeaseLost:
                self.runner.lose_lease()
                return
            except DATABASE_DOWN as exc:  # an outage must not kill the heartbeat: keep trying
                database.failed(exc, task_id=lease.task_id)
            except DatabaseError:
                log.warning("supervisor: database error", exc_info=True, extra={"task_id": lease.task_id})
            else:
                database.succeeded(task_id=lease.task_id)

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
        version = self.runner.state.token.activities_version
        if version == self.beat_activities:
            return None
        self.beat_activities = version
        return self.runner.state.token.activities()

    def publish_activities(self) -> None:
        """While a request winds down: what still runs, durable and in the event log (so
        the task page, which follows events, shows it live)."""
        version = self.runner.state.token.activities_version
        if version == self.published_activities:
            return
        activities = self.runner.state.token.activities()
        with transaction.atomic():
            task = leases.lock_fenced(self.runner.lease)
            task.activities = activities
            task.save(update_fields=["activities"])
            append_event(task, "winding_down", {"still_running": [f"{a['kind']}: {a['label']}" for a in activities]})
        self.published_activities = version

    def stop(self) -> None:
        """End the loop and wait for it (briefly): its thread is then idle for the next run."""
        self._stopped.set()
        if self._loop is not None:
            try:
                self._loop.result(timeout=STOP_WAIT_SECONDS)
            except FutureTimeout:
                log.warning("supervisor: its loop did not end within %.0f s", STOP_WAIT_SECONDS,
                            extra={"task_id": self.runner.lease.task_id})
            except Exception:  # noqa: BLE001 - a thread's uncaught error, as a Thread of its own printed it
                log.exception("supervisor: its loop failed", extra={"task_id": self.runner.lease.task_id})
