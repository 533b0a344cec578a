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
import json
import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.db import transaction
from django.utils import timezone

from ..conf import harness
from ..models import InboundEvent, InboundState, Task, TaskStatus as S
from ..notifications import notify_needs_human
from . import inbox_counter, scheduler, states
from .audit import audit
from .events import append_event
# The event types and their validation have a module of their own; their names stay importable from here.
from .event_types import (MAX_STACK_DEPTH, RECORDED_ACTIONS, REGISTRY, REVIEW_SOURCE,  # noqa: F401
                          EditRecorded, EventType, InboxRefused, RollbackRecorded, SkipStepRecorded, accepted_types,
                          control_event_types, control_types, digest, event_type_of, parse_priority, source_kind,
                          validate)

log = logging.getLogger(__name__)

RETRY_AFTER_SECONDS = 5
CONSUMED_PER_RESUME_POINT = 100


@dataclass
class Sent:
    event: InboundEvent
    duplicate: bool = False


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
        if type in control_types():
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
            event = _enqueue(task, event_type, fields, merge_key=merge_key, now=now, actor=actor, ip=ip)
    if raise_later is not None:
        raise raise_later
    return Sent(InboundEvent.objects.get(pk=event.pk))


def _enqueue(task: Task, event_type, fields: dict, *, merge_key: str, now: datetime, actor, ip: str | None):
    """A pending event, in the sender's transaction: merged with its burst (a mergeable type),
    counted, announced and audited; it wakes a task waiting for it, or pauses a task whose
    inbox is backed up."""
    type, priority, source, clean = fields["type"], fields["priority"], fields["source"], fields["payload"]
    source_event_id = fields["source_event_id"]
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
    else:
        merged = 0
    task.save(update_fields=["inbox_seq", *inbox_counter.added(task, merged=merged), "updated_at"])
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
    return event


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
    event_type = event_type_of(type_name)
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
    inbox_counter.control_added(task)
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
    inbox_counter.settled(task, count)
    return count


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
                .exclude(type__in=(*control_types(), *awaited)).order_by("priority", "seq")[:CONSUMED_PER_RESUME_POINT])


def next_visible(task_id: int, awaited: tuple[str, ...] = ()) -> datetime | None:
    """When the next pending (merging) event becomes visible."""
    return (InboundEvent.objects.filter(task_id=task_id, state=InboundState.PENDING)
            .exclude(type__in=(*control_types(), *awaited))
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
