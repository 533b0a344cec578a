"""Checkpoints: each finished step commits its result, its state, a snapshot version, the
steps it added to the plan and a progress event in one transaction, fenced on the lease.
Nothing half-commits.

The cost of a commit does not depend on the size of the plan: the snapshot row holds only
what changed (engine/snapshots.py), the runner finds the next steps in a ready queue, and
on PostgreSQL the common commit (a step with no added steps and an inline result) is one
statement, sent and committed in one round trip. A step that performed no side effect is
committed without waiting for the disk flush (ORCH_PURE_STEP_SYNC_COMMIT): if the database
server itself crashes, it is recomputed; PostgreSQL flushes its log in order, so any later
synchronous commit (a WAL intent, a status change) makes it durable too.
"""
import logging
import os

from datetime import datetime
from typing import Any

from django.db import DatabaseError, connection, transaction
from django.utils import timezone

from .. import telemetry
from ..conf import harness
from ..outage import retry_while_down
from ..models import InboundEvent, InboundState, Step, StepResult, StepStatus, Task, TaskStatus
from . import at_commit as effects_at_commit, commit_statement, compat, events, inbox_counter, snapshots, states, \
    rows_at_commit, step_rows, wal
from .commit_statement import StepCommit
from .events import create_event, cross_process_layer, publish_hint
from ..primitives.faults import armed as armed_faults, fault_point
from ..primitives import storable
from .inbox import INBOX_ADDER
from .lease import Lease, LeaseLost, lock_fenced
from ..primitives.errors import HarnessError
# The plan in memory has a module of its own; its names stay importable from here.
from .plan_state import InvalidPlanGrowth, PlanState, plan_from  # noqa: F401
from .step_rows import plan_rows, step_row

log = logging.getLogger(__name__)


class CheckpointDiverged(HarnessError):
    """The database is not at the checkpoint version this run built on, though the run still
    holds the lease: the server lost commits it had acknowledged (it crashed with pure-step
    commits not yet flushed, see the module docstring). The run must start again from what
    the database holds; its in-memory plan is ahead of it."""


def save_snapshot(task: Task, state: dict, step_id: str = "") -> None:
    """A full snapshot of the task's current version (plans written or rewritten, skips)."""
    snapshots.write_full(task, state, step_id)


@telemetry.traced_checkpoint
def commit_step(*, lease: Lease, plan: PlanState, step_id: str, result: Any, reads: list[str],
                effects: list[wal.CompletedEffect], started_at: datetime, tokens_used: int = 0,
                active_seconds: float = 0.0, added: list | None = None, consumed: dict | None = None,
                ends_wait: bool = False, at_commit: list | None = None, rows: list | None = None) -> int:
    """Commit a finished step; returns the new checkpoint version. Raises LeaseLost, and
    FailedAtCommit when the database refused an effect written with it (`at_commit`).

    `plan` changes only once the commit is durable (a rolled-back commit leaves it as it was)."""
    faults = armed_faults()  # read once for the commit's fault points (crash tests)
    fault_point("before_checkpoint", step_id, faults=faults)
    commit = StepCommit(step_id, result, reads, effects, started_at, tokens_used, active_seconds, list(added or ()),
                        dict(consumed or {}), ends_wait, list(at_commit or ()), list(rows or ()))
    if commit.added:
        plan.validate_growth(step_id, commit.added)
    # The step's work (and its effects) happened: keep it until the database is back rather
    # than die and make a recovery redo it. The commit is fenced: if a worker took the task
    # over meanwhile, it fails with LeaseLost.
    try:
        version = retry_while_down(lambda: _commit_step(lease, plan, commit, faults),
                                   seconds=harness.database_retry_seconds, logger=log, what="checkpoint",
                                   extra={"task_id": lease.task_id, "step_id": step_id})
    except DatabaseError as exc:
        if not commit.at_commit:
            raise
        raise effects_at_commit.refused(exc, commit.at_commit) from exc
    plan.version = version
    plan.attempts[step_id] = plan.attempts.get(step_id, 0) + 1
    join_plan(plan, additions(plan, commit.added, step_id))
    plan.set_status(step_id, StepStatus.DONE)
    fault_point("after_checkpoint", step_id, faults=faults)
    return version


def _commit_step(lease: Lease, plan: PlanState, commit: StepCommit, faults: dict[str, str] | None = None) -> int:
    faults = armed_faults() if faults is None else faults  # commit_step passes what it read already
    now = timezone.now()
    encoded, commit.result = storable.encoded(commit.result)  # no NUL: PostgreSQL stores none
    apart = len(encoded) > harness.result_inline_bytes
    version = plan.version + 1
    # One statement (and one round trip) unless this commit has more to write: a full snapshot,
    # added steps that go before existing ones, a result stored apart, or an armed crash-test fault point.
    simple = (connection.vendor == "postgresql" and not any(spec.before for spec in commit.added) and not apart
              and not commit.consumed and not commit.ends_wait and not snapshots.full_due(version)
              and not faults)
    if simple:
        row = commit_statement.postgresql(lease, plan, commit, encoded, now, delta=True)
        if row is None:
            try:  # a lost lease, or a commit that landed before a lost reply, say so first
                return _unfenced(lease, plan, commit)
            except CheckpointDiverged:
                if commit.at_commit and effects_at_commit.recorded_earlier(commit.at_commit):
                    raise effects_at_commit.RecordedEarlier(f"step {commit.step_id}: an effect's key was recorded "
                                                            f"earlier") from None
                raise
        _after_commit(lease.task_id, row, plan.done_count() + 1)
        return row["checkpoint_version"]
    with transaction.atomic():
        effects_at_commit.perform_in_transaction(lease, commit.at_commit)  # written here, not by the statement
        if connection.vendor == "postgresql":
            row = commit_statement.postgresql(lease, plan, commit, None if apart else encoded, now,
                                               delta=not snapshots.full_due(version) and not commit.added,
                                               at_commit_sql=False)
        else:
            row = commit_statement.sqlite(lease, plan, commit, None if apart else encoded, now)
        if row is None:
            return _unfenced(lease, plan, commit)
        rows_at_commit.write_in_transaction(commit.rows)
        if apart:
            StepResult.objects.update_or_create(task_id=lease.task_id, step_id=commit.step_id,
                                                defaults={"data": commit.result})
            Step.objects.filter(task_id=lease.task_id, step_id=commit.step_id).update(
                result_stored_apart=True, result_bytes=len(encoded))
        if commit.added:
            insert_added_steps(lease.task_id, plan, additions(plan, commit.added, commit.step_id))
        if commit.consumed or commit.ends_wait:
            _settle_wait(lease.task_id, commit, row["checkpoint_version"])
        if commit.added or snapshots.full_due(row["checkpoint_version"]) or connection.vendor != "postgresql":
            _write_snapshot(lease.task_id, plan, commit, row)
        fault_point("mid_checkpoint", commit.step_id, faults=faults)  # crash tests: the whole checkpoint must vanish
        task_id, done = lease.task_id, plan.done_count() + 1
        transaction.on_commit(lambda: _after_commit(task_id, row, done))
    return row["checkpoint_version"]


def _unfenced(lease: Lease, plan: PlanState, commit: StepCommit) -> int:
    """The commit's fence did not hold: say why. Retried after a lost connection, the first
    try may have committed with only its reply lost; then the step is done at exactly the
    next version and that version is the answer (committing again would run the step's
    commit twice: a second step_done, a version skipped)."""
    task = Task.objects.filter(pk=lease.task_id).values("lease_epoch", "lease_owner", "checkpoint_version").first()
    if task is None or task["lease_epoch"] != lease.epoch or task["lease_owner"] != lease.owner:
        raise LeaseLost(f"task {lease.task_id}: lease epoch {lease.epoch} is stale")
    step = Step.objects.filter(task_id=lease.task_id, step_id=commit.step_id).values("status", "attempts").first()
    landed = (task["checkpoint_version"] == plan.version + 1 and step is not None
              and step["status"] == StepStatus.DONE and step["attempts"] == plan.attempts.get(commit.step_id, 0) + 1)
    if landed:
        log.info("checkpoint had landed before the connection was lost",
                 extra={"task_id": lease.task_id, "step_id": commit.step_id,
                        "checkpoint_version": task["checkpoint_version"]})
        return task["checkpoint_version"]
    raise CheckpointDiverged(f"task {lease.task_id}: the database is at checkpoint v{task['checkpoint_version']}, "
                             f"this run built on v{plan.version}")


def _after_commit(task_id: int, row: dict, steps_done: int) -> None:
    if cross_process_layer() is not None:
        publish_hint(task_id, row["event_seq"], row["status"], steps_done, row["steps_total"])


class EventTakenAlready(Exception):
    """A step's wait took an event another step consumed first."""


def _settle_wait(task_id: int, commit: StepCommit, version: int) -> None:
    """The events the step's wait took are consumed, and its wait is over (in the commit)."""
    now = timezone.now()
    for event_id, outcome in commit.consumed.items():
        # Compare-and-set: an event is consumed once. If another step took it first, this
        # step's result rests on a decision that was not its own: the commit is refused.
        if not InboundEvent.objects.filter(pk=event_id, state=InboundState.PENDING).update(
                state=InboundState.CONSUMED, outcome=outcome, consumed_at=now, consumed_in_version=version):
            raise EventTakenAlready(f"inbox event {event_id} was consumed already; step {commit.step_id} runs again")
    task = Task.objects.get(pk=task_id)  # locked by the commit's fenced UPDATE
    task.waiting_for = [w for w in task.waiting_for if w.get("step") != commit.step_id]
    deadlines = [w["until"] for w in task.waiting_for if w.get("until")]
    task.waiting_until = min(deadlines) if deadlines else None
    task.save(update_fields=["waiting_for", "waiting_until", *inbox_counter.consumed(task, len(commit.consumed))])


def additions(plan: PlanState, specs, adder: str) -> list[tuple]:
    """Steps joining the plan, as (spec, added_by, generation). A step added by a step
    inherits its adder's generation: when the adder runs again after an edit or a rollback,
    what it adds performs its effects under new idempotency keys."""
    generation = plan.generations.get(adder, 0)
    return [(spec, adder, generation) for spec in specs]


def insert_added_steps(task_id: int, plan: PlanState, added: list[tuple]) -> None:
    """Their Step rows, in the committing transaction (positions after the plan's last)."""
    first, task = plan.next_position(), Task(pk=task_id)
    Step.objects.bulk_create([step_row(task, spec, first + i, added_by=adder, generation=generation)
                              for i, (spec, adder, generation) in enumerate(added)])
    extra_dependencies: dict[str, list[str]] = {}
    for spec, _, _ in added:
        for target in spec.before:
            extra_dependencies.setdefault(target, []).append(spec.id)
    for target, dependencies in extra_dependencies.items():
        Step.objects.filter(task_id=task_id, step_id=target).update(
            depends_on=[*plan.depends_on[target], *dependencies])


def join_plan(plan: PlanState, added: list[tuple]) -> None:
    """Once the rows are committed: the steps join the runner's plan state."""
    for spec, adder, generation in added:
        plan.add(spec.id, spec.depends_on, position=plan.next_position(), on_failure=spec.on_failure,
                 runs_after_skipped=spec.runs_after_skipped, added_by=adder, generation=generation)
        for target in spec.before:
            plan.add_dependency(target, spec.id)


def _write_snapshot(task_id: int, plan: PlanState, commit: StepCommit, row: dict) -> None:
    """The snapshot row of a commit that was not written by the one-statement path."""
    version = row["checkpoint_version"]
    if snapshots.full_due(version):
        task = Task.objects.get(pk=task_id)
        state = plan.snapshot_state(task)
        state["steps"][commit.step_id] = StepStatus.DONE
        state["counters"]["steps_done"] = plan.done_count() + 1
        for spec in commit.added:
            state["steps"][spec.id] = StepStatus.PENDING
            state.setdefault("added_by", {})[spec.id] = commit.step_id
        snapshots.write_full(task, state, commit.step_id)
        return
    delta = {"steps": {commit.step_id: StepStatus.DONE, **{spec.id: StepStatus.PENDING for spec in commit.added}},
             "status": row["status"],
             "counters": {"steps_done": plan.done_count() + 1, "tokens_used": row["tokens_used"],
                          "active_seconds": round(row["active_seconds"], 3)}}
    if commit.added:
        delta["added_by"] = {spec.id: commit.step_id for spec in commit.added}
    snapshots.write_delta(task_id, version, delta, commit.step_id)


def commit_step_failure(*, lease: Lease, plan: PlanState, step_id: str, error: str, retrying: bool,
                        effects: list[wal.CompletedEffect], started_at: datetime, reads: list[str],
                        fingerprint: str = "") -> None:
    """Record a failed attempt (and the effects that did happen before the failure)."""
    retry_while_down(lambda: _commit_step_failure(lease=lease, plan=plan, step_id=step_id, error=error,
                                                  retrying=retrying, effects=effects, started_at=started_at,
                                                  reads=reads, fingerprint=fingerprint),
                     seconds=harness.database_retry_seconds, logger=log, what="step failure record",
                     extra={"task_id": lease.task_id, "step_id": step_id})


def _commit_step_failure(*, lease, plan, step_id, error, retrying, effects, started_at, reads, fingerprint) -> None:
    now = timezone.now()
    attempts = plan.attempts.get(step_id, 0) + 1
    with transaction.atomic():
        task = lock_fenced(lease)
        task.heartbeat_at = now
        seq = events.reserve_locked(task, saving=["heartbeat_at"])
        wal.mark_done(effects)
        status = StepStatus.PENDING if retrying else StepStatus.FAILED
        Step.objects.filter(task=task, step_id=step_id).update(
            status=status, error=error[:10_000], attempts=attempts, reads=reads, started_at=started_at,
            finished_at=now, **({"failure_fingerprint": fingerprint} if fingerprint else {}))
        create_event(task, seq, "step_failed", {
            "step": step_id, "attempt": attempts, "error": error[:500], "retrying": retrying})
    plan.attempts[step_id] = attempts
    plan.set_status(step_id, status)
    plan.requeue(step_id)  # a retry runs again once its backoff is over
    if fingerprint:
        plan.fingerprints[step_id] = fingerprint


def ensure_plan(*, lease: Lease, task_type, params) -> PlanState:
    """Create the task's Step rows on its first run; afterwards load them (the plan is
    part of the durable state, so a recovered task continues the same plan)."""
    with transaction.atomic():
        task = lock_fenced(lease)
        # worker.pid in the API: the process executing the steps (killing it is a crash).
        task.worker_pid = os.getpid()
        # The code this run runs the task on: what a resume after a deploy compares (engine/compat.py).
        try:
            fingerprint_changed = compat.record(task, task_type=task_type)
        except Exception:  # a type's own compat_fingerprint failing must not stop its runs
            log.exception("compatibility fingerprint not recorded", extra={"task_id": task.pk})
            fingerprint_changed = False
        starting = task.status == TaskStatus.QUEUED
        # Every write of Step rows moves the checkpoint version: at version 0 there are none to read.
        rows = plan_rows(task) if task.checkpoint_version else []
        if rows:
            if starting:
                states.transition(task, TaskStatus.RUNNING, reason="running on a worker",
                                  extra={"worker": f"{lease.host}:{task.worker_pid}"})
            else:
                task.save(update_fields=["worker_pid", "compat"] if fingerprint_changed else ["worker_pid"])
            plan = plan_from(rows)
            plan.version = task.checkpoint_version
            plan.stack = list(task.stack or [])
            return plan
        specs = task_type.plan(params)
        known = set()
        for spec in specs:
            missing = [d for d in spec.depends_on if d not in known]
            if missing:
                raise ValueError(f"step {spec.id!r} depends on {missing}, which come later or do not exist")
            known.add(spec.id)
        step_rows.insert(task, specs)
        task.steps_total = len(specs)
        task.checkpoint_version += 1
        planned = ("planned", {"steps": [s.id for s in specs][:200], "steps_total": len(specs)})
        if starting:
            # A task's first run: its start and its plan in one UPDATE of the row (and one INSERT of
            # both events), where they were three UPDATEs.
            states.transition(task, TaskStatus.RUNNING, reason="running on a worker",
                              extra={"worker": f"{lease.host}:{task.worker_pid}"}, then_events=[planned])
        else:
            seq = events.reserve_locked(task, saving=["steps_total", "checkpoint_version", "worker_pid", "compat"])
            create_event(task, seq, *planned)
        plan = PlanState()
        for spec in specs:
            plan.add(spec.id, spec.depends_on, on_failure=spec.on_failure, runs_after_skipped=spec.runs_after_skipped)
        plan.version = task.checkpoint_version
        # The plan's first version: no row can exist for it yet (it is written in this transaction).
        snapshots.write_first(task, plan.snapshot_state(task))
        return plan


def snapshot_now(task: Task, step_id: str = "") -> None:
    """A full snapshot of the task as its Step rows stand (after a revision of the plan)."""
    save_snapshot(task, plan_from(plan_rows(task)).snapshot_state(task), step_id)


def skip_steps(task: Task, plan: PlanState, step_id: str, error: str, *, by: str) -> list[str]:
    """Skip `step_id` (with its error) and the dependants it takes with it, as one checkpoint
    of the locked `task`; returns the skipped ids. The caller updates the plan (`plan.set_status`)
    once its transaction has committed."""
    cascade = plan.skip_cascade(step_id)
    now = timezone.now()
    Step.objects.filter(task=task, step_id=step_id).update(status=StepStatus.SKIPPED, error=error[:10_000],
                                                           finished_at=now)
    if len(cascade) > 1:
        Step.objects.filter(task=task, step_id__in=cascade[1:]).update(
            status=StepStatus.SKIPPED, error=f"skipped: depends on {step_id}, which was skipped", finished_at=now)
    task.checkpoint_version += 1
    seq = events.reserve_locked(task, saving=["checkpoint_version"])
    snapshots.write_delta(task.pk, task.checkpoint_version,
                          {"steps": {sid: StepStatus.SKIPPED for sid in cascade}, "status": task.status}, step_id)
    create_event(task, seq, "step_skipped", {"step": step_id, "by": by, "error": error[:500],
                                                         "dependants": cascade[1:200], "version": task.checkpoint_version})
    return cascade


def compact_snapshots(lease_task: Task, plan: PlanState) -> None:
    """At the end of a run (in its finishing transaction): the last kept versions become
    full rows, older ones go (engine/snapshots.py)."""
    snapshots.compact(lease_task, plan.snapshot_state(lease_task))


def commit_events(*, lease: Lease, plan: PlanState, consumed: list, stack: list | None = None) -> int:
    """Consume inbox events at a resume point, as one checkpoint fenced on the lease: each
    event's state and outcome, the steps they add, the task stack when a preemption pushed
    a frame, a snapshot version, a progress event.
    `consumed`: (InboundEvent, inbox.Applied) pairs. Returns the new version."""
    now = timezone.now()
    with transaction.atomic():
        task = lock_fenced(lease)
        # Read before the row was locked: a sender may have merged one of them since (senders
        # lock the row too). Only those still pending are consumed.
        still = set(InboundEvent.objects.filter(pk__in=[e.pk for e, _ in consumed], state=InboundState.PENDING)
                    .values_list("pk", flat=True))
        consumed = [(event, applied) for event, applied in consumed if event.pk in still]
        added = [addition for event, applied in consumed
                 for addition in additions(plan, applied.add_steps, f"{INBOX_ADDER}{event.seq}")]
        task.checkpoint_version += 1
        task.steps_total += len(added)
        task.heartbeat_at = now
        if stack is not None:
            task.stack = stack
        seq = events.reserve_locked(task, saving=["checkpoint_version", *inbox_counter.consumed(task, len(consumed)),
                                                  "steps_total", "heartbeat_at", "stack"])
        for event, applied in consumed:
            InboundEvent.objects.filter(pk=event.pk).update(state=applied.state, outcome=applied.outcome[:2000],
                                                            consumed_at=now, consumed_in_version=task.checkpoint_version)
        insert_added_steps(task.pk, plan, added)
        for _, applied in consumed:
            for write in applied.writes:
                write()
        delta = {"steps": {spec.id: StepStatus.PENDING for spec, _, _ in added}, "status": task.status,
                 "inbox_consumed": [event.seq for event, _ in consumed]}
        if added:
            delta["added_by"] = {spec.id: adder for spec, adder, _ in added}
        if stack is not None:
            delta["stack"] = stack
        snapshots.write_delta(task.pk, task.checkpoint_version, delta)
        create_event(task, seq, "inbox_consumed", {
            "events": [{"seq": e.seq, "type": e.type, "state": a.state, "outcome": a.outcome[:200]}
                       for e, a in consumed][:50],
            "steps_added": [spec.id for spec, _, _ in added][:200], "version": task.checkpoint_version})
        fault_point("mid_checkpoint", "inbox")  # crash tests: the consumption vanishes whole
    fault_point("after_checkpoint", "inbox")
    plan.version = task.checkpoint_version
    if stack is not None:
        plan.stack = stack
    join_plan(plan, added)
    return task.checkpoint_version
