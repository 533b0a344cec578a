"""Isolated execution: a task's steps run in a child process (its own session) that the
worker can kill outright. That is what makes Force-terminate immediate even when a step
ignores its token or blocks in a C call, and what guarantees no descendant survives.

The worker process (a django-q2 worker) is the *watchdog*: it forks the executor (or hands
the next run to the one it has: executor_process.py), becomes a child subreaper (orphaned
grandchildren are re-parented to it, so none escapes), polls the task's control column, kills the whole tree on Force-terminate (or when a Stop
outlives its grace period), and notices at once when the executor dies (kill -9, OOM):
the task is handed to recovery without waiting for its heartbeat to go stale. When the worker
itself dies, the executor dies with it, and a session keeper kills what the executor had
started (processes.SessionKeeper).
"""
import logging
import os
import signal
import time

from django.db import transaction
from django.utils import timezone

from .. import tasktypes, telemetry
from ..conf import harness
from ..outage import DATABASE_DOWN, OutageWatch
from ..models import Task, TaskStatus as S
from ..tools import mcp
from . import processes, states
from .lease import LEASE_LOST, Lease, LeaseLost, lock_fenced
from .executor_process import ExecutorProcess, after_run, ready_executor
from .recovery import in_doubt_note, recover_task, settle_pending_wal

log = logging.getLogger(__name__)


def run_isolated(lease: Lease) -> str:
    processes.become_subreaper()
    # Import the task types (and what they import: the agent's openai client alone is ~0.45 s)
    # here, once per worker process, so that every executor forked from it has them: each
    # executor importing them itself made a new slice (a recovered task's first, too) wait
    # 0.4 s on a quiet machine and over 1 s on a busy one before its first step (bench/hosts.py).
    tasktypes.all_types()
    mcp.preload()  # the MCP SDK too, when servers are declared (a second or more to import)
    executor = ready_executor()  # this worker's idle executor, or a new one (executor_process.py)
    # If this worker dies (kill -9, OOM), the executor dies with it (die_with_parent) and
    # the keeper kills what the executor started, wherever it was re-parented (processes.py).
    keeper = processes.guard_session(executor.pid)
    try:
        if not executor.start(lease):  # it died while it waited for this run
            executor = ready_executor()
            keeper = processes.guard_session(executor.pid)
            executor.start(lease)
        return Watchdog(lease, executor).watch()
    finally:
        keeper.release()
        after_run(executor)


class Watchdog:
    def __init__(self, lease: Lease, executor: ExecutorProcess):
        self.lease, self.executor, self.pid = lease, executor, executor.pid
        self.extra = {"task_id": lease.task_id, "lease_epoch": lease.epoch, "worker": f"{lease.host}:{self.pid}"}
        self.database = OutageWatch(log, f"watchdog of task {lease.task_id}")
        # Until the executor heartbeats itself (its supervisor starts once the plan is loaded),
        # this process does: on a loaded machine a new executor took up to 6 s to get there
        # (bench/hosts.py, 2 cores, load 10), its claim went stale (ORCH_STALE_AFTER_SECONDS
        # = 2) and was recovered, again and again — the executor is alive, only slow to start.
        self.beaten_at, self.next_beat = None, 0.0

    def watch(self) -> str:
        # A worker being shut down (Ctrl-C, a deploy's SIGTERM) must not leave its executor
        # and subprocesses behind: it kills them and hands the task back at once.
        self.shutting_down = False
        previous = {}
        for signum in (signal.SIGTERM, signal.SIGINT):
            try:
                previous[signum] = signal.signal(signum, self.on_shutdown)
            except ValueError:  # not the main thread: leave the handlers alone
                pass
        try:
            return self.watch_loop()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def on_shutdown(self, signum, frame) -> None:
        self.shutting_down = True

    def watch_loop(self) -> str:
        # The first poll one interval in: the claim has just written the heartbeat (a request made
        # before it ended the task at once, no worker holding it), and a short run ends before
        # then — one query and one heartbeat fewer per run; a request made since is seen at most
        # one interval later, as at any poll.
        next_poll = time.monotonic() + harness.executor_control_poll_seconds
        while True:
            if self.shutting_down:
                return self.hand_back()
            if self.executor.report() is not None:
                return self.after_run()
            exited, status = self.executor.poll_exit()
            if exited:
                return self.after_exit(status)
            if time.monotonic() >= next_poll:
                next_poll = time.monotonic() + harness.executor_control_poll_seconds
                verdict = self.check_control()
                if verdict:
                    return verdict
            # Wakes as soon as the executor reports or exits (not at its next poll: the worker
            # slot is free for the next task at once).
            self.executor.wait(harness.executor_watch_seconds)

    def check_control(self) -> str:
        try:
            # Polled every ORCH_EXECUTOR_CONTROL_POLL_SECONDS (0.1), inside the drive span: no SQL spans.
            with telemetry.quiet():
                row = (Task.objects.filter(pk=self.lease.task_id)
                       .values("control", "control_requested_at", "lease_epoch", "status", "heartbeat_at").first())
                self.beat_while_starting(row)
        except DATABASE_DOWN as exc:
            # The executor goes on (its commits wait for the database); keep watching it.
            self.database.failed(exc, **self.extra)
            return ""
        self.database.succeeded(**self.extra)
        if row is None or row["lease_epoch"] != self.lease.epoch:
            # Another worker owns the task: our executor must not run on.
            self.kill_all()
            return LEASE_LOST
        if row["control"] == "terminate":
            return self.terminate("force-terminated by an operator", "terminate")
        requested = row["control_requested_at"]
        if row["control"] == "stop" and requested and \
                (timezone.now() - requested).total_seconds() > harness.grace_seconds + 0.5:
            return self.terminate(f"stop escalated to force-terminate: steps ignored cancellation for "
                                  f"{harness.grace_seconds:g} s", "stop")
        return ""

    def beat_while_starting(self, row) -> None:
        """Heartbeat the lease until the executor's own first heartbeat (one not written here)."""
        if self.next_beat is None or row is None or row["lease_epoch"] != self.lease.epoch:
            return
        if self.beaten_at is not None and row["heartbeat_at"] != self.beaten_at:
            self.next_beat = None  # the executor's own heartbeat: it is going
            return
        if time.monotonic() >= self.next_beat:
            self.beaten_at = timezone.now()
            # Compare-and-set on the value read: a heartbeat the executor wrote meanwhile stays.
            if self.lease.fenced().filter(heartbeat_at=row["heartbeat_at"]).update(heartbeat_at=self.beaten_at) != 1:
                self.next_beat = None  # the executor beat meanwhile (or the lease went: seen next poll)
                return
            self.next_beat = time.monotonic() + harness.heartbeat_seconds

    def kill_all(self) -> list[int]:
        # Everything below this worker process belongs to the executor: the executor,
        # its subprocesses, and orphans re-parented to us (we are their subreaper).
        killed = processes.kill_tree(os.getpid(), include_root=False)
        self.executor.killed()
        log.info("killed the executor tree (%d processes)", len(killed), extra=self.extra)
        return killed

    def terminate(self, reason: str, control: str) -> str:
        self.kill_all()
        try:
            with transaction.atomic():
                task = lock_fenced(self.lease)
                if task.status not in states.TERMINAL:
                    # The executor was killed mid-step: an effect it had in flight may or may
                    # not have happened, and a terminated task replays nothing. A reviewer says.
                    reason += in_doubt_note(settle_pending_wal(task, dead_worker=self.lease.owner, cause=reason,
                                                               extra=self.extra, ended=True))
                    states.transition(task, S.TERMINATED, reason=reason, action=f"task.{control}",
                                      lease_owner="", control="", activities=[])
        except LeaseLost:
            # The run's own supervisor saw the request too and committed its end between this
            # poll's read and this lock (releasing the lease, which is why the fence failed): the
            # task ended by this lease's run, not lost to another worker; say how it ended.
            return self.ended_by_its_own_run() or LEASE_LOST
        log.info("task terminated", extra=self.extra)
        return S.TERMINATED

    def ended_by_its_own_run(self) -> str:
        """The task's end status if this lease's run wrote it (the lease released at the same
        epoch: a claim by anyone else, or an operator's direct settle, moves the epoch)."""
        status = (Task.objects.filter(pk=self.lease.task_id, lease_epoch=self.lease.epoch, lease_owner="")
                  .values_list("status", flat=True).first())
        return status if status in states.TERMINAL else ""

    def hand_back(self) -> str:
        self.kill_all()
        with telemetry.capture_context(self.lease.task_id) as outcome:  # what recovery decided, for this line
            if not self.recover(recover_task, cause="its worker was shut down", count_attempt=False):
                return "handed back to the sweeper"
        log.info("worker shutting down: task handed back", extra={**outcome, **self.extra})
        return "handed back"

    def recover(self, recover_task, **kwargs) -> bool:
        """Hand the task to recovery now; with the database down, leave it to the sweeper
        (its heartbeat goes stale, and the sweeper recovers it once the database is back)."""
        try:
            recover_task(self.lease.task_id, dead_lease=self.lease, **kwargs)
        except DATABASE_DOWN as exc:
            log.warning("could not hand the task to recovery: database unreachable (%s); the sweeper will recover "
                        "it when the database is back", type(exc).__name__,
                        extra={**self.extra, "resume_strategy": "left_to_sweeper"})
            return False
        return True

    def after_run(self) -> str:
        """The run is over and the executor alive: kill what the run left running (its subprocesses,
        and theirs re-parented to this worker), the executor spared for the next run. A run that
        ended itself on a Force-terminate (its own supervisor saw the request before this poll did)
        has its whole tree killed here, the executor with it."""
        if self.executor.force_ended:
            self.kill_all()
            return S.TERMINATED
        leftovers = processes.kill_tree(os.getpid(), include_root=False, sparing={self.pid})
        if leftovers:
            log.warning("killed %d processes the run left behind", len(leftovers), extra=self.extra)
        if self.executor.retiring:
            self.executor.wait_for_retirement()
        return "executor finished"

    def after_exit(self, status: int) -> str:
        leftovers = processes.kill_tree(os.getpid(), include_root=False)
        if leftovers:
            log.warning("killed %d processes the executor left behind", len(leftovers), extra=self.extra)
        if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
            return "executor finished"
        # The executor died (SIGKILL, OOM, a crash): a worker crash. Hand the task to
        # recovery now rather than waiting for its heartbeat to go stale.
        how = f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit {os.WEXITSTATUS(status)}"
        log.warning("executor died (%s)", how, extra=self.extra)
        with telemetry.capture_context(self.lease.task_id) as outcome:  # what recovery decided, for this line
            if not self.recover(recover_task, cause=f"executor pid {self.pid} died ({how})"):
                return "executor died"
        log.info("executor died: task handed to recovery", extra={**outcome, **self.extra})
        return "executor died"
