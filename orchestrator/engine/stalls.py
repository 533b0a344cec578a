"""Stalled tasks (issue 24, item 5): a task that runs — its lease holder alive and beating —
while its current step has made no progress for ORCH_STALL_FACTOR × the p95 of its type's step
durations (at least STALL_FLOOR_SECONDS, once the type has STALL_MIN_SAMPLES finished steps).

A stale task (its worker went quiet) is recovery's business (engine/recovery.py); a stalled one
has a live worker whose step does not end: a hung call, a dead upstream, a deadlock. Nothing is
cancelled or retried here: people are told.

- What is stalled is computed from durable rows (the task's lease, `activities` — the running
  step and since when, published with each heartbeat — and its type's recent steps): the badge
  and `waiting_on.stalled` (presenters/waiting.py), the metric `orch_tasks_stalled`
  (metrics.py) and the sweeper all ask `is_stalled` / `stalled_now` here.
- The sweeper's pass (`sweep`, from recovery.sweep) tells operators once per stall: the
  `task.stalled` notification (email and webhooks, orchestrator/notifications) goes out in the
  transaction that sets `Task.stalled_since` to the moment the stalled step's progress began, a
  compare-and-set, so several sweepers and later passes never tell the same stall twice. When
  the task makes progress again (a step finished, a new one began) or stops running, the next
  pass clears the column; a later stall is a new one and is told again.
"""
import logging
from datetime import datetime, timezone as dt_timezone

from django.db import transaction
from django.utils import timezone

from ..conf import harness
from ..models import Step, Task
from ..notifications import TASK_STALLED, notify
from . import states

log = logging.getLogger(__name__)

STALL_MIN_SAMPLES = 5
STALL_SAMPLE_ROWS = 2000
STALL_FLOOR_SECONDS = 10.0
SWEEP_LIMIT = 500  # running tasks looked at per pass


def when(value) -> datetime | None:
    """A moment as `activities` hold it (a timestamp, or an ISO string)."""
    if isinstance(value, datetime):
        return value
    if isinstance(value, (int, float)):
        return datetime.fromtimestamp(value, tz=dt_timezone.utc)
    if isinstance(value, str) and value:
        try:
            parsed = datetime.fromisoformat(value)
        except ValueError:
            return None
        return parsed if parsed.tzinfo else parsed.replace(tzinfo=dt_timezone.utc)
    return None


def running(task: Task) -> bool:
    """Run by a lease holder now (a task between slices, or recovered, waits for a worker instead)."""
    return task.status in states.ACTIVE and bool(task.lease_owner)


def thresholds(types: set[str]) -> dict[str, float]:
    """Per task type, the seconds after which a running step is stalled: ORCH_STALL_FACTOR × the
    p95 of its type's recent step durations (at least STALL_FLOOR_SECONDS); types with too few
    finished steps, or a factor of 0, have none. One query for all the types."""
    factor = harness.stall_factor
    if not types or factor <= 0:
        return {}
    durations: dict[str, list[float]] = {}
    for type_name, started, finished in (Step.objects.filter(task__type__in=types, status="done",
                                                             started_at__isnull=False, finished_at__isnull=False)
                                         .order_by("-id").values_list("task__type", "started_at", "finished_at")
                                         [:STALL_SAMPLE_ROWS]):
        durations.setdefault(type_name, []).append((finished - started).total_seconds())
    found = {}
    for type_name, values in durations.items():
        if len(values) >= STALL_MIN_SAMPLES:
            values.sort()
            p95 = values[min(len(values) - 1, int(0.95 * len(values)))]
            found[type_name] = max(STALL_FLOOR_SECONDS, factor * p95)
    return found


def progress_since(task: Task) -> datetime | None:
    """Since when the running task has made no progress: its current step's start (from its
    published activities), else its claim."""
    step = next((a for a in task.activities or [] if isinstance(a, dict) and a.get("kind") == "step"), None)
    return (when(step.get("since")) if step else None) or task.claimed_at


def is_stalled(task: Task, now: datetime, after: dict[str, float]) -> tuple[bool, datetime | None, float | None]:
    """(stalled, no progress since, the type's threshold in seconds) for `task`, given the
    thresholds of its type (`thresholds`)."""
    limit = after.get(task.type)
    since = progress_since(task)
    if not running(task) or not limit or since is None:
        return False, since, limit
    return (now - since).total_seconds() > limit, since, limit


STALL_FIELDS = ("pk", "type", "status", "lease_owner", "activities", "claimed_at", "stalled_since")


def running_tasks() -> list[Task]:
    """The tasks a lease holder runs now (at most SWEEP_LIMIT, oldest first), with the columns
    `is_stalled` reads."""
    return list(Task.objects.filter(status__in=states.ACTIVE).exclude(lease_owner="")
                .only(*STALL_FIELDS).order_by("pk")[:SWEEP_LIMIT])


def stalled_among(tasks: list[Task], now: datetime) -> list[tuple[Task, datetime, float]]:
    """(task, no progress since, threshold) of each stalled task of `tasks`. One query."""
    after = thresholds({t.type for t in tasks if running(t)})
    found = []
    for task in tasks:
        stalled, since, limit = is_stalled(task, now, after)
        if stalled:
            found.append((task, since, limit))
    return found


def sweep(now: datetime | None = None) -> list[int]:
    """Tell operators of each stall once (`task.stalled`), and clear the mark of tasks that made
    progress or stopped running. Returns the ids of the tasks told of in this pass."""
    now = now or timezone.now()
    tasks = running_tasks() if harness.stall_factor > 0 else []
    found = stalled_among(tasks, now)
    told = []
    for task, since, limit in found:
        if task.stalled_since == since:
            continue  # told already
        step = next((a.get("label") for a in task.activities or []
                     if isinstance(a, dict) and a.get("kind") == "step"), "")
        quiet = (now - since).total_seconds()
        with transaction.atomic():
            # Compare-and-set: of several sweepers (or passes), one marks this stall and tells it.
            marked = (Task.objects.filter(pk=task.pk, status__in=states.ACTIVE).exclude(lease_owner="")
                      .exclude(stalled_since=since).update(stalled_since=since))
            if not marked:
                continue
            reason = (f"no progress for {quiet:.0f} s" + (f" in step {step}" if step else "")
                      + f": over {limit:.0f} s (ORCH_STALL_FACTOR={harness.stall_factor:g} × the p95 of "
                        f"{task.type}'s step durations)")
            notify(TASK_STALLED, task_id=task.pk, reason=reason,
                   extra={"step": step, "stalled_since": since.isoformat(), "threshold_seconds": round(limit, 3)})
        told.append(task.pk)
        log.warning("task stalled: operators told", extra={"task_id": task.pk, "step_id": step,
                                                            "stalled_seconds": round(quiet, 1)})
    # Clear the marks of stalls that ended: progress again, or no longer run by a lease holder.
    # Only the mark this pass saw end is cleared (compare-and-set on its value): a new stall
    # another sweeper marked meanwhile stays marked.
    looked_at = {task.pk for task in tasks}
    still = {(task.pk, since) for task, since, _ in found}
    for pk, since, status, owner in list(Task.objects.filter(stalled_since__isnull=False)
                                         .values_list("pk", "stalled_since", "status", "lease_owner")[:SWEEP_LIMIT]):
        ended = (status not in states.ACTIVE or not owner or harness.stall_factor <= 0
                 or (pk in looked_at and (pk, since) not in still))
        if ended:
            Task.objects.filter(pk=pk, stalled_since=since).update(stalled_since=None)
    return told
