"""Checkpoints: each finished step commits its result, its state, a new snapshot version
and a progress event in one transaction, fenced on the lease. Nothing half-commits.

The snapshot holds the plan with step states, params and counters; step results stay in
their Step rows (referenced by id) so a snapshot row stays small.
"""
import logging
import os
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.db import transaction
from django.utils import timezone

from .. import telemetry
from ..conf import harness
from ..outage import retry_while_down
from ..models import Snapshot, Step, StepStatus, Task, TaskStatus
from . import wal
from .events import create_event
from .faults import fault_point
from .lease import Lease, lock_fenced

log = logging.getLogger(__name__)

FINISHED = (StepStatus.DONE, StepStatus.SKIPPED)


@dataclass
class PlanState:
    """The runner's view of the plan; only the lease holder changes step states."""

    order: list[str]
    depends_on: dict[str, tuple[str, ...]]
    status: dict[str, str]
    attempts: dict[str, int] = field(default_factory=dict)
    fingerprints: dict[str, str] = field(default_factory=dict)
    generations: dict[str, int] = field(default_factory=dict)
    on_failure: dict[str, str] = field(default_factory=dict)  # steps with a policy of their own
    runs_after_skipped: set[str] = field(default_factory=set)

    def done_count(self) -> int:
        return sum(1 for s in self.status.values() if s == StepStatus.DONE)

    def finished(self, step_id: str) -> bool:
        """Done, or skipped: either way, nothing more to run for it."""
        return self.status[step_id] in FINISHED

    def skip_cascade(self, step_id: str) -> list[str]:
        """`step_id` and every unfinished step that (transitively) depends on it and does
        not run after skipped steps — in plan order (dependencies first)."""
        skipped, cascade = {step_id}, [step_id]
        for sid in self.order:
            if sid in skipped or self.finished(sid) or sid in self.runs_after_skipped:
                continue
            if any(dep in skipped for dep in self.depends_on[sid]):
                skipped.add(sid)
                cascade.append(sid)
        return cascade

    def snapshot_state(self, task: Task) -> dict:
        state = {"params": task.params, "limits": task.limits, "status": task.status,
                 "steps": {sid: self.status[sid] for sid in self.order},
                 "counters": {"steps_done": self.done_count(), "tokens_used": task.tokens_used,
                              "active_seconds": round(task.active_seconds, 3)}}
        generations = {sid: g for sid, g in self.generations.items() if g}
        if generations:  # only steps re-run after an edit or rollback
            state["generations"] = generations
        return state


def save_snapshot(task: Task, state: dict, step_id: str = "") -> Snapshot:
    snapshot = Snapshot.objects.create(task=task, version=task.checkpoint_version, step_id=step_id, state=state)
    keep = harness.snapshot_keep
    if keep and task.checkpoint_version > keep:
        # Bounded storage: one indexed DELETE per commit keeps the last `keep` versions.
        Snapshot.objects.filter(task=task, version__lte=task.checkpoint_version - keep).delete()
    return snapshot


@telemetry.traced_checkpoint
def commit_step(*, lease: Lease, plan: PlanState, step_id: str, result: Any, reads: list[str],
                effects: list[wal.CompletedEffect], started_at: datetime, tokens_used: int = 0,
                active_seconds: float = 0.0) -> int:
    """Commit a finished step; returns the new checkpoint version. Raises LeaseLost."""
    fault_point("before_checkpoint", step_id)
    now = timezone.now()
    previous_status = plan.status[step_id]

    def undo():  # the transaction rolled back: so does the plan
        plan.status[step_id] = previous_status

    try:
        # The step's work (and its effects) happened: keep it until the database is back rather
        # than die and make a recovery redo it. The commit is fenced: if a worker took the task
        # over meanwhile, it fails with LeaseLost.
        return retry_while_down(
            lambda: _commit_step(lease=lease, plan=plan, step_id=step_id, result=result, reads=reads,
                                 effects=effects, started_at=started_at, tokens_used=tokens_used,
                                 active_seconds=active_seconds, now=now),
            seconds=harness.database_retry_seconds, logger=log, what="checkpoint", on_failure=undo,
            extra={"task_id": lease.task_id, "step_id": step_id})
    except BaseException:
        undo()
        raise


def _commit_step(*, lease, plan, step_id, result, reads, effects, started_at, tokens_used, active_seconds, now) -> int:
    with transaction.atomic():
        task = lock_fenced(lease)
        plan.status[step_id] = StepStatus.DONE
        attempts = plan.attempts.get(step_id, 0) + 1
        task.checkpoint_version += 1
        task.event_seq += 1
        task.steps_done = plan.done_count()
        task.tokens_used += tokens_used
        task.active_seconds += active_seconds
        task.heartbeat_at = now
        task.save(update_fields=["checkpoint_version", "event_seq", "steps_done", "tokens_used",
                                 "active_seconds", "heartbeat_at", "updated_at"])
        wal.mark_done(effects)
        Step.objects.filter(task=task, step_id=step_id).update(
            status=StepStatus.DONE, result=result, reads=reads, attempts=attempts, error="",
            started_at=started_at, finished_at=now)
        save_snapshot(task, plan.snapshot_state(task), step_id)
        fault_point("mid_checkpoint", step_id)  # crash tests: the whole checkpoint must vanish
        create_event(task, task.event_seq, "step_done", {
            "step": step_id, "version": task.checkpoint_version, "steps_done": task.steps_done,
            "steps_total": task.steps_total, "seconds": round((now - started_at).total_seconds(), 3)})
    plan.attempts[step_id] = attempts
    fault_point("after_checkpoint", step_id)
    return task.checkpoint_version


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
        task.event_seq += 1
        task.heartbeat_at = now
        task.save(update_fields=["event_seq", "heartbeat_at", "updated_at"])
        wal.mark_done(effects)
        status = StepStatus.PENDING if retrying else StepStatus.FAILED
        Step.objects.filter(task=task, step_id=step_id).update(
            status=status, error=error[:10_000], attempts=attempts, reads=reads, started_at=started_at,
            finished_at=now, **({"failure_fingerprint": fingerprint} if fingerprint else {}))
        create_event(task, task.event_seq, "step_failed", {
            "step": step_id, "attempt": attempts, "error": error[:500], "retrying": retrying})
    plan.attempts[step_id] = attempts
    plan.status[step_id] = status
    if fingerprint:
        plan.fingerprints[step_id] = fingerprint


def ensure_plan(*, lease: Lease, task_type, params) -> PlanState:
    """Create the task's Step rows on its first run; afterwards load them (the plan is
    part of the durable state, so a recovered task continues the same plan)."""
    from . import states

    with transaction.atomic():
        task = lock_fenced(lease)
        # worker.pid in the API: the process executing the steps (killing it is a crash).
        task.worker_pid = os.getpid()
        if task.status == TaskStatus.QUEUED:
            states.transition(task, TaskStatus.RUNNING, reason="running on a worker",
                              extra={"worker": f"{lease.host}:{task.worker_pid}"})
        else:
            task.save(update_fields=["worker_pid"])
        steps = plan_rows(task)
        if not steps:
            specs = task_type.plan(params)
            known = set()
            for spec in specs:
                missing = [d for d in spec.depends_on if d not in known]
                if missing:
                    raise ValueError(f"step {spec.id!r} depends on {missing}, which come later or do not exist")
                known.add(spec.id)
            Step.objects.bulk_create([step_row(task, spec, i) for i, spec in enumerate(specs)])
            task.steps_total = len(specs)
            task.checkpoint_version += 1
            task.event_seq += 1
            task.save(update_fields=["steps_total", "checkpoint_version", "event_seq", "updated_at"])
            steps = [(s.id, list(s.depends_on), StepStatus.PENDING, 0, "", 0, s.on_failure, s.runs_after_skipped)
                     for s in specs]
            plan = _plan_from(steps)
            save_snapshot(task, plan.snapshot_state(task), "")
            create_event(task, task.event_seq, "planned", {"steps": [s.id for s in specs][:200],
                                                           "steps_total": len(specs)})
            return plan
    return _plan_from(steps)


def step_row(task: Task, spec, position: int) -> Step:
    """A new Step row from the type's StepSpec."""
    return Step(task=task, step_id=spec.id, position=position, title=spec.title or spec.id,
                depends_on=list(spec.depends_on), declared_reads=list(spec.reads), on_failure=spec.on_failure,
                runs_after_skipped=spec.runs_after_skipped)


def plan_rows(task: Task) -> list[tuple]:
    return list(Step.objects.filter(task=task).order_by("position")
                .values_list("step_id", "depends_on", "status", "attempts", "failure_fingerprint", "generation",
                             "on_failure", "runs_after_skipped"))


def snapshot_now(task: Task, step_id: str = "") -> Snapshot:
    """A snapshot of the task as its Step rows stand (after a revision of the plan)."""
    return save_snapshot(task, _plan_from(plan_rows(task)).snapshot_state(task), step_id)


def _plan_from(rows) -> PlanState:
    plan = PlanState(order=[], depends_on={}, status={}, attempts={})
    for step_id, depends_on, status, attempts, fingerprint, generation, on_failure, after_skipped in rows:
        plan.order.append(step_id)
        plan.depends_on[step_id] = tuple(depends_on)
        # A step that was running when its worker died, or failed before a resume, runs again.
        plan.status[step_id] = StepStatus.PENDING if status in (StepStatus.RUNNING, StepStatus.FAILED) else status
        plan.attempts[step_id] = attempts
        if fingerprint:
            plan.fingerprints[step_id] = fingerprint
        if generation:
            plan.generations[step_id] = generation
        if on_failure:
            plan.on_failure[step_id] = on_failure
        if after_skipped:
            plan.runs_after_skipped.add(step_id)
    return plan


def skip_steps(task: Task, plan: PlanState, step_id: str, error: str, *, by: str) -> list[str]:
    """Skip `step_id` (with its error) and the dependants it takes with it, as one checkpoint
    of the locked `task`; returns the skipped ids. The caller updates `plan.status` once its
    transaction has committed."""
    cascade = plan.skip_cascade(step_id)
    now = timezone.now()
    Step.objects.filter(task=task, step_id=step_id).update(status=StepStatus.SKIPPED, error=error[:10_000],
                                                           finished_at=now)
    if len(cascade) > 1:
        Step.objects.filter(task=task, step_id__in=cascade[1:]).update(
            status=StepStatus.SKIPPED, error=f"skipped: depends on {step_id}, which was skipped", finished_at=now)
    statuses = {**plan.status, **{sid: StepStatus.SKIPPED for sid in cascade}}
    shadow = PlanState(order=plan.order, depends_on=plan.depends_on, status=statuses,
                       generations=plan.generations)
    task.checkpoint_version += 1
    task.event_seq += 1
    task.save(update_fields=["checkpoint_version", "event_seq", "updated_at"])
    save_snapshot(task, shadow.snapshot_state(task), step_id)
    create_event(task, task.event_seq, "step_skipped", {"step": step_id, "by": by, "error": error[:500],
                                                         "dependants": cascade[1:200], "version": task.checkpoint_version})
    return cascade
