"""What a user may do to a task now: the one answer for every caller.

The services and revisions enforce it (a refused action raises states.InvalidTransition
with the reason), the task page renders its controls from it, the API returns it with a
task (`actions`), and the live `state` message carries it so the page hides and shows its
controls without rules of its own. The actions are the operator verbs (engine/verbs.py):
each verb's record holds its role and its state check.

`user=None` is the system (the CLI, the engine): no role is needed. Any other user needs
the verb's role (operator for every built-in verb).
"""
from dataclasses import asdict, dataclass

from .. import roles
from ..models import Task
from . import states, verbs
from .verbs import LIMIT_USAGE, PAUSABLE, RESUMABLE, limit_has_room, skippable_steps  # noqa: F401 (their home was here)


def __getattr__(name: str):
    """The tables that used to be written out here, now read from the verbs' records (so a
    verb registered later is in them): NAMES (the page's order), TARGETS, VERBS, ROLE_VERBS."""
    if name == "NAMES":
        return verbs.names()
    if name == "TARGETS":
        return {v.name: v.target for v in verbs.VERBS.values()}
    if name == "VERBS":
        return {v.name: v.phrase for v in verbs.VERBS.values()}
    if name == "ROLE_VERBS":
        return {v.name: v.role_phrase for v in verbs.VERBS.values()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def hints() -> dict[str, str]:
    """What each control does, as its button's tooltip says it: true to the engine
    (runner.Runner.decide, executor.Watchdog), never kinder than it."""
    return {name: verb.hint_text() for name, verb in verbs.VERBS.items() if verb.hint}


@dataclass(frozen=True)
class Verdict:
    name: str
    allowed: bool
    reason: str = ""  # why not, for an operator to read (empty when allowed)

    def as_dict(self) -> dict:
        return asdict(self)


def _state_reason(task: Task, verb: verbs.Verb, *, limits: dict | None) -> str:
    """Why the task's state refuses `verb` ("" when it allows it)."""
    if task.status in states.TERMINAL:
        return f"Task #{task.pk} is {task.status}; a finished task cannot {verb.phrase}."
    if verb.name != "terminate" and task.control == "terminate":
        return f"Force-terminate was requested for task #{task.pk}; it cannot {verb.phrase} now."
    return verb.state_check(task, limits)


def check(task: Task, name: str, user=None, *, limits: dict | None = None) -> Verdict:
    """May `user` take action `name` on `task` now? `limits`: those a resume would set."""
    verb = verbs.get(name)
    if verb is None:
        raise ValueError(f"unknown action {name!r}; the actions are {', '.join(verbs.names())}")
    if user is not None and not roles.has_role(user, verb.role):
        return Verdict(name, False, f"Only {verb.role}s can {verb.role_phrase}; ask an administrator to add you "
                                    f"to the '{verb.role}' group.")
    reason = _state_reason(task, verb, limits=limits)
    return Verdict(name, not reason, reason)


def available(task: Task, user=None) -> dict[str, Verdict]:
    """Every action on `task`, allowed or not (with why not), in the page's order."""
    return {name: check(task, name, user) for name in verbs.names()}


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
        raise states.InvalidTransition(task, verbs.VERBS[name].target, verdict.reason)
