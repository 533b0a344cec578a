"""The compatibility gate: a paused task resumed after a deploy never runs silently against
different code (issue 24, item 7; docs/operating.md "Resuming after a deploy").

A task records the fingerprint of the code it runs against (`Task.compat`, tasktypes/
fingerprint.py: the type's declared version, a digest of its plan function, the schemas of its
tools; an agent's prompts, model and MCP tools too). `record` is its one writer: when a run starts
(checkpoint.ensure_plan) and when a resume admits the new code. Every way a paused task
continues (resume, edit & resume, rollback, skip a step) passes `admit` with the task locked:
it compares the recorded fingerprint with the code's now and follows the type's
`on_incompatible_resume`:

- pin: refused (IncompatibleResume, HTTP 409), the differences listed; the task stays paused;
- ask: refused the same way unless the operator accepts the changes (`accept_changes`, after
  the resume preview showed them); the acceptance is audited (`task.accept_changes`);
- migrate: the type's `migrate(params, differences)` gives the params it continues with
  (validated; audited as `task.migrate`); a migrate that raises refuses the resume.

A task with no fingerprint (it never ran, or paused before this gate existed) resumes as before.
A task that continues without an operator (recovered, woken, handed over between slices) meets
the same policy at its run's start (engine/run_gate.py). An agent's MCP tools are in the
fingerprint; a server that cannot be asked is not compared (tasktypes/fingerprint.py).
"""
from dataclasses import dataclass, field

from ..models import Task, TaskStatus as S
from ..tasktypes import UnknownTaskType, get_type
from ..tasktypes.base import RESUME_POLICIES
from ..tasktypes.fingerprint import ABSENT, asking_afresh, carry_unknown, comparable, unknown_servers
from . import states
from .audit import audit
from .events import append_event

SHOWN = 12  # characters of a digest in a difference's text


@dataclass
class Gate:
    """What a resume of the task would meet: the type's policy and what changed."""

    policy: str
    differences: list[dict] = field(default_factory=list)
    recorded: bool = False  # whether the task has a fingerprint to compare
    current: dict = field(default_factory=dict)

    @property
    def compatible(self) -> bool:
        return not self.differences

    @property
    def needs_acceptance(self) -> bool:
        return bool(self.differences) and self.policy == "ask"

    @property
    def refused(self) -> bool:
        return bool(self.differences) and self.policy == "pin"

    def as_dict(self) -> dict:
        return {"policy": self.policy, "compatible": self.compatible, "recorded": self.recorded,
                "needs_acceptance": self.needs_acceptance, "refused": self.refused,
                "differences": self.differences}


class IncompatibleResume(states.InvalidTransition):
    """A resume refused by the gate (HTTP 409): `differences` say what changed, `policy` why."""

    def __init__(self, task: Task, gate: Gate, why: str):
        super().__init__(task, S.QUEUED, why)
        self.policy, self.differences = gate.policy, gate.differences


def policy_of(task_type) -> str:
    policy = getattr(task_type, "on_incompatible_resume", "ask")
    return policy if policy in RESUME_POLICIES else "ask"  # a typo never makes a resume silent


def fingerprint(task: Task, params: dict | None = None, task_type=None) -> dict:
    task_type = task_type or get_type(task.type)
    return task_type.compat_fingerprint(task.params if params is None else params)


def record(task: Task, *, task_type=None, params: dict | None = None) -> bool:
    """Set `task.compat` to the fingerprint of the code running now (the caller saves the row,
    `compat` among its fields); returns whether it changed."""
    found = carry_unknown(task.compat or {}, fingerprint(task, params, task_type))
    if found == task.compat:
        return False
    task.compat = found
    return True


def _short(value) -> str:
    text = str(value)
    return text[:SHOWN] + "…" if len(text) == 64 and all(c in "0123456789abcdef" for c in text) else text


def describe(key: str, before, after) -> str:
    """A difference, for an operator to read."""
    if key.startswith("tool:"):
        name = key[len("tool:"):]
        if before is None:
            return f"tool {name} is now used by the task's code"
        if after is None:
            return f"tool {name} is no longer used by the task's code"
        if after == ABSENT:
            return f"tool {name} is no longer installed"
        if before == ABSENT:
            return f"tool {name} is installed again"
        return f"tool {name}: its argument schema changed ({_short(before)} → {_short(after)})"
    if key == "version":
        return f"the task type's version changed: {before} → {after}"
    if key == "plan":
        return f"the type's plan function changed ({_short(before)} → {_short(after)})"
    if key.startswith("prompt:"):
        return f"the {key[len('prompt:'):]} prompt changed ({_short(before)} → {_short(after)})"
    if key == "model":
        return f"the model changed: {before} → {after}"
    return f"{key} changed: {_short(before)} → {_short(after)}"


def differences(recorded: dict, current: dict) -> list[dict]:
    """What changed between two fingerprints, key by key ({"key", "before", "after", "text"})."""
    found = []
    unknown = unknown_servers(recorded, current)  # MCP servers that could not be asked: not compared
    for key in [*recorded, *(k for k in current if k not in recorded)]:
        if not comparable(key, unknown):
            continue
        before, after = recorded.get(key), current.get(key)
        if before != after:
            found.append({"key": key, "before": before, "after": after, "text": describe(key, before, after)})
    return found


def check(task: Task) -> Gate:
    """What a resume of `task` would meet now (no writes). A type this deploy does not have
    cannot run the task at all: refused as under `pin`, saying so."""
    try:
        task_type = get_type(task.type)
    except UnknownTaskType:
        return Gate(policy="pin", recorded=True, differences=[{
            "key": "type", "before": task.type, "after": None,
            "text": f"the task type {task.type} is not installed here (is its module in ORCH_EXTENSIONS?)"}])
    policy = policy_of(task_type)
    if not task.compat:
        return Gate(policy=policy)
    with asking_afresh():  # an MCP server's tools as the server has them now, not a cached listing
        current = fingerprint(task, task_type=task_type)
    return Gate(policy=policy, differences=differences(task.compat, current), recorded=True, current=current)


def listed(gate: Gate) -> str:
    return "; ".join(d["text"] for d in gate.differences)


def admit(task: Task, *, accept_changes: bool = False, actor=None, ip=None, action: str = "resume",
          params: dict | None = None) -> dict | None:
    """Let the locked, paused `task` continue on the code running now, or refuse
    (IncompatibleResume). Returns the params a migration gives from `params` (the task's by
    default; a rollback's are the snapshot's), None when they stay as they are; records the
    admitted fingerprint on `task` (the caller's transition saves it)."""
    gate = check(task)
    params = task.params if params is None else params
    if gate.compatible:
        return None
    what = listed(gate)
    if any(d["key"] == "type" for d in gate.differences):
        raise IncompatibleResume(task, gate, f"Task #{task.pk} cannot {action} on this deploy: {what}.")
    task_type = get_type(task.type)
    if gate.policy == "pin":
        raise IncompatibleResume(task, gate, (
            f"Task #{task.pk} cannot {action} on this deploy: the code of {task.type} changed since it paused "
            f"({what}), and its type pins the code a task started with (on_incompatible_resume = 'pin'). Run "
            f"it where the old code runs, or start a new task."))
    migrated = None
    if gate.policy == "ask":
        if not accept_changes:
            raise IncompatibleResume(task, gate, (
                f"Task #{task.pk} was paused on other code: {what}. Review the changes (the resume preview "
                f"shows them) and {action} with accept_changes to continue on the code running now."))
        audit(action="task.accept_changes", actor=actor, ip=ip, task=task, reason=what[:2000],
              before={"fingerprint": task.compat},
              after={"fingerprint": gate.current, "differences": gate.differences, "action": action})
        append_event(task, "compat_accepted", {"differences": gate.differences, "action": action})
    else:  # migrate
        try:
            new_params = task_type.migrate(dict(params), [dict(d) for d in gate.differences])
            migrated = task_type.Params.model_validate(new_params).model_dump(mode="json")
        except Exception as exc:  # the type's own code: whatever it raises refuses the resume, said plainly
            raise IncompatibleResume(task, gate, (
                f"Task #{task.pk} cannot {action}: the code of {task.type} changed since it paused ({what}) and "
                f"its migrate() refused the task's params: {type(exc).__name__}: {exc}")) from None
        audit(action="task.migrate", actor=actor, ip=ip, task=task, reason=what[:2000],
              before={"params": params, "fingerprint": task.compat},
              after={"params": migrated, "fingerprint": gate.current, "differences": gate.differences,
                     "action": action})
        append_event(task, "params_migrated", {"differences": gate.differences, "action": action,
                                               "changed": sorted(k for k in set(params) | set(migrated)
                                                                 if params.get(k) != migrated.get(k))})
        if migrated == params:
            migrated = None
    record(task, task_type=task_type, params=migrated)
    return migrated


def overlay(old: dict, migrated: dict, edited: dict) -> dict:
    """An edit made on a task its type migrates: the migrated params, with the keys the
    operator changed (`edited` against `old`) as the operator set them."""
    return {**migrated, **{k: v for k, v in edited.items() if old.get(k) != v}}


def preview(task: Task, params: dict | None = None) -> dict:
    """The gate as a preview shows it (Gate.as_dict), with the params a migration would give
    from `params` (the task's by default) as `migrated_params`."""
    gate = check(task)
    shown = gate.as_dict()
    if gate.differences and gate.policy == "migrate":
        try:
            task_type = get_type(task.type)
            shown["migrated_params"] = task_type.Params.model_validate(task_type.migrate(
                dict(task.params if params is None else params), [dict(d) for d in gate.differences])
            ).model_dump(mode="json")
        except Exception as exc:
            shown["refused"] = True
            shown["migrate_error"] = f"{type(exc).__name__}: {exc}"
    return shown


def for_page(task: Task) -> dict | None:
    """The gate a paused (or needs-human) task's page shows beside its controls; None when the
    code it paused on is the code now (or it has nothing to continue)."""
    from .actions import RESUMABLE

    if task.status not in RESUMABLE or not task.compat:
        return None
    try:
        shown = preview(task)
    except Exception as exc:  # a type's own fingerprint failing: say so rather than break the page
        return {"policy": "ask", "differences": [], "refused": False, "needs_acceptance": False,
                "error": f"{type(exc).__name__}: {exc}"}
    return shown if shown["differences"] else None
