"""What a user may do to a task now: the one answer for every caller.

The services and revisions enforce it (a refused action raises states.InvalidTransition
with the reason), the task page renders its controls from it, the API returns it with a
task (`actions`), and the live `state` message carries it so the page hides and shows its
controls without rules of its own.

`user=None` is the system (the CLI, the engine): no role is needed. Any other user needs
the operator role.
"""
from dataclasses import asdict, dataclass
from decimal import Decimal

from .. import roles
from ..conf import harness
from ..models import Step, StepStatus, Task, TaskStatus as S
from . import states
from ..tasktypes import all_types

# In the order the task page shows them.
NAMES = ("stop", "pause", "resume", "skip_step", "edit", "rollback", "terminate")

# The status an action leads to (for InvalidTransition).
TARGETS = {"pause": S.PAUSED, "stop": S.STOPPED, "terminate": S.TERMINATED, "resume": S.QUEUED,
           "skip_step": S.QUEUED, "edit": S.QUEUED, "rollback": S.QUEUED}

# "a finished task cannot ...", "only a paused task can ..."
VERBS = {"pause": "be paused", "resume": "be resumed", "stop": "be stopped", "terminate": "be force-terminated",
         "skip_step": "have a step skipped", "edit": "have its parameters edited", "rollback": "be rolled back"}
# "only operators can ..."
ROLE_VERBS = {"pause": "pause tasks", "resume": "resume tasks", "stop": "stop tasks",
              "terminate": "force-terminate tasks", "skip_step": "skip a task's steps",
              "edit": "edit a task's parameters", "rollback": "roll tasks back"}


def hints() -> dict[str, str]:
    """What each control does, as its button's tooltip says it: true to the engine
    (runner.Runner.decide, executor.Watchdog), never kinder than it."""
    grace = f"{harness.grace_seconds:g}"
    return {
        "stop": (f"Cancel the running steps now and end the task (terminal). A step still running after {grace} s "
                 f"is force-terminated. A side effect cut in flight (a request sent, an email handed to the "
                 f"server) may or may not have happened: it is not repeated, and it goes to the review queue "
                 f"for someone to record what happened."),
        "terminate": ("Kill the running work at once, without waiting for a safe point (terminal). A side effect "
                      "in flight may or may not have happened: it goes to the review queue."),
    }


RESUMABLE = frozenset({S.PAUSED, S.NEEDS_HUMAN})
PAUSABLE = frozenset({S.QUEUED, S.RUNNING, S.WAITING})
LIMIT_USAGE = {"max_steps": "steps_done", "max_tokens": "tokens_used", "max_seconds": "active_seconds"}


@dataclass(frozen=True)
class Verdict:
    name: str
    allowed: bool
    reason: str = ""  # why not, for an operator to read (empty when allowed)

    def as_dict(self) -> dict:
        return asdict(self)


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


def _state_reason(task: Task, name: str, *, limits: dict | None) -> str:
    """Why the task's state refuses `name` ("" when it allows it)."""
    status, control, pk = task.status, task.control, task.pk
    if status in states.TERMINAL:
        return f"Task #{pk} is {status}; a finished task cannot {VERBS[name]}."
    if name in ("pause", "stop", "resume", "skip_step", "edit", "rollback") and control == "terminate":
        return f"Force-terminate was requested for task #{pk}; it cannot {VERBS[name]} now."
    if name == "pause":
        if status == S.PAUSED:
            return f"Task #{pk} is paused already."
        if control == "pause":
            return f"Task #{pk} is pausing already: it pauses at the next safe point."
        if status not in PAUSABLE:
            return f"Task #{pk} is {status}; only a queued, running or waiting task can {VERBS[name]}."
    elif name == "stop":
        if status == S.STOPPING or control == "stop":
            return f"Task #{pk} is stopping already."
        if not states.can_transition(status, S.STOPPED):
            return f"Task #{pk} is {status}; it cannot {VERBS[name]}."
    elif name == "terminate":
        if control == "terminate":
            return f"Force-terminate was requested for task #{pk} already."
        if not states.can_transition(status, S.TERMINATED):
            return f"Task #{pk} is {status}; it cannot {VERBS[name]}."
    elif name == "resume":
        if status not in RESUMABLE:
            why = " It continues by itself once its review items are decided." if status == S.AWAITING_REVIEW else ""
            return (f"Task #{pk} is {status}; only a paused task or one that needs a human can be resumed.{why}")
        if status == S.PAUSED and not limit_has_room(task, limits):
            limit = task.paused_by_limit
            return f"Task #{pk} paused because {limit} ran out; raise {limit} to resume it."
    elif name == "skip_step":
        if status != S.NEEDS_HUMAN:
            return f"Task #{pk} is {status}; a step can be skipped only while the task needs a human."
        if not skippable_steps(task, limit=1):
            return f"Task #{pk} has no unfinished step to skip."
    elif name in ("edit", "rollback"):
        if status != S.PAUSED:
            return f"Task #{pk} is {status}; only a paused task can {VERBS[name]}: pause it first."
        if task.type not in all_types():
            return f"Task #{pk} has type {task.type!r}, which this server does not know."
    return ""


def check(task: Task, name: str, user=None, *, limits: dict | None = None) -> Verdict:
    """May `user` take action `name` on `task` now? `limits`: those a resume would set."""
    if name not in TARGETS:
        raise ValueError(f"unknown action {name!r}; the actions are {', '.join(NAMES)}")
    if user is not None and not roles.has_role(user, roles.OPERATOR):
        return Verdict(name, False, f"Only operators can {ROLE_VERBS[name]}; ask an administrator to add you "
                                    f"to the 'operator' group.")
    reason = _state_reason(task, name, limits=limits)
    return Verdict(name, not reason, reason)


def available(task: Task, user=None) -> dict[str, Verdict]:
    """Every action on `task`, allowed or not (with why not), in the page's order."""
    return {name: check(task, name, user) for name in NAMES}


def as_list(verdicts: dict[str, Verdict]) -> list[dict]:
    return [v.as_dict() for v in verdicts.values()]


def controls_note(task: Task, verdicts: dict[str, Verdict]) -> str:
    """What the task page says beside its controls: why none applies, or why a task paused
    by a limit has no Resume ("" otherwise)."""
    resume, edit = verdicts.get("resume"), verdicts.get("edit")
    if task.paused_by_limit and resume and edit and not resume.allowed and edit.allowed:
        return resume.reason + " Edit params & resume lets you raise it under Limits."
    if any(v.allowed for v in verdicts.values()):
        return ""
    if task.status in states.TERMINAL:
        return "This task has finished; it cannot be controlled."
    return f"No control applies while the task is {task.status}."


def require(task: Task, name: str, user=None, *, limits: dict | None = None) -> None:
    """Raise states.InvalidTransition with the reason if `name` is refused."""
    verdict = check(task, name, user, limits=limits)
    if not verdict.allowed:
        raise states.InvalidTransition(task, TARGETS[name], verdict.reason)


def skippable_steps(task: Task, limit: int = 500) -> list[tuple[str, str]]:
    """(step_id, status) of the steps an operator could skip: every unfinished one."""
    return list(Step.objects.filter(task_id=task.pk).exclude(status__in=(StepStatus.DONE, StepStatus.SKIPPED))
                .order_by("status", "position").values_list("step_id", "status")[:limit])
