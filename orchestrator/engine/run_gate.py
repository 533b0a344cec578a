"""The compatibility gate at a run's start (issue 24, item 7): a task that continues without an
operator — recovered after its worker died, woken by an event or its timer, handed to the next
worker between time slices — meets the same gate as an operator's resume (engine/compat.py).

An operator's resume admits the code running now (compat.admit) and records its fingerprint, so
the run it starts finds nothing changed. Any other run that finds the recorded fingerprint
different from the code's now (a deploy happened while the task waited, or while it was being
recovered) follows the type's `on_incompatible_resume` before a step runs:

- pin: the task becomes `needs_human`, the differences in its reason (and on its page beside
  Resume, which stays refused): run it where the old code runs, or stop it;
- ask: `needs_human` too, until an operator who saw the differences resumes it with
  `accept_changes` (audited `task.accept_changes`, as for a paused task);
- migrate: the type's `migrate()` gives the params it continues with (audited `task.migrate`,
  a new snapshot version), and the run goes on; a migrate that raises holds it as under ask.

`needs_human` tells the task's operators (notifications: `task.needs_human`). Nothing runs and
nothing is lost: pending WAL entries, the inbox and the task's waits are kept for the resume.
"""
import logging
from dataclasses import dataclass

from django.db import transaction

from ..models import TaskStatus as S
from . import compat, states
from .checkpoint import snapshot_now
from .events import append_event
from .lease import Lease, lock_fenced

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunGate:
    held: str = ""  # the status the task was put in (needs_human), "" when the run goes on
    params: dict | None = None  # migrated params the run continues with (None: unchanged)


def how_it_continues(task) -> str:
    if task.recovering_since is not None:
        return "recovered after its worker stopped"
    if task.waiting_for:
        return "woken from its wait"
    return "continuing on a worker"


def at_run_start(*, lease: Lease, task, task_type) -> RunGate:
    """Before a run loads its plan: the gate. `task` is the row the run read at its start: the
    common case (nothing changed) costs no query; otherwise the task is locked, the lease
    checked (LeaseLost like the rest of the run's start) and the gate asked again."""
    if not task.compat or compat.check(task).compatible:
        return RunGate()  # never ran (or ran before the gate existed: ensure_plan records it), or unchanged
    with transaction.atomic():
        task = lock_fenced(lease)
        gate = compat.check(task)
        if gate.compatible:
            return RunGate()
        what, how = compat.listed(gate), how_it_continues(task)
        why = ""
        if gate.policy == "pin":
            why = (f"{task.type} changed since this task last ran ({what}); its type pins the code a task started "
                   f"with (on_incompatible_resume = 'pin'), so it was not {how} on this deploy: run it where the "
                   f"old code runs, or stop it")
        elif gate.policy == "ask":
            why = (f"{task.type} changed since this task last ran ({what}); it was not {how} on the new code "
                   f"unasked: review the changes and resume it with accept_changes to continue")
        else:
            try:
                migrated = compat.admit(task, action=f"continue ({how})")
            except compat.IncompatibleResume as refused:
                why = f"not {how}: {refused}"
            else:
                fields = ["compat"]
                if migrated is not None:
                    task.params = migrated
                    task.checkpoint_version += 1
                    fields += ["params", "checkpoint_version"]
                task.save(update_fields=[*fields, "updated_at"])
                if migrated is not None:
                    snapshot_now(task)
                log.info("compatibility gate: migrated at the run's start", extra={
                    "task_id": task.pk, "differences": [d["key"] for d in gate.differences]})
                return RunGate(params=migrated)
        append_event(task, "compat_held", {"policy": gate.policy, "differences": gate.differences, "how": how})
        states.transition(task, S.NEEDS_HUMAN, reason=why, action="compat.held", lease_owner="", control="",
                          activities=[])
    log.warning("compatibility gate: the task waits for an operator", extra={
        "task_id": task.pk, "policy": gate.policy, "differences": [d["key"] for d in gate.differences]})
    return RunGate(held=S.NEEDS_HUMAN)
