"""Business actions on tasks: the only code that creates or controls tasks. Views, the
API, the CLI and the admin call these; each validates, runs in one transaction, audits,
and enqueues work after commit."""
import logging
from dataclasses import dataclass

from django.db import transaction
from django.utils import timezone
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..conf import harness
from ..models import InboundEvent, Step, StepStatus, Task, TaskStatus as S
from ..tasktypes import get_type
from . import actions, approvals, inbox, recovery, scheduler, states, verbs
from .audit import audit, entry_fields
from . import events
from .checkpoint import plan_from, skip_steps, snapshot_now
from .step_rows import plan_rows
from . import compat
from ..primitives.errors import HarnessError

log = logging.getLogger(__name__)


MAX_TITLE_LENGTH = 200  # the column's length: a longer title is refused, not cut
MAX_STEPS_CEILING = 10_000_000  # far above any real plan; a bigger number is a typo or an attack on the counters


class Limits(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_steps: int | None = Field(None, ge=1, le=MAX_STEPS_CEILING)
    max_tokens: int | None = Field(None, ge=0)
    max_seconds: float | None = Field(None, gt=0)
    max_subtasks: int | None = Field(None, ge=1, le=64)
    # Money, at the model profiles' prices: what the task's model calls may cost (engine/llm_ledger.py).
    max_cost: float | None = Field(None, ge=0, le=1e9)

    @field_validator("*", mode="before")
    @classmethod
    def _not_a_boolean(cls, value):
        # pydantic reads `true` as 1: a limit of "true" steps is a mistake, say so
        if isinstance(value, bool):
            raise ValueError("must be a number, not true/false")
        return value


@dataclass
class FieldError:
    field: str
    message: str


class InvalidInput(HarnessError):
    """Input that cannot be accepted; `errors` name each field and what is wrong."""

    def __init__(self, errors: list[FieldError]):
        self.errors = errors
        super().__init__("; ".join(f"{e.field}: {e.message}" for e in errors))


def _field_errors(exc: ValidationError, prefix: str) -> list[FieldError]:
    return [FieldError(".".join([prefix, *map(str, err["loc"])]), err["msg"]) for err in exc.errors()]


def validate_params(type_name: str, params: dict) -> dict:
    """Params checked against the type's schema, with defaults filled in."""
    try:
        task_type = get_type(type_name)
    except LookupError as exc:
        raise InvalidInput([FieldError("type", str(exc))]) from None
    try:
        return task_type.Params.model_validate(params or {}).model_dump(mode="json")
    except ValidationError as exc:
        raise InvalidInput(_field_errors(exc, "params")) from None


def authorize_params(type_name: str, params: dict, *, actor, before: dict | None = None) -> dict:
    """Refuse params `actor` may not give (InvalidInput, each refusal on its field); returns the
    grants they hold beyond the type's safe defaults, for the audit log."""
    task_type = get_type(type_name)
    problems = task_type.authorize(params, actor=actor, before=before)
    if problems:
        raise InvalidInput([FieldError(field, message) for field, message in problems])
    return {k: v for k, v in task_type.grants(params).items() if v}


def validate_limits(limits: dict | None) -> dict:
    try:
        given = Limits.model_validate(limits or {}).model_dump(exclude_none=True)
    except ValidationError as exc:
        raise InvalidInput(_field_errors(exc, "limits")) from None
    return {**harness.default_limits, **given}


def task_create(*, type: str, params: dict, limits: dict | None = None, title: str = "", actor=None,
                ip: str | None = None) -> Task:
    clean_params = validate_params(type, params)
    clean_limits = validate_limits(limits)
    if len(title) > MAX_TITLE_LENGTH:
        raise InvalidInput([FieldError("title", f"at most {MAX_TITLE_LENGTH} characters (got {len(title)}): "
                                                f"put the details in the params")])
    granted = authorize_params(type, clean_params, actor=actor)
    with transaction.atomic():
        # The status is the model's default (queued); it changes only in states.transition.
        task = Task(type=type, title=title, params=clean_params, limits=clean_limits,
                    created_by=actor if getattr(actor, "is_authenticated", False) else None)
        # Its first seq and its enqueue time go in with the INSERT (no UPDATE of the new row).
        seq = events.reserve_for_new(task)
        scheduler.enqueue_new(task)
        task.save(force_insert=True)
        # Its creation's audit entry written by the event's statement (on PostgreSQL; a statement
        # of its own on SQLite): one round trip fewer for every task created.
        events.create_events(task, seq, [("created", {"type": type, "params": clean_params})],
                             audit=entry_fields(action="task.create", actor=actor, ip=ip, task=task,
                                                after={"type": type, "params": clean_params, "limits": clean_limits}))
        if granted:
            audit(action="task.grant", actor=actor, ip=ip, task=task, reason="granted beyond the safe defaults",
                  after=granted)
    log.info("task created", extra={"task_id": task.pk})
    return task


def _request_control(task_id: int, control: str, *, target: str, actor, ip, reason: str,
                     source_event_id: str = "", reason_needed: str = "") -> Task:
    """Ask the runner of a running task to pause/stop/terminate; settle idle tasks directly.
    Each request is a P0 event of the task's inbox, with its outcome. `reason_needed`: the
    message that refuses a request without a reason (after the state check: a request the
    state refuses says that first; a repeated request stays harmless)."""
    with transaction.atomic():
        task = states.lock_task(task_id)
        if task.control == control or task.status == target:
            if task.status not in states.TERMINAL:
                inbox.record_control(task, control, actor=actor, source_event_id=source_event_id)
                inbox.settle_control(task, control, f"already requested: the task is {task.status}")
            return task  # a repeated request is harmless
        actions.require(task, control, actor)
        if reason_needed and not (reason or "").strip():
            raise InvalidInput([FieldError("reason", reason_needed)])
        if inbox.record_control(task, control, actor=actor, source_event_id=source_event_id).duplicate:
            return task
        if task.status in (S.RUNNING, S.PAUSING, S.STOPPING) and task.lease_owner:
            intermediate = {"pause": S.PAUSING, "stop": S.STOPPING, "terminate": task.status}[control]
            if intermediate != task.status:
                states.transition(task, intermediate, reason=reason or f"{control} requested", actor=actor, ip=ip,
                                  action=f"task.{control}", control=control, control_requested_at=timezone.now())
            else:
                task.control, task.control_requested_at = control, timezone.now()
                task.save(update_fields=["control", "control_requested_at", "updated_at"])
                audit(action=f"task.{control}", actor=actor, ip=ip, task=task, reason=reason,
                      before={"status": task.status}, after={"control": control})
        else:
            # No runner holds it (queued, paused, awaiting review, between slices): settle
            # now, and fence off an executor that may just be starting on a queued task.
            inbox.settle_control(task, control, f"applied at once: no worker held the task ({task.status} → "
                                                f"{target})")
            if target in states.TERMINAL:
                # An effect left pending (a recovered task queued to replay it, say) will never run
                # again on an ended task: what nobody can settle goes to a reviewer, as on a running one.
                recovery.settle_pending_wal(task, dead_worker="", cause=f"{control} of a task no worker held",
                                            extra={"control": control}, ended=True)
            states.transition(task, target, reason=reason or f"{control} by an operator", actor=actor, ip=ip,
                              action=f"task.{control}", control="", lease_owner="",
                              lease_epoch=task.lease_epoch + 1)
    return task


def task_pause(*, task_id: int, actor=None, ip=None, reason: str = "", source_event_id: str = "") -> Task:
    return _request_control(task_id, "pause", target=S.PAUSED, actor=actor, ip=ip, reason=reason,
                            source_event_id=source_event_id)


def task_stop(*, task_id: int, actor=None, ip=None, reason: str = "", source_event_id: str = "") -> Task:
    return _request_control(task_id, "stop", target=S.STOPPED, actor=actor, ip=ip, reason=reason,
                            source_event_id=source_event_id)


def task_terminate(*, task_id: int, actor=None, ip=None, reason: str = "", source_event_id: str = "") -> Task:
    """Force-terminate: the running work is killed without waiting for a safe point, so the
    operator says why (from the page, the API and the CLI alike)."""
    return _request_control(task_id, "terminate", target=S.TERMINATED, actor=actor, ip=ip, reason=(reason or "").strip(),
                            source_event_id=source_event_id,
                            reason_needed="Force-terminate needs a reason: say why the running work is killed without "
                                          "waiting for a safe point (it is recorded in the audit log).")


def task_resume(*, task_id: int, limits: dict | None = None, actor=None, ip=None, reason: str = "",
                source_event_id: str = "", accept_changes: bool = False) -> Task:
    """Continue a paused task from its checkpoint on any worker, optionally with raised
    limits (a task paused by a limit continues once that limit is raised). A P1 event of
    the task's inbox, consumed at once. If the task's code changed since it paused, the
    type's policy decides (engine/compat.py): refused (pin), migrated (migrate), or refused
    unless `accept_changes` (ask); compat.IncompatibleResume lists what changed."""
    with transaction.atomic():
        task = states.lock_task(task_id)
        if task.status in (S.QUEUED, S.RUNNING) and not limits:
            return task  # a repeated request is harmless
        before = {"status": task.status, "limits": task.limits}
        new_limits = task.limits
        if limits:
            actions.require(task, "resume", actor, limits={})  # the state first, whatever the limits
            new_limits = {**task.limits, **validate_limits({**task.limits, **limits})}
        actions.require(task, "resume", actor, limits=new_limits)
        if inbox.record_control(task, "resume", actor=actor, source_event_id=source_event_id).duplicate:
            return task
        # A refused resume rolls back with this transaction: the task stays paused, the 409 says why.
        migrated = compat.admit(task, accept_changes=accept_changes, actor=actor, ip=ip)
        if migrated is not None:
            before["params"] = task.params
            task.params = migrated
            task.checkpoint_version += 1
            snapshot_now(task)
        inbox.settle_control(task, "resume", f"queued from checkpoint v{task.checkpoint_version}"
                                             + (f" with limits {new_limits}" if limits else ""))
        task.limits = new_limits
        states.transition(task, S.QUEUED, reason=reason or "resumed by an operator", actor=actor, ip=ip,
                          action="task.resume", control="", lease_owner="",
                          recovery_attempts=0 if task.status == S.NEEDS_HUMAN else task.recovery_attempts)
        if limits:
            audit(action="task.limits", actor=actor, ip=ip, task=task, before=before, after={"limits": task.limits})
        scheduler.enqueue(task.pk)
    return task


def task_skip_step(*, task_id: int, step_id: str, reason: str, actor=None, ip=None,
                   accept_changes: bool = False) -> list[str]:
    """An operator gives up on one step of a task that needs a human: the step (and the
    dependants it takes with it) is skipped with the operator's reason, and the task goes
    on. Returns the skipped step ids."""
    if not (reason or "").strip():
        raise InvalidInput([FieldError("reason", "a reason is required: say why the task can go on without it")])
    with transaction.atomic():
        task = states.lock_task(task_id)
        actions.require(task, "skip_step", actor)
        step = Step.objects.filter(task=task, step_id=step_id).first()
        if step is None:
            raise InvalidInput([FieldError("step_id", f"task #{task.pk} has no step {step_id!r}")])
        if step.status in (StepStatus.DONE, StepStatus.SKIPPED):
            raise InvalidInput([FieldError("step_id", f"step {step_id} is {step.status} already")])
        # The task continues: the same compatibility gate as a resume (engine/compat.py).
        migrated = compat.admit(task, accept_changes=accept_changes, actor=actor, ip=ip, action="skip a step")
        if migrated is not None:
            task.params = migrated
        plan = plan_from(plan_rows(task))
        plan.status[step_id] = step.status  # the plan view treats a failed step as pending; skip it as it is
        why = f"skipped by {getattr(actor, 'username', '') or 'an operator'}: {reason.strip()[:300]}"
        if step.error:
            why += f" (last error: {step.error.splitlines()[0][:300]})"
        skipped = skip_steps(task, plan, step_id, why, by="operator")
        # A skipped step never takes a decision: its open approvals are closed, not left to a reviewer.
        approvals.revoke(task_id=task.pk, reason=f"step {step_id} was skipped by an operator: {reason.strip()[:300]}",
                         steps=skipped, actor=actor)
        audit(action="task.skip_step", actor=actor, ip=ip, task=task, reason=reason.strip(),
              before={"status": task.status, "step": step_id, "step_status": step.status},
              after={"skipped": skipped})
        states.transition(task, S.QUEUED, reason=f"step {step_id} skipped by an operator; continuing", actor=actor,
                          ip=ip, action="task.resume", control="", lease_owner="", recovery_attempts=0)
        # An operator action like pause or resume: an inbox row with its outcome, committed with it.
        inbox.record_control(task, "skip_step", actor=actor,
                             payload={"step": step_id, "reason": reason.strip()[:2000], "skipped": skipped})
        dependants = [s for s in skipped if s != step_id]
        inbox.settle_control(task, "skip_step", f"applied: skipped {step_id}" + (
            f" and {len(dependants)} dependant{'s' if len(dependants) != 1 else ''} ({', '.join(dependants[:20])})"
            if dependants else "") + "; the task continues")
        scheduler.enqueue(task.pk)
    log.info("step skipped by an operator", extra={"task_id": task_id, "step_id": step_id})
    return skipped


# --- the operator verbs (engine/verbs.py), done the same way by the API, the pages and the CLI ---

def verb_inputs(verb: verbs.Verb, given: dict) -> dict:
    """`given` read as `verb`'s declared inputs: each of its type and length (InvalidInput
    names the field), unknown keys ignored, a missing one empty. Whether a value is needed is
    the service's rule."""
    errors, clean = [], {}
    for spec in verb.inputs:
        value = given.get(spec.name)
        if spec.name not in given:  # not given: the empty value (a required one is refused by the service, saying why)
            clean[spec.name] = False if spec.kind is bool else 0 if spec.kind is int else ""
            continue
        if spec.kind is bool:
            if not isinstance(value, bool):
                errors.append(FieldError(spec.name, "must be true or false"))
                continue
        elif spec.kind is int:
            if isinstance(value, bool) or not isinstance(value, int):
                errors.append(FieldError(spec.name, "must be a whole number"))
                continue
        elif not isinstance(value, str):
            errors.append(FieldError(spec.name, "must be a string"))
            continue
        elif len(value) > spec.max_length:
            errors.append(FieldError(spec.name, f"at most {spec.max_length} characters (got {len(value)})"))
            continue
        clean[spec.name] = value
    if errors:
        raise InvalidInput(errors)
    return clean


def task_verb(*, name: str, task_id: int, inputs: dict | None = None, actor=None, ip=None,
              source_event_id: str = ""):
    """Do operator verb `name` on a task with its declared inputs: the one way the API, the
    pages and the CLI call a verb's service. Returns what the service returns."""
    verb = verbs.get(name)
    if verb is None:
        raise InvalidInput([FieldError("action", f"unknown action {name!r}; the actions are "
                                                 f"{', '.join(verbs.names())}")])
    extra = {"source_event_id": source_event_id} if source_event_id else {}
    return verb.call(task_id=task_id, actor=actor, ip=ip, **verb_inputs(verb, inputs or {}), **extra)


def task_send_control(*, task_id: int, type: str, payload: dict, actor=None, ip=None,
                      source_event_id: str = "") -> inbox.Sent:
    """An operator verb sent as an event into the task's inbox (POST /api/tasks/{id}/events
    with a verb's type): its service does it, with the payload as its inputs (a terminate's
    `reason`, a resume's `accept_changes`), and records its inbox row; the answer is that row
    (`duplicate` when `source_event_id` repeated an earlier one)."""
    verb = verbs.by_event_type(type)
    if verb is None or verb.inbox_payload is not None:  # edit, rollback, skip_step: recorded when applied
        endpoint = inbox.RECORDED_ACTIONS.get(type, f"POST /api/tasks/{{id}}/{verb.word if verb else type}")
        raise inbox.InboxRefused(422, f"{type!r} is an operator control: use {endpoint}", field="type")
    before = Task.objects.values_list("inbox_seq", flat=True).get(pk=task_id)
    task_verb(name=verb.name, task_id=task_id, inputs=payload, actor=actor, ip=ip, source_event_id=source_event_id)
    event = InboundEvent.objects.filter(task_id=task_id, type=type).order_by("-seq").first()
    if event is None:
        status = Task.objects.values_list("status", flat=True).get(pk=task_id)
        raise inbox.InboxRefused(409, f"task #{task_id} is {status}: nothing to {type}")
    return inbox.Sent(event, duplicate=event.seq <= before)
