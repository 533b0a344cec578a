"""Preemption and the task stack: an urgent subtask runs first, then the work it suspended
continues where it was.

A `preempt` event (P0, engine/inbox.py) names one of the task type's `subtasks`. When the
runner's supervisor sees it pending, the steps in flight are cancelled through their tokens
(within one control poll); once they have wound down — the resume point — the event is
consumed and, in the same fenced checkpoint (checkpoint.commit_events), a *frame* is pushed
on the task stack and the subtask's steps join the plan. A frame records what was
suspended: the todo list and its cursor, what had finished, the candidates that were ready
next, the steps the preemption interrupted, and what the work holds outside the database
(TaskType.frame_references). While a frame is on top only its steps run; when they have all
finished the frame is popped in a checkpoint of its own that also records an internal
`subtask.done` (P3) event, and the todo list continues, nothing done twice (an interrupted
step had not committed; its effects replay from the WAL by their keys).

The stack is durable (Task.stack) and part of every snapshot; depth is at most
MAX_STACK_DEPTH. A pause or a crash with a frame on the stack resumes inside the subtask.

Temporary files (TaskType.frame_temp_files): a frame lists the scratch files of the steps it
interrupted and of its subtask's steps, with the policy TEMP_FILES_POLICY: deleted once the
frame is popped (after the pop commits: a crash in between leaves them, listed in the
snapshot). A task that ends with a frame still on its stack keeps them, listed there.
"""
import hashlib
import json
import logging
import os

from django.db import transaction
from django.utils import timezone

from ..models import InboundEvent, InboundState, Step, StepStatus
from . import events, snapshots
from .plan_state import FINISHED, PlanState
from .events import create_event
from .inbox import MAX_STACK_DEPTH, Applied
from .lease import Lease, lock_fenced

log = logging.getLogger(__name__)

LISTED = 200  # steps listed by id in a frame (counts are always complete)
TEMP_FILES_POLICY = "deleted when the frame is popped"


def runs_now(plan: PlanState, step_id: str) -> bool:
    """While a frame is on top, only its subtask's steps may start."""
    return not plan.stack or step_id in plan.stack[-1]["steps"]


def top_finished(plan: PlanState) -> bool:
    """Every step of the top frame's subtask has finished (or left the plan in a revision)."""
    return bool(plan.stack) and all(plan.status.get(s, StepStatus.DONE) in FINISHED
                                    for s in plan.stack[-1]["steps"])


def apply(task_type, event: InboundEvent, params, plan: PlanState, *, depth: int, interrupted: list[str],
          seen_at=None) -> tuple[Applied, dict | None]:
    """What consuming a `preempt` event does: the subtask's steps and the frame to push, or
    a rejection that says why (the stack is full, the subtask does not fit the plan)."""
    subtask, args = event.payload.get("subtask", ""), event.payload.get("args") or {}
    if depth >= MAX_STACK_DEPTH:
        return Applied(f"rejected: the task stack is {depth} deep (at most {MAX_STACK_DEPTH}); let a subtask finish "
                       f"first", state=InboundState.REJECTED), None
    if subtask not in task_type.subtasks:
        return Applied(f"rejected: {task_type.name} has no subtask {subtask!r}", state=InboundState.REJECTED), None
    try:
        specs = task_type.plan_subtask(subtask, args, params, event.seq)
    except ValueError as exc:
        return Applied(f"rejected: {exc}", state=InboundState.REJECTED), None
    ids = {spec.id for spec in specs}
    for spec in specs:
        outside = [d for d in spec.depends_on if d not in ids and plan.status.get(d) not in FINISHED]
        if outside:
            # The subtask runs before everything else: it cannot wait for suspended work.
            return Applied(f"rejected: subtask step {spec.id!r} depends on {outside}, which have not run",
                           state=InboundState.REJECTED), None
    if not specs:
        return Applied(f"rejected: subtask {subtask!r} has nothing to do", state=InboundState.REJECTED), None
    steps = [s.id for s in specs]
    references = {**task_type.frame_references(params),
                  "temp_files": list(task_type.frame_temp_files(params, event.task_id, interrupted=list(interrupted),
                                                                steps=steps)),
                  "temp_files_policy": TEMP_FILES_POLICY}
    frame = suspended_frame(plan, event=event, subtask=subtask, args=args, steps=steps,
                            interrupted=interrupted, references=references, depth=depth + 1)
    if seen_at is not None:  # P0: how long the steps in flight ran on after the event arrived
        frame["interrupted_after_ms"] = round((seen_at - event.created_at).total_seconds() * 1000, 1)
    why = f" ({event.payload['reason']})" if event.payload.get("reason") else ""
    return Applied(f"pushed frame {depth + 1}: subtask {subtask} runs first{why}; "
                   f"{frame['todo_count']} suspended step(s) continue after it", add_steps=specs), frame


def suspended_frame(plan: PlanState, *, event, subtask: str, args: dict, steps: list[str], interrupted: list[str],
                    references: dict, depth: int) -> dict:
    """The frame a preemption pushes: what the suspended work was about to do."""
    todo = [sid for sid in plan.order if plan.status[sid] == StepStatus.PENDING]
    finished = [sid for sid in plan.order if plan.status[sid] in FINISHED]
    candidates = [sid for sid in todo if not plan.unfinished_deps[sid]][:10]
    return {
        "depth": depth, "event": event.seq, "subtask": subtask, "args": args,
        "reason": event.payload.get("reason", ""), "by": event.actor_name, "steps": steps,
        "todo": todo[:LISTED], "todo_count": len(todo), "cursor": todo[0] if todo else "",
        "finished": finished[-LISTED:], "finished_count": len(finished), "candidates": candidates,
        "interrupted": interrupted, "references": references,
        "pushed_at": timezone.now().isoformat(), "pushed_in_version": plan.version + 1,
    }


def pop(lease: Lease, plan: PlanState) -> dict:
    """The top frame's subtask has finished: pop it, in one fenced checkpoint with an
    internal `subtask.done` event (P3, consumed at once) and a snapshot version."""
    frame = plan.stack[-1]
    statuses = dict(Step.objects.filter(task_id=lease.task_id, step_id__in=frame["steps"])
                    .values_list("step_id", "status"))
    now = timezone.now()
    with transaction.atomic():
        task = lock_fenced(lease)
        task.stack = list(task.stack)[:-1]
        task.checkpoint_version += 1
        task.inbox_seq += 1
        task.heartbeat_at = now
        seq = events.reserve_locked(task, saving=["stack", "checkpoint_version", "inbox_seq", "heartbeat_at"])
        payload = {"subtask": frame["subtask"], "event": frame["event"], "steps": statuses}
        outcome = (f"frame {frame['depth']} popped: subtask {frame['subtask']} finished "
                   f"({', '.join(f'{s} {st}' for s, st in statuses.items())}); "
                   f"the suspended work continues at {frame['cursor'] or 'its end'}")
        InboundEvent.objects.create(
            task=task, seq=task.inbox_seq, type="subtask.done", priority=3, source="internal",
            actor_name="internal", payload=payload,
            payload_sha256=hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest(),
            visible_at=now, state=InboundState.CONSUMED, outcome=outcome[:2000], consumed_at=now,
            consumed_in_version=task.checkpoint_version)
        snapshots.write_delta(task.pk, task.checkpoint_version, {"stack": task.stack, "status": task.status})
        create_event(task, seq, "subtask_done", {
            "subtask": frame["subtask"], "depth": frame["depth"], "event": frame["event"], "steps": statuses,
            "cursor": frame["cursor"], "version": task.checkpoint_version})
    plan.version, plan.stack = task.checkpoint_version, list(task.stack)
    removed = remove_temp_files(frame)
    log.info("task stack: frame popped", extra={"task_id": lease.task_id, "subtask": frame["subtask"],
                                                "depth": frame["depth"], "temp_files_removed": removed})
    return frame


def remove_temp_files(frame: dict) -> int:
    """The frame is popped (committed): delete the temporary files it lists. Those already
    gone are fine; one that cannot be removed is logged, never fails the task."""
    removed = 0
    for path in (frame.get("references") or {}).get("temp_files") or []:
        try:
            os.remove(path)
            removed += 1
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("task stack: a temporary file of a popped frame could not be removed: %s (%s)", path, exc)
    return removed
