"""Fault injection for the crash tests: named points in the durable protocol.

`ORCH_FAULTS="after_effect:raise,before_checkpoint:kill"` makes `fault_point("after_effect")`
raise InjectedFault and `fault_point("before_checkpoint")` SIGKILL its own process.
An optional `@step_id` narrows a point to one step: `after_effect@send-2:kill`.
`kill-once` / `raise-once` fire in the first process that reaches the point only (a marker
file under ORCH_VAR_DIR/faults records it), so a recovered task can go on.
Unset in production; reading one environment variable costs nothing on the hot path.
"""
import os
import signal

POINTS = ("before_intent", "after_intent", "during_effect", "after_effect", "before_checkpoint",
          "mid_checkpoint", "after_checkpoint")


class InjectedFault(RuntimeError):
    pass


def armed() -> dict[str, str]:
    """The fault points ORCH_FAULTS arms, with their actions (empty in production)."""
    spec = os.environ.get("ORCH_FAULTS", "")
    faults = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        point, _, action = item.partition(":")
        faults[point] = action or "raise"
    return faults


def fault_point_for_key(name: str, idempotency_key: str) -> None:
    """A fault point inside a tool, which knows the step only through its key."""
    parts = idempotency_key.split(":")
    fault_point(name, parts[1].split("@")[0] if len(parts) == 3 else "")


def fault_point(name: str, step_id: str = "", *, faults: dict[str, str] | None = None) -> None:
    """`faults`: what armed() returned to a caller passing several points in a row (the step
    commit passes three: one read of the environment per step instead of four)."""
    if faults is None:
        faults = armed()
    if not faults:
        return
    point = f"{name}@{step_id}" if f"{name}@{step_id}" in faults else name
    action = faults.get(point)
    if action and action.endswith("-once"):
        if not _first_time(point):
            return
        action = action[:-len("-once")]
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "raise":
        raise InjectedFault(f"injected fault at {name}")


def _first_time(point: str) -> bool:
    from django.conf import settings

    directory = os.path.join(settings.VAR_DIR, "faults")
    os.makedirs(directory, exist_ok=True)
    try:
        os.close(os.open(os.path.join(directory, point.replace("/", "_")), os.O_CREAT | os.O_EXCL))
        return True
    except FileExistsError:
        return False
