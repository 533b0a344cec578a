"""The inbox's event types: each type's payload, default priority, who may send it and at
which priority (EventType, REGISTRY), and the validation of an event against them. What
`inbox.send` refuses, it refuses here (InboxRefused, with the HTTP status that says why)."""
import hashlib
import json
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..models import Task
from ..primitives.errors import HarnessError
from ..tasktypes import get_type
from . import verbs
from .verbs import EditRecorded, RollbackRecorded, SkipStepRecorded  # noqa: F401 (the inbox rows' payloads)

MAX_PAYLOAD_BYTES = 64 * 1024


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


def control_event_types() -> dict[str, "EventType"]:
    """The operator verbs' inbox types (engine/verbs.py: each record names its type and
    priority), including a verb registered after this module was imported."""
    return {v.event_type: EventType(v.event_type, v.priority, v.inbox_payload or NoPayload, OPERATORS_ONLY,
                                    description=v.description) for v in verbs.VERBS.values()}


def control_types() -> tuple[str, ...]:
    return tuple(control_event_types())


def event_type_of(type_name: str) -> "EventType | None":
    return control_event_types().get(type_name) or REGISTRY.get(type_name)


MAX_STACK_DEPTH = 4  # frames on a task stack (engine/preemption.py)

REGISTRY: dict[str, EventType] = {**control_event_types(), **{t.name: t for t in (
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
)}}


class InboxRefused(HarnessError):
    """An event the inbox does not take; `status` is the HTTP status that says why."""

    def __init__(self, status: int, message: str, *, field: str = "", retry_after: int | None = None,
                 pending: int | None = None):
        super().__init__(message)
        self.status, self.field, self.retry_after, self.pending = status, field, retry_after, pending


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
    return (*control_types(), "upstream.ready", "progress.external", "unit.failed",
            *(("preempt",) if task_type.subtasks else ()),
            *getattr(task_type, "event_types", ()), *getattr(task_type, "awaited_event_types", ()))


def digest(payload: dict) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def validate(task: Task, type_name: str, priority, payload, source: str) -> tuple[EventType, int, dict]:
    event_type = event_type_of(type_name)
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
    if type_name in control_types() and priority != event_type.default_priority:
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
