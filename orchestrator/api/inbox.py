"""/api/tasks/{id}/events: POST sends an event into a task (its inbox), GET reads what the
task told the world (its progress log, resumable by seq); /api/tasks/{id}/inbox lists what
was sent and what the task did with it. The engine's inbox (engine/inbox.py) decides; this
parses. (One router: the two methods of one path.)"""
from datetime import datetime
from typing import Any

from ninja import Field, Path, Query, Router, Schema, Status
from pydantic import field_validator

from .. import roles
from ..engine import inbox, services, webhooks
from ..models import InboundEvent, TaskEvent
from .auth import require
from .common import BODY, FOUND, MAX_ID, client_ip, get_task, id_param, responses
from .schemas import ErrorOut, EventOut

router = Router(tags=["history"])

class EventIn(Schema):
    type: str = Field(..., max_length=100, description="an event type: " + ", ".join(inbox.REGISTRY))
    priority: int | str | None = Field(None, description="0-4 or P0-P4; omitted: the type's default")
    payload: dict[str, Any] = Field(default_factory=dict, description="at most 64 KiB; bigger: send a reference")
    source_event_id: str = Field("", max_length=200, description="your id for it: a repeat is answered, not re-sent")
    merge_key: str = Field("", max_length=200)
    occurred_at: datetime | None = None

    @field_validator("priority", mode="before")  # before pydantic reads `true` as 1
    @classmethod
    def _priority(cls, value):
        try:
            return inbox.parse_priority(value)
        except inbox.InboxRefused as exc:
            raise ValueError(str(exc)) from None


class InboundOut(Schema):
    event_id: int
    seq: int
    type: str
    priority: int
    source: str
    actor: str
    source_event_id: str
    payload: dict
    state: str = Field(..., description="pending, merged, consumed, rejected, shed or expired")
    outcome: str = Field(..., description="what the task did with it, and why")
    superseded_by: int | None
    visible_at: datetime
    created_at: datetime
    consumed_at: datetime | None
    consumed_in_version: int | None
    duplicate: bool = False


def inbound_out(event: InboundEvent, duplicate: bool = False) -> InboundOut:
    return InboundOut(event_id=event.pk, seq=event.seq, type=event.type, priority=event.priority, source=event.source,
                      actor=event.actor_name, source_event_id=event.source_event_id, payload=event.payload,
                      state=event.state, outcome=event.outcome, superseded_by=event.superseded_by_id,
                      visible_at=event.visible_at, created_at=event.created_at, consumed_at=event.consumed_at,
                      consumed_in_version=event.consumed_in_version, duplicate=duplicate)


@router.post("/tasks/{task_id}/events",
             response=responses({202: InboundOut, 200: InboundOut}, FOUND, BODY,
                                {403: ErrorOut, 409: ErrorOut, 429: ErrorOut}))
def send_event(request, body: EventIn, task_id: int = id_param("a task id")):
    """Send an event into a task's inbox: committed before the reply (202). A repeated
    `source_event_id` with the same payload answers the first event (200, `duplicate`);
    with another payload, 409. The operator verbs (pause, stop, terminate, resume, ...) act as
    their own endpoints do, with the payload as their inputs (a terminate's `"reason"`, a
    resume's `"accept_changes": true`). 429 (with Retry-After) when the task's backlog refuses the priority."""
    require(request, roles.OPERATOR)
    get_task(task_id)  # 404 before anything is read
    if body.type in inbox.control_types():  # an operator verb: its service does it (engine/verbs.py)
        sent = services.task_send_control(task_id=task_id, type=body.type, payload=body.payload, actor=request.auth,
                                          ip=client_ip(request), source_event_id=body.source_event_id)
        return Status(200 if sent.duplicate else 202, inbound_out(sent.event, sent.duplicate))
    sent = inbox.send(task_id=task_id, type=body.type, payload=body.payload, priority=body.priority,
                      source="operator", actor=request.auth, ip=client_ip(request),
                      source_event_id=body.source_event_id,
                      merge_key=body.merge_key, occurred_at=body.occurred_at)
    return Status(200 if sent.duplicate else 202, inbound_out(sent.event, sent.duplicate))


@router.get("/tasks/{task_id}/events", response=responses({200: list[EventOut]}, FOUND))
def task_events(request, task_id: int = id_param("a task id"), after: int = Query(0, ge=0, le=MAX_ID),
                limit: int = Query(500, ge=1, le=MAX_ID, description="at most 5000 are returned")):
    """Events with seq > `after`, oldest first (resume from the last seq you saw)."""
    require(request, roles.VIEWER)
    task = get_task(task_id)
    return list(TaskEvent.objects.filter(task=task, seq__gt=after).order_by("seq")[:max(1, min(limit, 5000))])


@router.get("/tasks/{task_id}/inbox", response=responses({200: list[InboundOut]}, FOUND))
def task_inbox(request, task_id: int = id_param("a task id")):
    """Every event sent into the task (the newest 500), newest first, with its state and outcome."""
    require(request, roles.VIEWER)
    task = get_task(task_id)
    return [inbound_out(e) for e in InboundEvent.objects.filter(task=task).order_by("-seq")[:500]]


@router.post("/hooks/{source}/tasks/{task_id}/events", auth=None,
             response=responses({202: InboundOut, 200: InboundOut}, FOUND, BODY,
                                {401: ErrorOut, 403: ErrorOut, 409: ErrorOut, 429: ErrorOut}))
def webhook_event(request, source: str = Path(..., max_length=60), task_id: int = id_param("a task id")):
    """An event from an outside system, signed per Standard Webhooks (`webhook-id`,
    `webhook-timestamp`, `webhook-signature`); the body is `{"type", "payload", "priority"?,
    "merge_key"?}`. The source (admin: Webhook sources) says which types it may send, to which
    task types, and how urgent. A bad signature: 401, audited, nothing created."""
    sent = webhooks.receive(source_name=source, task_id=task_id, body=request.body,
                            headers={k: v for k, v in request.headers.items()}, ip=client_ip(request))
    return Status(200 if sent.duplicate else 202, inbound_out(sent.event, sent.duplicate))
