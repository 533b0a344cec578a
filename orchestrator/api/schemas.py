"""The API's input and output schemas (they are the OpenAPI schema's components)."""
from datetime import datetime
from typing import Any

from ninja import Field, Schema

from ..engine import verbs
from ..tasktypes import all_types
from review.models import Decision


class FieldErrorOut(Schema):
    field: str
    message: str


class ErrorOut(Schema):
    detail: str
    errors: list[FieldErrorOut] = []


class TaskTypeOut(Schema):
    name: str
    title: str
    description: str
    params_schema: dict


def _enum(values):
    """Enumerate `values()` in the OpenAPI schema (read when the schema is built); the
    services still validate the value, with a message naming the valid ones."""
    return lambda schema: schema.update(enum=sorted(values()))


def task_type_names():
    return list(all_types())


class TaskCreateIn(Schema):
    type: str = Field(..., description="a task type (GET /api/task-types)", json_schema_extra=_enum(task_type_names))
    params: dict[str, Any] = {}
    limits: dict[str, Any] | None = None
    title: str = ""


class WorkerOut(Schema):
    host: str
    pid: int | None


class StepOut(Schema):
    id: str
    title: str
    status: str
    depends_on: list[str]
    reads: list[str]
    attempts: int
    started_at: datetime | None
    finished_at: datetime | None
    duration_seconds: float | None
    error: str
    result: Any = Field(None, description="null when the result is stored apart (see result_stored_apart)")
    added_by: str = Field("", description="the step that added this one while it ran (empty: the type's plan)")
    result_stored_apart: bool = Field(False, description="the result is large: GET "
                                      "/api/tasks/{id}/steps/{step_id}/result returns it")
    result_bytes: int = 0


class StepResultOut(Schema):
    step_id: str
    status: str
    result_bytes: int = Field(..., description="its size as JSON when stored apart, else 0")
    result: Any


class WaitingOnOut(Schema):
    kind: str = Field(..., description="approval, review (a side effect in doubt), event, dependency (an upstream "
                                       "data set the task waits for, or a step's subtasks), timer, tool (a tool, a "
                                       "subprocess, a request the running step makes), llm (a model stream), step, "
                                       "lease (running), control (pausing or stopping), recovery, queue, budget (a "
                                       "limit paused it), paused (an operator), needs_human")
    text: str = Field(..., description="what the task waits on, for people")
    since: datetime | None = Field(None, description="since when")
    link: str = Field("", description="the page of the item waited on (an approval, a review), or empty")
    link_text: str = ""
    deadline: datetime | None = Field(None, description="when the wait ends by itself (an approval's deadline, "
                                                        "a timer), or null")
    stalled: bool = Field(False, description="running with no step finished for ORCH_STALL_FACTOR × the p95 of its "
                                             "type's step durations")


class TaskSummaryOut(Schema):
    id: int
    type: str
    title: str
    status: str
    status_reason: str
    steps_done: int
    steps_total: int
    progress_percent: int
    created_at: datetime
    updated_at: datetime
    waiting_on: WaitingOnOut | None = Field(None, description="what the task waits on now (null when finished)")


class ActionOut(Schema):
    # The operator verbs (engine/verbs.py), read when the schema is made: a verb registered
    # later is in the enum too.
    name: str = Field(..., description="an action on the task (an operator verb)",
                      json_schema_extra=lambda schema: schema.update(enum=list(verbs.names())))
    allowed: bool = Field(..., description="whether you may take it now")
    reason: str = Field(..., description="why not (empty when allowed)")


class ReviewWaitOut(Schema):
    kind: str = Field(..., description="approval, or effect (a side effect whose outcome is unknown)")
    count: int = Field(..., description="how many items of this kind are open")
    since: datetime = Field(..., description="when the oldest of them was opened")
    waiting_seconds: float = Field(..., description="how long the oldest has waited, now")


class TaskOut(TaskSummaryOut):
    params: dict
    limits: dict
    counters: dict
    checkpoint_version: int
    event_seq: int
    heartbeat_at: datetime | None
    worker: WorkerOut | None
    error: str
    started_at: datetime | None
    finished_at: datetime | None
    control: str
    control_requested_at: datetime | None
    control_acknowledged_at: datetime | None
    activities: list[dict]
    paused_by_limit: str = Field(..., description="the limit that paused the task (raise it to resume), or empty")
    actions: list[ActionOut] = Field(..., description="what the caller may do to the task now, and why not")
    stack: list[dict] = Field(..., description="the task stack, bottom first: a frame per urgent subtask (a preempt "
                                              "event) that suspended the work below it")
    waiting_for: list[dict] = Field(..., description="while waiting: the steps waiting for an event, and until when")
    unreviewed_effects: int = Field(0, description="side effects whose outcome is unknown that no reviewer has "
                                                   "decided yet (whatever the task's status)")
    review_waits: list[ReviewWaitOut] = Field(default_factory=list, description="the task's open review items per "
                                              "kind (approvals first): how many, and how long the oldest has waited")
    steps: list[StepOut]


class TaskPageOut(Schema):
    items: list[TaskSummaryOut]
    next_before: int | None


class WalOut(Schema):
    id: int
    step_id: str
    call_index: int
    tool: str
    args: Any
    idempotency_key: str
    idempotent: bool
    status: str
    result: Any
    error: str
    lease_epoch: int
    worker: str
    created_at: datetime
    completed_at: datetime | None


class SnapshotOut(Schema):
    version: int
    step_id: str
    state: dict
    created_at: datetime


class EventOut(Schema):
    seq: int
    kind: str
    payload: dict
    created_at: datetime


class AuditOut(Schema):
    id: int
    at: datetime
    actor: str
    ip: str | None
    action: str
    before: Any
    after: Any
    reason: str


class ControlIn(Schema):
    reason: str = ""


class ResumeIn(ControlIn):
    params: dict[str, Any] | None = Field(None, description=(
        "Parameters to change before resuming, merged over the task's current params: a key not "
        "given keeps its value."))
    limits: dict[str, Any] | None = None
    dry_run: bool = False
    expected_version: int | None = None
    repeat_effects: list[str] | None = Field(None, description=(
        "Idempotency keys of the non-idempotent side effects the edit performs again (the "
        "preview's `must_confirm`), each confirmed explicitly; without them the edit is refused (409)."))
    accept_changes: bool = Field(False, description=(
        "Continue although the task type's code changed since the task paused (its policy `ask`: the "
        "preview's `compatibility.differences`); without it such a resume is refused (409). Audited."))


class PreviewOut(Schema):
    task_id: int
    version: int
    param_diff: dict
    kept: list[str]
    rerun: list[str]
    removed: list[str]
    pending: list[str]
    repeated_effects: list[dict]
    must_confirm: list[str]
    effects_after: list[dict]
    rollback_to: int | None
    compatibility: dict = Field(default_factory=dict, description=(
        "the compatibility gate (a resume after a deploy): `policy` (pin, migrate, ask), `differences` "
        "[{key, before, after, text}] between the code the task paused on and the code now, "
        "`needs_acceptance` (send accept_changes), `refused` (pin), `migrated_params` (migrate)"))


class RevisionOut(Schema):
    applied: bool
    preview: PreviewOut | None
    task: TaskOut


class RollbackIn(Schema):
    version: int
    dry_run: bool = False
    expected_version: int | None = None
    repeat_effects: list[str] | None = Field(None, description=(
        "Idempotency keys of the non-idempotent side effects the rollback performs again (the "
        "preview's `must_confirm`); without them the rollback is refused (409)."))
    accept_changes: bool = Field(False, description=(
        "Continue although the task type's code changed since the task paused (its policy `ask`: the "
        "preview's `compatibility.differences`); without it such a resume is refused (409). Audited."))


class ApprovalVoteOut(Schema):
    reviewer: str
    decision: str
    arguments_sha256: str
    at: datetime


class ApprovalOut(Schema):
    """An approval's state beyond its decision (review/approvals.py)."""
    arguments: Any = Field(None, description="the arguments an approval runs with now (a first reviewer's edit, "
                                             "under two-person approval)")
    arguments_sha256: str = Field(..., description="their SHA-256: send it back as `arguments_sha256` to decide")
    expires_at: datetime | None = Field(None, description="the deadline (open items)")
    on_expiry: str = Field("", description="reject, keep_waiting or escalate")
    escalate_to: str = ""
    expired_at: datetime | None = None
    escalated_at: datetime | None = None
    approvals_required: int = 1
    approvals: list[ApprovalVoteOut] = Field(default_factory=list, description="two-person approval: the votes so far")


class ReviewOut(Schema):
    id: int
    kind: str = Field(..., description="effect (a side effect in doubt, with its WAL entry) or approval (a tool "
                                       "call waiting to be approved: `proposal`)")
    task_id: int
    task_type: str
    task_status: str
    status: str
    reason: str
    dead_worker: str
    detected_at: datetime
    step_id: str
    tool: str
    args: Any
    idempotency_key: str
    intent_written_at: datetime | None
    wal_status: str
    proposal: Any = Field(None, description="approval: {tool, arguments, call_id, context}")
    evidence: Any
    decision: str
    decision_result: Any
    note: str
    decided_by: str | None
    decided_at: datetime | None
    approval: ApprovalOut | None = Field(None, description="approvals: the deadline, its fallback, the reviewers")


class DecideIn(Schema):
    decision: str = Field(..., json_schema_extra=_enum(lambda: Decision.values),
                          description="; ".join(f"`{v}`: {label}" for v, label in Decision.choices))
    note: str = ""
    result: Any = None
    arguments_sha256: str = Field("", max_length=64, description="approval: the SHA-256 of the arguments you were "
                                                                 "shown (the item's `approval.arguments_sha256`); 409 "
                                                                 "if they changed since")
