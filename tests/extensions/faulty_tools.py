"""Tools that misbehave on purpose, written only against orchestrator.sdk like any extension
(ORCH_EXTENSIONS=tests.extensions.faulty_tools): bodies that overrun their timeout, ignoring
their token or honouring it, and a task type that makes one call of any of them.

`HOLD` keeps a body running until the test releases it; `SEEN` records what the bodies saw."""
import threading
import time

from pydantic import BaseModel, ConfigDict

from orchestrator.sdk import (IDEMPOTENT, KEYED, READ_ONLY, StepSpec, TaskType, ToolCall, call_tool,
                              register_task_type, tool)

HOLD = threading.Event()  # set: the bodies that wait for it return
SEEN: list[dict] = []  # per call: key, task, step, and when its token was cancelled (monotonic)
TIMEOUT = 0.5


class Note(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: str = "note"
    hang_times: int = 1  # how many calls (by this key) hang before one answers at once


def _hangs(args: Note, call: ToolCall) -> bool:
    seen = {"key": call.key, "task": call.task_id, "step": call.step_id, "deadline": call.deadline,
            "cancelled_at": None}
    SEEN.append(seen)
    call.token.on_cancel(lambda reason: seen.update(cancelled_at=time.monotonic(), reason=reason))
    return sum(1 for s in SEEN if s["key"] == call.key) <= args.hang_times


@tool("faulty_send", timeout=TIMEOUT)  # no effect declared: non_idempotent
def send(args: Note, call: ToolCall) -> dict:
    """Sends a note, ignoring its cancellation token while it hangs."""
    if _hangs(args, call):
        HOLD.wait(30)
    return {"sent": args.text}


@tool("faulty_keyed", effect=KEYED, timeout=TIMEOUT)
def keyed(args: Note, call: ToolCall) -> dict:
    if _hangs(args, call):
        HOLD.wait(30)
    return {"stored": args.text, "key": call.key}


@tool("faulty_polite", effect=IDEMPOTENT, timeout=TIMEOUT)
def polite(args: Note, call: ToolCall) -> dict:
    """Honours its token: gives up (before sending anything) when it is cancelled."""
    if _hangs(args, call):
        while not HOLD.wait(0.01):
            call.raise_if_cancelled()
    return {"stored": args.text}


@tool("faulty_read", effect=READ_ONLY, timeout=TIMEOUT)
def read(args: Note, call: ToolCall) -> dict:
    if _hangs(args, call):
        HOLD.wait(30)
    return {"read": args.text}


@tool("faulty_host_read", effect=READ_ONLY, reaches_host=True)
def host_read(args: Note, call: ToolCall) -> dict:
    """Reads something of the worker's host: an admin's to grant."""
    return {"read": args.text}


class OneCallParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tool: str
    args: dict = {}


@register_task_type
class OneCall(TaskType):
    name = "faulty.one_call"
    Params = OneCallParams
    on_step_failure = "fail"

    def plan(self, params):
        return [StepSpec("call")]

    def run_step(self, ctx, step_id):
        return call_tool(ctx, ctx.params.tool, ctx.params.args)
