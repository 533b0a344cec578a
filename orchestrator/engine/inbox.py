"""The inbox: events sent into a task, and how the task consumes them.

One door in. Senders (the API, the pages, the CLI, the operator controls) only enqueue an
InboundEvent, committed before the reply; the runner consumes pending events at resume
points (between steps), in the same transaction as the checkpoint that applies them,
fenced on the lease — so each event is applied exactly once, even across kill -9.

Priorities:
- P0 interrupts: the operator controls pause, stop and terminate. They act through the
  control column the supervisor polls every ORCH_CONTROL_POLL_SECONDS (the running step is
  cancelled through the token tree); their inbox row records the request and its outcome.
  `preempt` (P0) cancels the steps in flight the same way, then pushes a frame on the
  task stack at the resume point and runs the urgent subtask first (engine/preemption.py).
- P1 is applied at the next resume point, never aborting a step: `resume`, `user.message`,
  `instruction`, `approval.decided` (the task type's handler decides what it means).
- P3 updates state at the next resume point (`upstream.ready`); P4 is recorded only
  (`progress.external`) and expires after ORCH_INBOX_P4_TTL_SECONDS.
- P2 `unit.failed` {"step", "error"}: at the next resume point the named step's retry policy
  applies as if it had failed with that error (a running step is cancelled first); a step
  already finished is not compensated (the event is rejected, saying so).

Dedupe: `source_event_id` is unique per (task, source) for the task's life; a repeat with
the same payload answers the first event (`duplicate`), another payload is refused (409).
Merge: a mergeable type's new event supersedes its group's (task, type, merge_key) pending
events received in the last ORCH_INBOX_MERGE_SECONDS, and becomes visible that long after
the last of a burst, at most ORCH_INBOX_MERGE_CAP_SECONDS after its first.
A mergeable event whose `occurred_at` is older than the newest seen in its group is recorded
`rejected` with the outcome "ignored: stale" (it is never applied).
Backpressure: past ORCH_INBOX_SHED_P4_AT / _P3_AT / _P2_AT pending events, new P4 / P3 / P2
events are refused with Retry-After (429) and kept as `shed` rows (counted, listed); P0 and
P1 are always accepted; at ORCH_INBOX_PAUSE_AT pending the task pauses and its operators
are told.
"""
import hashlib
import json
import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.db import transaction
from django.db.models import F
from django.utils import timezone
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..conf import harness
from ..models import InboundEvent, InboundState, Task, TaskStatus as S
from ..notifications import notify_needs_human
from ..tasktypes import get_type
from . import scheduler, states
from .audit import audit
from .events import append_event
from ..primitives.errors import HarnessError

log = logging.getLogger(__name__)

MAX_PAYLOAD_BYTES = 64 * 1024
RETRY_AFTER_SECONDS = 5
CONSUMED_PER_RESUME_POINT = 100


class AnyPayload(BaseModel):
    model_config = ConfigDict(extra="allow")


class NoPayload(BaseModel):
    model_config = ConfigDict(extra="forbid")


class UserMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: str = Field(..., min_length=1, max_length=20_000)


class ApprovalDecided(BaseModel):
    """A reviewer's decision on one approval (sent by the review queue only: REVIEW_ONLY)."""
    model_config = ConfigDict(extra="forbid")
    approved: bool
    approval_id: str = Field(..., min_length=1, max_length=40, description="the approval (review item) it decides")
    call_id: str = Field("", max_length=200, description="the tool call the approval is bound to")
    arguments_sha256: str = Field("", max_length=64,
                                  description="SHA-256 of the canonical arguments the call may run with")
    note: str = Field("", max_length=2000)
    arguments: dict | None = Field(None, description="edit-and-approve: the corrected arguments the call runs with")
    expired: bool = Field(False, description="nobody decided before the approval's deadline (not a rejection)")


class UpstreamReady(BaseModel):
    model_config = ConfigDict(extra="allow")
    resource: str = Field("", max_length=500)


class EditRecorded(BaseModel):
    """An operator's parameter edit, as applied (written by revisions.apply_edit)."""
    model_config = ConfigDict(extra="forbid")
    diff: dict = Field(..., description="each changed parameter: [before, after]")
    rerun: list[str] = Field(default_factory=list, description="finished steps that run again")
    removed: list[str] = Field(default_factory=list, description="steps no longer in the plan")
    limits: dict | None = Field(None, description="the task's limits, when the edit changed them")


class RollbackRecorded(BaseModel):
    """An operator's rollback, as applied (written by revisions.apply_rollback)."""
    model_config = ConfigDict(extra="forbid")
    to_version: int
    rerun: list[str] = Field(default_factory=list, description="finished steps that run again")
    effects_after: int = Field(0, description="side effects performed after that version (not undone)")


class SkipStepRecorded(BaseModel):
    """An operator's Skip step, as applied (written by services.task_skip_step)."""
    model_config = ConfigDict(extra="forbid")
    step: str
    reason: str
    skipped: list[str] = Field(default_factory=list, description="the step and the dependants it took with it")


class Preempt(BaseModel):
    model_config = ConfigDict(extra="forbid")
    subtask: str = Field(..., min_length=1, max_length=100, description="one of the task type's subtasks")
    args: dict = Field(default_factory=dict, description="what the subtask needs (the task type says)")
    reason: str = Field("", max_length=500)


class UnitFailed(BaseModel):
    model_config = ConfigDict(extra="forbid")
    step: str = Field(..., min_length=1, max_length=200, description="the step (unit) that failed outside the task")
    error: str = Field(..., min_length=1, max_length=2000, description="what failed: the upstream's words")


class SubtaskDone(BaseModel):
    model_config = ConfigDict(extra="allow")


class ProgressExternal(BaseModel):
    model_config = ConfigDict(extra="allow")
    message: str = Field("", max_length=2000)
    percent: float | None = Field(None, ge=0, le=100)


@dataclass(frozen=True)
class EventType:
    name: str
    default_priority: int
    payload: type[BaseModel]
    # Who may send it, and the highest priority (lowest number) each may ask for.
    ceilings: dict[str, int] = field(default_factory=lambda: {"operator": 0, "user": 1, "system": 0,
                                                                "internal": 0, "webhook": 1})
    mergeable: bool = False
    description: str = ""


OPERATORS_ONLY = {"operator": 0, "system": 0}
# Approvals are decided in the review queue, nowhere else: an operator, a webhook or another
# system posting approval.decided would approve a call no reviewer saw (refused, audited).
REVIEW_SOURCE = "review"
REVIEW_ONLY = {REVIEW_SOURCE: 1}
# Operator actions recorded as inbox rows by their own services, in the action's transaction
# and consumed at once with its outcome: never sent through the inbox, never consumed by a run.
RECORDED_ACTIONS = {"edit": "POST /api/tasks/{id}/resume with params", "rollback": "POST /api/tasks/{id}/rollback",
                    "skip_step": "POST /api/tasks/{id}/skip-step"}
CONTROL_TYPES = ("pause", "stop", "terminate", "resume", *RECORDED_ACTIONS)
MAX_STACK_DEPTH = 4  # frames on a task stack (engine/preemption.py)

REGISTRY: dict[str, EventType] = {t.name: t for t in (
    EventType("pause", 0, NoPayload, OPERATORS_ONLY, description="pause at the next resume point"),
    EventType("stop", 0, NoPayload, OPERATORS_ONLY, description="stop: cancel the running step, keep the work done"),
    EventType("terminate", 0, NoPayload, OPERATORS_ONLY, description="force-terminate: nothing left running"),
    EventType("resume", 1, NoPayload, OPERATORS_ONLY, description="continue a paused task from its checkpoint"),
    EventType("edit", 1, EditRecorded, OPERATORS_ONLY,
              description="parameters edited and the task resumed (recorded when applied)"),
    EventType("rollback", 1, RollbackRecorded, OPERATORS_ONLY,
              description="rolled back to a snapshot version and resumed (recorded when applied)"),
    EventType("skip_step", 1, SkipStepRecorded, OPERATORS_ONLY,
              description="a step skipped by an operator, the task continues (recorded when applied)"),
    EventType("preempt", 0, Preempt, OPERATORS_ONLY,
              description="suspend the current work, run an urgent subtask first, then continue"),
    EventType("unit.failed", 2, UnitFailed, {"operator": 2, "system": 2, "webhook": 2, "internal": 2},
              description="a step failed outside the task (upstream degraded, a timeout fired): its retry policy "
                          "applies"),
    EventType("subtask.done", 3, SubtaskDone, {"internal": 3},
              description="an urgent subtask finished and its frame was popped (written by the engine)"),
    EventType("user.message", 1, UserMessage, description="a message to a running agent"),
    EventType("instruction", 1, AnyPayload, description="a task-type specific instruction"),
    EventType("approval.decided", 1, ApprovalDecided, REVIEW_ONLY,
              description="a reviewer's decision on an approval (from the review queue only)"),
    EventType("upstream.ready", 3, UpstreamReady, mergeable=True, description="upstream data is ready"),
    EventType("progress.external", 4, ProgressExternal, mergeable=True, description="progress reported from outside"),
)}


class InboxRefused(HarnessError):
    """An event the inbox does not take; `status` is the HTTP status that says why."""

    def __init__(self, status: int, message: str, *, field: str = "", retry_after: int | None = None,
                 pending: int | None = None):
        super().__init__(message)
        self.status, self.field, self.retry_after, self.pending = status, field, retry_after, pending


@dataclass
class Sent:
    event: InboundEvent
    duplicate: bool = False


def parse_priority(value) -> int | None:
    if value is None or value == "":
        return None
    if isinstance(value, str) and value.upper().startswith("P") and value[1:].isdigit():
        value = int(value[1:])
    elif isinstance(value, str) and value.strip().isdigit():  # a form's select posts "1"
        value = int(value.strip())
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 4:
        raise InboxRefused(422, f"priority must be 0-4 or P0-P4, got {value!r}", field="priority")
    return value


def source_kind(source: str) -> str:
    return source.split(":", 1)[0]


def accepted_types(task_type) -> tuple[str, ...]:
    """The event types a task of `task_type` takes: the controls and the information types,
    plus those its type handles (TaskType.event_types) or its steps wait for
    (TaskType.awaited_event_types)."""
    return (*CONTROL_TYPES, "upstream.ready", "progress.external", "unit.failed",
            *(("preempt",) if task_type.subtasks else ()),
            *getattr(task_type, "event_types", ()), *getattr(task_type, "awaited_event_types", ()))


def digest(payload: dict) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def validate(task: Task, type_name: str, priority, payload, source: str) -> tuple[EventType, int, dict]:
    event_type = REGISTRY.get(type_name)
    task_type = get_type(task.type)
    if event_type is None or type_name not in accepted_types(task_type):
        takes = ", ".join(accepted_types(task_type))
        raise InboxRefused(422, f"task #{task.pk} ({task.type}) does not take {type_name!r} events; it takes: {takes}",
                           field="type")
    asked = parse_priority(priority)
    priority = event_type.default_priority if asked is None else asked
    ceiling = event_type.ceilings.get(source_kind(source))
    if ceiling is None:
        raise InboxRefused(403, f"{source_kind(source)} senders may not send {type_name!r} events", field="source")
    if priority < ceiling:
        raise InboxRefused(422, f"{source_kind(source)} senders may send {type_name!r} at P{ceiling} at most "
                                f"(asked for P{priority})", field="priority")
    if (priority == 2) != (event_type.default_priority == 2):
        raise InboxRefused(422, "P2 (recovery) is the priority of unit.failed, which applies a step's retry policy; "
                                "send P1 to act at the next resume point, or P3 to update state", field="priority")
    if type_name in CONTROL_TYPES and priority != event_type.default_priority:
        raise InboxRefused(422, f"{type_name!r} is always P{event_type.default_priority}", field="priority")
    encoded = json.dumps(payload if payload is not None else {}, separators=(",", ":"))
    if len(encoded.encode()) > MAX_PAYLOAD_BYTES:
        raise InboxRefused(413, f"the payload is {len(encoded.encode())} bytes; at most {MAX_PAYLOAD_BYTES} are "
                                f"taken: send a reference (a URL, a path) instead", field="payload")
    try:
        clean = event_type.payload.model_validate(payload if payload is not None else {}).model_dump(mode="json")
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(["payload", *map(str, first["loc"])])
        raise InboxRefused(422, f"{where}: {first['msg']}", field=where) from None
    if type_name == "preempt":
        if clean["subtask"] not in task_type.subtasks:
            known = "; ".join(f"{name}: {what}" for name, what in task_type.subtasks.items())
            raise InboxRefused(422, f"payload.subtask: {task.type} has no subtask {clean['subtask']!r}; it has: {known}",
                               field="payload.subtask")
        if len(task.stack or []) >= MAX_STACK_DEPTH:
            raise InboxRefused(409, f"task #{task.pk}'s stack is {len(task.stack)} deep (at most {MAX_STACK_DEPTH}): "
                                    f"let a subtask finish first")
    return event_type, priority, clean


def send(*, task_id: int, type: str, payload: dict | None = None, priority=None, source: str = "operator",
         actor=None, ip: str | None = None, source_event_id: str = "", merge_key: str = "",
         occurred_at: datetime | None = None) -> Sent:
    """Put an event in a task's inbox (committed when this returns). Raises InboxRefused."""
    try:
        return _send(task_id=task_id, type=type, payload=payload, priority=priority, source=source, actor=actor,
                     ip=ip, source_event_id=source_event_id, merge_key=merge_key, occurred_at=occurred_at)
    except InboxRefused as exc:
        if type == "approval.decided" and source_kind(source) != REVIEW_SOURCE:
            # A forged approval: recorded (after the refused transaction rolled back).
            task = Task.objects.filter(pk=task_id).first()
            if task is not None:
                audit(action="approval.forged", actor=actor, ip=ip, task=task, reason=str(exc)[:500],
                      after={"source": source[:200], "payload": json.dumps(payload, default=str)[:500]})
            log.warning("forged approval refused", extra={"task_id": task_id})
        raise


def _send(*, task_id: int, type: str, payload: dict | None, priority, source: str, actor, ip: str | None,
          source_event_id: str, merge_key: str, occurred_at: datetime | None) -> Sent:
    source_event_id = (source_event_id or "").strip()[:200]
    with transaction.atomic():
        task = states.lock_task(task_id)
        if task.status in states.TERMINAL:
            raise InboxRefused(409, f"task #{task.pk} is {task.status}: it takes no more events")
        if type in CONTROL_TYPES:
            endpoint = RECORDED_ACTIONS.get(type, f"POST /api/tasks/{{id}}/{type}")
            raise InboxRefused(422, f"{type!r} is an operator control: use {endpoint}", field="type")
        event_type, priority, clean = validate(task, type, priority, payload, source)
        payload_hash = digest(clean)
        if source_event_id:
            first = (InboundEvent.objects.filter(task=task, source=source, source_event_id=source_event_id)
                     .exclude(state=InboundState.SHED).first())
            if first is not None:
                if first.payload_sha256 != payload_hash or first.type != type:
                    raise InboxRefused(409, f"source_event_id {source_event_id!r} was already used by {source} for "
                                            f"event #{first.seq} with another type or payload", field="source_event_id")
                return Sent(first, duplicate=True)
        now = timezone.now()
        shed = _shed_reason(task, priority)
        task.inbox_seq += 1
        fields = dict(task=task, seq=task.inbox_seq, type=type, priority=priority, source=source,
                      actor=actor if getattr(actor, "is_authenticated", False) else None,
                      actor_name=getattr(actor, "username", "") or source, source_event_id=source_event_id,
                      payload=clean, payload_sha256=payload_hash, merge_key=merge_key[:200], occurred_at=occurred_at,
                      visible_at=now)
        stale = _stale(task, type, merge_key, occurred_at) if event_type.mergeable and occurred_at else ""
        if stale:
            # Out of order: a later state of the same thing is known already. Recorded, not applied.
            event = InboundEvent.objects.create(**fields, state=InboundState.REJECTED, outcome=stale)
            task.save(update_fields=["inbox_seq"])
            return Sent(event)
        if shed:
            InboundEvent.objects.create(**fields, state=InboundState.SHED, outcome=shed)
            task.save(update_fields=["inbox_seq"])
            transaction.on_commit(lambda: log.warning("inbox: event shed", extra={"task_id": task_id}))
            raise_later = InboxRefused(429, shed, retry_after=RETRY_AFTER_SECONDS, pending=task.inbox_pending)
        else:
            raise_later = None
            if event_type.mergeable:
                fields["visible_at"] = _merge(task, type, merge_key, now)
            event = InboundEvent.objects.create(**fields)
            if event_type.mergeable:
                superseded = list(InboundEvent.objects.filter(
                    task=task, type=type, merge_key=merge_key[:200], state=InboundState.PENDING,
                    created_at__gte=now - timedelta(seconds=harness.inbox["merge_seconds"]))
                    .exclude(pk=event.pk).values_list("pk", flat=True))
                merged = InboundEvent.objects.filter(pk__in=superseded).update(
                    state=InboundState.MERGED, superseded_by=event, outcome=f"merged into #{event.seq}")
                # The burst collapses into the newest: rows merged earlier point at it too.
                InboundEvent.objects.filter(task=task, state=InboundState.MERGED, superseded_by__in=superseded).update(
                    superseded_by=event, outcome=f"merged into #{event.seq}")
                task.inbox_pending -= merged
            task.inbox_pending += 1
            task.save(update_fields=["inbox_seq", "inbox_pending", "updated_at"])
            append_event(task, "inbox", {"seq": event.seq, "type": type, "priority": priority, "source": source})
            audit(action="task.event", actor=actor, ip=ip, task=task,
                  after={"seq": event.seq, "type": type, "priority": priority, "source": source,
                         "source_event_id": source_event_id})
            if task.status == S.WAITING and any(wait_matches(w, type, clean) for w in task.waiting_for):
                # What a step waits for arrived: the task runs again and the wait takes it.
                states.transition(task, S.QUEUED, reason=f"woken by event #{event.seq} ({type})")
                scheduler.enqueue(task.pk)
            elif task.inbox_pending >= harness.inbox["pause_at"] and task.status in (S.RUNNING, S.QUEUED):
                _pause_for_backlog(task)
    if raise_later is not None:
        raise raise_later
    return Sent(InboundEvent.objects.get(pk=event.pk))


def _shed_reason(task: Task, priority: int) -> str:
    limits = harness.inbox
    pending = task.inbox_pending
    for p, key in ((4, "shed_p4_at"), (3, "shed_p3_at"), (2, "shed_p2_at")):
        if priority >= p and pending >= limits[key]:
            return (f"task #{task.pk} has {pending} pending events (the limit for P{priority} is {limits[key]}): "
                    f"try again in {RETRY_AFTER_SECONDS} s")
    if priority >= 3:
        everywhere = InboundEvent.objects.filter(state=InboundState.PENDING, priority__gte=3).count()
        if everywhere >= limits["shed_all_at"]:
            return (f"{everywhere} P3/P4 events are pending across the installation (the limit is "
                    f"{limits['shed_all_at']}): try again in {RETRY_AFTER_SECONDS} s")
    return ""


def _stale(task: Task, type_name: str, merge_key: str, occurred_at: datetime) -> str:
    """An event whose occurred_at is older than the newest seen in its group is stale."""
    newest = (InboundEvent.objects.filter(task=task, type=type_name, merge_key=merge_key[:200],
                                          occurred_at__isnull=False).exclude(state=InboundState.SHED)
              .order_by("-occurred_at").values_list("occurred_at", flat=True).first())
    if newest is not None and occurred_at < newest:
        return (f"ignored: stale (it occurred at {occurred_at.isoformat()}; an event of its group that occurred at "
                f"{newest.isoformat()} was received already)")
    return ""


def _merge(task: Task, type_name: str, merge_key: str, now: datetime) -> datetime:
    """When a mergeable event becomes visible: ORCH_INBOX_MERGE_SECONDS after it, but no
    later than ORCH_INBOX_MERGE_CAP_SECONDS after the first pending event of its burst."""
    limits = harness.inbox
    first = (InboundEvent.objects.filter(task=task, type=type_name, merge_key=merge_key,
                                         state__in=(InboundState.PENDING, InboundState.MERGED),
                                         created_at__gte=now - timedelta(seconds=limits["merge_cap_seconds"]))
             .order_by("created_at").values_list("created_at", flat=True).first())
    visible = now + timedelta(seconds=limits["merge_seconds"])
    if first is not None:
        visible = min(visible, first + timedelta(seconds=limits["merge_cap_seconds"]))
    return max(visible, now)


def _pause_for_backlog(task: Task) -> None:
    """Too many pending events: the task pauses, its operators are told (needs_human mail)."""
    reason = (f"{task.inbox_pending} events are waiting in its inbox (ORCH_INBOX_PAUSE_AT="
              f"{harness.inbox['pause_at']}): paused until an operator looks")
    if task.status == S.RUNNING and task.lease_owner:
        task.control, task.control_requested_at = "pause", timezone.now()
        states.transition(task, S.PAUSING, reason=reason, control="pause", control_requested_at=timezone.now())
    else:
        states.transition(task, S.PAUSED, reason=reason, control="", lease_owner="",
                          lease_epoch=task.lease_epoch + 1)
    task_id = task.pk
    transaction.on_commit(lambda: notify_needs_human(task_id))


def record_control(task: Task, type_name: str, *, actor=None, source: str = "operator",
                   source_event_id: str = "", payload: dict | None = None) -> Sent:
    """An operator control (pause, stop, terminate, resume; edit, rollback, skip_step with
    what they did as `payload`) as an inbox row, in the caller's transaction with the task
    row locked (engine/services.py, engine/revisions.py). Pending until the runner
    acknowledges it, or settled at once (settle_control): when no runner holds the task, and
    always for the RECORDED_ACTIONS, which are applied by the service that records them."""
    event_type = REGISTRY[type_name]
    source_event_id = (source_event_id or "").strip()[:200]
    payload = event_type.payload.model_validate(payload or {}).model_dump(mode="json")
    payload_hash = digest(payload)
    if source_event_id:
        first = InboundEvent.objects.filter(task=task, source=source, source_event_id=source_event_id).first()
        if first is not None:
            if first.type != type_name:
                raise InboxRefused(409, f"source_event_id {source_event_id!r} was already used by {source} for "
                                        f"event #{first.seq} ({first.type})", field="source_event_id")
            return Sent(first, duplicate=True)
    task.inbox_seq += 1
    task.inbox_pending += 1
    Task.objects.filter(pk=task.pk).update(inbox_seq=task.inbox_seq, inbox_pending=F("inbox_pending") + 1)
    event = InboundEvent.objects.create(
        task=task, seq=task.inbox_seq, type=type_name, priority=event_type.default_priority, source=source,
        actor=actor if getattr(actor, "is_authenticated", False) else None,
        actor_name=getattr(actor, "username", "") or source, source_event_id=source_event_id, payload=payload,
        payload_sha256=payload_hash, visible_at=timezone.now())
    return Sent(event)


def settle_control(task: Task, type_name: str, outcome: str) -> int:
    """Mark the pending control events of `type_name` consumed with `outcome` (in the caller's
    transaction, with the task row locked); returns how many."""
    now = timezone.now()
    count = InboundEvent.objects.filter(task=task, type=type_name, state=InboundState.PENDING).update(
        state=InboundState.CONSUMED, outcome=outcome[:2000], consumed_at=now,
        consumed_in_version=task.checkpoint_version)
    if count:
        Task.objects.filter(pk=task.pk).update(inbox_pending=F("inbox_pending") - count)
        task.inbox_pending -= count
    return count


# --- Task.inbox_pending: written here and nowhere else (tests/engine/test_one_writer.py) ---

def consumed(task: Task, count: int) -> tuple[str, ...]:
    """`count` of `task`'s pending events left the queue in the caller's transaction, which
    locked and read the row (checkpoint.commit_events, checkpoint._settle_wait): the counter,
    lowered on `task`. Returns the columns to save with the caller's own UPDATE of the row
    (no extra round trip)."""
    task.inbox_pending -= count
    return ("inbox_pending",)


def reject_pending(task: Task, to: str, now: datetime) -> None:
    """`task` (locked) ends as `to`: its inbox will never be read again, so each pending event
    says so, and the counter is zero on `task` (saved by the transition, states.transition)."""
    if task.inbox_pending:
        InboundEvent.objects.filter(task=task, state=InboundState.PENDING).update(
            state=InboundState.REJECTED, consumed_at=now,
            outcome=f"not applied: the task ended ({to}) before its next resume point")
        task.inbox_pending = 0


INBOX_ADDER = "inbox#"  # Step.added_by of a step an event added: "inbox#<seq>"


@dataclass
class Applied:
    """What consuming one event did: its outcome (shown with it), the state it ends in, and
    steps it adds to the plan (committed with the consumption)."""

    outcome: str
    add_steps: list = field(default_factory=list)
    state: str = InboundState.CONSUMED
    # Writes of the task type's own (e.g. a message appended to an agent's dialog), each a
    # callable run inside the consumption's transaction, so they commit with it or not at all.
    writes: list = field(default_factory=list)


def due(task_id: int, now: datetime, awaited: tuple[str, ...] = ()) -> list[InboundEvent]:
    """The events a resume point consumes: pending, visible, not controls (those act through
    the control column) nor types the task's steps wait for (the wait takes those), most
    urgent first, in seq order within a priority."""
    return list(InboundEvent.objects.filter(task_id=task_id, state=InboundState.PENDING, visible_at__lte=now)
                .exclude(type__in=(*CONTROL_TYPES, *awaited)).order_by("priority", "seq")[:CONSUMED_PER_RESUME_POINT])


def next_visible(task_id: int, awaited: tuple[str, ...] = ()) -> datetime | None:
    """When the next pending (merging) event becomes visible."""
    return (InboundEvent.objects.filter(task_id=task_id, state=InboundState.PENDING)
            .exclude(type__in=(*CONTROL_TYPES, *awaited))
            .order_by("visible_at").values_list("visible_at", flat=True).first())


def awaited_arrived(task_id: int, event_type: str, now: datetime | None = None,
                    match: dict | None = None) -> InboundEvent | None:
    """The oldest visible pending event of `event_type` (what a waiting step takes); with
    `match`, only one whose payload holds those values (a step takes only its own decision)."""
    events = InboundEvent.objects.filter(task_id=task_id, type=event_type, state=InboundState.PENDING,
                                         visible_at__lte=now or timezone.now())
    for key, value in (match or {}).items():
        events = events.filter(**{f"payload__{key}": value})
    return events.order_by("seq").first()


def wait_matches(wait: dict, type_name: str, payload: dict) -> bool:
    """Whether an event (`type_name`, `payload`) is what `wait` (a Task.waiting_for entry)
    waits for: its type, and the payload values of its `match` (ctx.wait_for(match=...))."""
    return wait.get("type") == type_name and all(
        payload.get(key) == value for key, value in (wait.get("match") or {}).items())


def awaited_visible_at(task_id: int, waits: list[dict]) -> datetime | None:
    """When the first pending event one of `waits` would take becomes visible, if one was sent
    already: a mergeable event is held back for its merge window after it arrives."""
    times = []
    for wait in waits:
        events = InboundEvent.objects.filter(task_id=task_id, type=wait["type"], state=InboundState.PENDING)
        for key, value in (wait.get("match") or {}).items():
            events = events.filter(**{f"payload__{key}": value})
        first = events.order_by("visible_at").values_list("visible_at", flat=True).first()
        if first is not None:
            times.append(first)
    return min(times, default=None)


def preempt_pending(task_id: int) -> bool:
    """A `preempt` waits to be applied (the supervisor then cancels the steps in flight)."""
    return InboundEvent.objects.filter(task_id=task_id, type="preempt", state=InboundState.PENDING).exists()
