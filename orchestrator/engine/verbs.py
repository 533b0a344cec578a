"""The operator verbs, declared once: pause, stop, resume, skip a step, edit, roll back,
force-terminate. Each is one `Verb` record — its name, the state it leads to, the role it
needs, the state check, the service that does it, its inbox type and priority, the inputs it
takes — and the API (api/control.py), the task page (presenters/task_page.py and
templates/orchestrator/task/controls/) and the CLI (`manage.py tasks`) iterate these records.
engine/actions.py answers "may this user do it now?" from them.

A new verb is one record plus one service:

    def task_snooze(*, task_id, actor=None, ip=None, reason="", source_event_id=""): ...
    verbs.register(verbs.Verb(name="snooze", label="Snooze", target=TaskStatus.PAUSED,
                              phrase="be snoozed", role_phrase="snooze tasks", service=task_snooze,
                              state_check=lambda task, limits: "" if ... else "why not"))

Business rules (a reason required, a state refused) live in the service and its state
check, never in a caller. The service is given `task_id`, `actor`, `ip`, its declared
inputs and, when sent as an inbox event, `source_event_id`; it records its inbox row
(inbox.record_control) in its own transaction.
"""
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from django.utils.module_loading import import_string
from pydantic import BaseModel, ConfigDict, Field

from .. import roles
from ..conf import harness
from ..models import Step, StepStatus, Task, TaskStatus as S
from ..tasktypes import all_types
from . import states


@dataclass(frozen=True)
class Input:
    """One input a verb takes: an API body field, a page form field, a CLI option."""
    name: str
    help: str
    required: bool = False
    kind: type = str                  # str, int or bool
    max_length: int = 500
    on_page: bool = True               # the generic page form shows a field for it
    placeholder: str = ""
    cli_flag: str = ""                 # default: --name-with-dashes

    @property
    def is_flag(self) -> bool:
        return self.kind is bool

    @property
    def is_number(self) -> bool:
        return self.kind is int

    @property
    def flag(self) -> str:
        return self.cli_flag or "--" + self.name.replace("_", "-")


@dataclass(frozen=True)
class Verb:
    name: str                          # the action's name: API `actions`, the page's data-action, the audit's task.<name>
    label: str                         # the button
    target: str                        # the status it leads to (InvalidTransition names it)
    phrase: str                        # "a finished task cannot <phrase>": "be paused"
    role_phrase: str                   # "only operators can <role_phrase>": "pause tasks"
    service: Callable | str            # the business action (a callable, or its dotted path)
    state_check: Callable[[Task, dict | None], str]  # why the task's state refuses it ("" when allowed)
    role: str = roles.OPERATOR
    inputs: tuple[Input, ...] = ()
    inbox_type: str = ""               # its inbox row's type (default: name)
    priority: int = 1                  # its inbox row's priority
    inbox_payload: type[BaseModel] | None = None  # what its inbox row records (default: nothing)
    description: str = ""              # help text: the API summary, the CLI help, the event type
    path: str = ""                     # URL and CLI word (default: name with dashes): /api/tasks/{id}/<path>
    generic: bool = True               # served by the generic API route, page form and CLI subcommand;
                                       # False: it has its own (a preview, a version: resume, rollback)
    page: str | None = ""              # the page's control template: "" the generic form, None not on the page
    operation_id: str = ""             # the API's operation id (default: <name>_task)
    button: str = ""                   # extra button class: btn-primary, btn-danger
    form_class: str = ""               # extra form class
    hint: str | Callable[[], str] = ""  # the button's tooltip
    confirm: str = ""                  # the page asks before posting ("{id}": the task's id)
    requested: str = ""                # the page's message while the request is pending ("{id}")
    done: str = ""                     # the page's message once the task is at `target` ("{id}")
    report: Callable[[Any, int], str] | None = None  # the CLI's line from the service's result

    @property
    def event_type(self) -> str:
        return self.inbox_type or self.name

    @property
    def word(self) -> str:
        return self.path or self.name.replace("_", "-")

    @property
    def api_operation(self) -> str:
        return self.operation_id or f"{self.name}_task"

    @property
    def template(self) -> str | None:
        if self.page is None:
            return None
        return self.page or "orchestrator/task/controls/_form.html"

    def call(self, **kwargs):
        service = import_string(self.service) if isinstance(self.service, str) else self.service
        return service(**kwargs)

    def hint_text(self) -> str:
        return self.hint() if callable(self.hint) else self.hint

    def input_model(self) -> type[BaseModel]:
        """A pydantic model of its inputs (the API body; the CLI and the page read the same fields)."""
        from pydantic import create_model

        fields = {}
        for spec in self.inputs:
            kind = spec.kind
            extra = {"max_length": spec.max_length} if kind is str else {}
            description = spec.help
            if spec.required and kind is str:
                # Not a `pattern` in the schema: the service decides, and a repeated request (the
                # task already in the verb's state) is answered as done whatever it carries;
                # otherwise a blank value is refused with a 422 that says what to give.
                description += "; not blank (refused with 422 unless the task is already in the verb's state)"
            default = ... if spec.required else (False if kind is bool else 0 if kind is int else "")
            fields[spec.name] = (kind, Field(default, description=description, **extra))
        name = "".join(part.capitalize() for part in self.name.split("_")) + "In"
        return create_model(name, __config__=ConfigDict(extra="ignore"), **fields)


VERBS: dict[str, Verb] = {}


def register(verb: Verb) -> Verb:
    """Add a verb (after those registered before it, in the page's order)."""
    if verb.name in VERBS:
        raise ValueError(f"the verb {verb.name!r} is registered already")
    VERBS[verb.name] = verb
    return verb


def unregister(name: str) -> None:
    VERBS.pop(name, None)


def get(name: str) -> Verb | None:
    return VERBS.get(name)


def by_word(word: str) -> Verb | None:
    return next((v for v in VERBS.values() if v.word == word), None)


def by_event_type(type_name: str) -> Verb | None:
    return next((v for v in VERBS.values() if v.event_type == type_name), None)


def names() -> tuple[str, ...]:
    return tuple(VERBS)


def generic() -> list[Verb]:
    return [v for v in VERBS.values() if v.generic]


# --- the state checks -------------------------------------------------------------------------

RESUMABLE = frozenset({S.PAUSED, S.NEEDS_HUMAN})
PAUSABLE = frozenset({S.QUEUED, S.RUNNING, S.WAITING})
LIMIT_USAGE = {"max_steps": "steps_done", "max_tokens": "tokens_used", "max_seconds": "active_seconds"}


def limit_has_room(task: Task, limits: dict | None = None) -> bool:
    """Whether the limit that paused the task (Task.paused_by_limit) has room again under
    `limits` (the task's own by default)."""
    limit = task.paused_by_limit
    if not limit:
        return True
    value = (task.limits if limits is None else limits).get(limit)
    if value is None:
        return True
    if limit == "max_cost":  # money is summed from the ledger of model calls, not a counter
        from .llm_ledger import cost_used

        return cost_used(task.pk) < Decimal(str(value))
    if limit not in LIMIT_USAGE:
        return True
    return getattr(task, LIMIT_USAGE[limit]) < value


def skippable_steps(task: Task, limit: int = 500) -> list[tuple[str, str]]:
    """(step_id, status) of the steps an operator could skip: every unfinished one."""
    return list(Step.objects.filter(task_id=task.pk).exclude(status__in=(StepStatus.DONE, StepStatus.SKIPPED))
                .order_by("status", "position").values_list("step_id", "status")[:limit])


def _pause_check(task: Task, limits) -> str:
    pk = task.pk
    if task.status == S.PAUSED:
        return f"Task #{pk} is paused already."
    if task.control == "pause":
        return f"Task #{pk} is pausing already: it pauses at the next safe point."
    if task.status not in PAUSABLE:
        return f"Task #{pk} is {task.status}; only a queued, running or waiting task can be paused."
    return ""


def _stop_check(task: Task, limits) -> str:
    if task.status == S.STOPPING or task.control == "stop":
        return f"Task #{task.pk} is stopping already."
    if not states.can_transition(task.status, S.STOPPED):
        return f"Task #{task.pk} is {task.status}; it cannot be stopped."
    return ""


def _terminate_check(task: Task, limits) -> str:
    if task.control == "terminate":
        return f"Force-terminate was requested for task #{task.pk} already."
    if not states.can_transition(task.status, S.TERMINATED):
        return f"Task #{task.pk} is {task.status}; it cannot be force-terminated."
    return ""


def _resume_check(task: Task, limits) -> str:
    pk, status = task.pk, task.status
    if status not in RESUMABLE:
        why = " It continues by itself once its review items are decided." if status == S.AWAITING_REVIEW else ""
        return f"Task #{pk} is {status}; only a paused task or one that needs a human can be resumed.{why}"
    if status == S.PAUSED and not limit_has_room(task, limits):
        limit = task.paused_by_limit
        return f"Task #{pk} paused because {limit} ran out; raise {limit} to resume it."
    return ""


def _skip_step_check(task: Task, limits) -> str:
    if task.status != S.NEEDS_HUMAN:
        return f"Task #{task.pk} is {task.status}; a step can be skipped only while the task needs a human."
    if not skippable_steps(task, limit=1):
        return f"Task #{task.pk} has no unfinished step to skip."
    return ""


def paused_and_known(phrase: str) -> Callable[[Task, dict | None], str]:
    """The check of a verb that revises a paused task (edit, rollback)."""
    def check(task: Task, limits) -> str:
        if task.status != S.PAUSED:
            return f"Task #{task.pk} is {task.status}; only a paused task can {phrase}: pause it first."
        if task.type not in all_types():
            return f"Task #{task.pk} has type {task.type!r}, which this server does not know."
        return ""
    return check


# --- what the operator actions record in the inbox, as applied ------------------------------------

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


# --- the verbs, in the order the task page shows them ----------------------------------------------

def _stop_hint() -> str:
    grace = f"{harness.grace_seconds:g}"
    return (f"Cancel the running steps now and end the task (terminal). A step still running after {grace} s "
            f"is force-terminated. A side effect cut in flight (a request sent, an email handed to the "
            f"server) may or may not have happened: it is not repeated, and it goes to the review queue "
            f"for someone to record what happened.")


TERMINATE_HINT = ("Kill the running work at once, without waiting for a safe point (terminal). A side effect "
                  "in flight may or may not have happened: it goes to the review queue.")

REASON = Input("reason", "why (recorded in the audit log)", on_page=False)
ACCEPT_CHANGES = Input("accept_changes", "continue although the task type's code changed since the task paused "
                                         "(its policy ask); audited", kind=bool)


def _task_status_line(task, task_id: int) -> str:
    return f"task #{task.pk}: {task.status}" + (f" (control: {task.control})" if task.control else "")


register(Verb(
    name="stop", label="Stop", target=S.STOPPED, phrase="be stopped", role_phrase="stop tasks",
    service="orchestrator.engine.services.task_stop", state_check=_stop_check, inputs=(REASON,), priority=0,
    description="stop: cancel the running step, keep the work done", button="btn-primary", hint=_stop_hint,
    requested="Stop requested for task #{id}.", done="Task #{id} stopped.", report=_task_status_line))
register(Verb(
    name="pause", label="Pause", target=S.PAUSED, phrase="be paused", role_phrase="pause tasks",
    service="orchestrator.engine.services.task_pause", state_check=_pause_check, inputs=(REASON,), priority=0,
    description="pause at the next resume point",
    hint="Pause at the next safe point; resume later from the checkpoint",
    requested="Pause requested for task #{id}.", done="Task #{id} paused.", report=_task_status_line))
register(Verb(
    name="resume", label="Resume", target=S.QUEUED, phrase="be resumed", role_phrase="resume tasks",
    service="orchestrator.engine.services.task_resume", state_check=_resume_check, priority=1,
    inputs=(REASON, ACCEPT_CHANGES), description="continue a paused task from its checkpoint",
    generic=False, page="orchestrator/task/controls/_resume.html",
    requested="Task #{id} resumed.", done="Task #{id} resumed.", report=_task_status_line))
register(Verb(
    name="skip_step", label="Skip step", target=S.QUEUED, phrase="have a step skipped",
    role_phrase="skip a task's steps", service="orchestrator.engine.services.task_skip_step",
    state_check=_skip_step_check, priority=1, inbox_payload=SkipStepRecorded, operation_id="skip_step",
    inputs=(Input("step_id", "the step id (see `show`)", required=True, max_length=200, cli_flag="--step"),
            Input("reason", "why the task can go on without it", required=True),
            ACCEPT_CHANGES),
    description="a step skipped by an operator, the task continues (recorded when applied)",
    page="orchestrator/task/controls/_skip_step.html",
    hint="Give up on this step (and the steps that need its result), then continue",
    report=lambda skipped, task_id: f"task #{task_id}: skipped {', '.join(skipped)}; queued"))
register(Verb(
    name="edit", label="Edit params & resume", target=S.QUEUED, phrase="have its parameters edited",
    role_phrase="edit a task's parameters", service="orchestrator.engine.revisions.apply_edit",
    state_check=paused_and_known("have its parameters edited"), priority=1, inbox_payload=EditRecorded,
    description="parameters edited and the task resumed (recorded when applied)", generic=False,
    page="orchestrator/task/controls/_edit.html",
    hint="Change the parameters, see which steps run again, then resume"))
register(Verb(
    name="rollback", label="Roll back", target=S.QUEUED, phrase="be rolled back", role_phrase="roll tasks back",
    service="orchestrator.engine.revisions.apply_rollback", state_check=paused_and_known("be rolled back"),
    priority=1, inbox_payload=RollbackRecorded, generic=False, page=None,
    description="rolled back to a snapshot version and resumed (recorded when applied)"))
register(Verb(
    name="terminate", label="Force-terminate", target=S.TERMINATED, phrase="be force-terminated",
    role_phrase="force-terminate tasks", service="orchestrator.engine.services.task_terminate",
    state_check=_terminate_check, priority=0, description="force-terminate: nothing left running",
    inputs=(Input("reason", "why the work is killed without waiting for a safe point (required)", required=True,
                  placeholder="Reason (required)"),),
    button="btn-danger", form_class="terminate-form", hint=TERMINATE_HINT,
    confirm="Force-terminate task #{id}? Running work is killed without waiting for a safe point.",
    requested="Force-terminate requested for task #{id}.", done="Task #{id} terminated.", report=_task_status_line))
