"""Fault injection for the crash tests: named points in the durable protocol.

`ORCH_FAULTS="after_effect:raise,before_checkpoint:kill"` makes `fault_point("after_effect")`
raise InjectedFault and `fault_point("before_checkpoint")` SIGKILL its own process.
An optional `@step_id` narrows a point to one step: `after_effect@send-2:kill`.
Unset in production; reading one environment variable costs nothing on the hot path.
"""
import os
import signal

POINTS = ("before_intent", "after_intent", "during_effect", "after_effect", "before_checkpoint",
          "mid_checkpoint", "after_checkpoint")


class InjectedFault(RuntimeError):
    pass


def _configured() -> dict[str, str]:
    spec = os.environ.get("ORCH_FAULTS", "")
    faults = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        point, _, action = item.partition(":")
        faults[point] = action or "raise"
    return faults


def fault_point(name: str, step_id: str = "") -> None:
    faults = _configured()
    if not faults:
        return
    action = faults.get(f"{name}@{step_id}") or faults.get(name)
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "raise":
        raise InjectedFault(f"injected fault at {name}")
