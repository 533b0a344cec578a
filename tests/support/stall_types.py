"""A task type for the stall tests (tests/engine/test_stalls.py): `steps` short steps, of which
the ones named in `hang` run until the test releases them (HANG[step_id].set()). Loaded with
the `task_types` marker; the test drives it inline, in its own process."""
import threading
from collections import defaultdict

from pydantic import BaseModel, ConfigDict, Field

from orchestrator.sdk import StepSpec, TaskType, register_task_type

HANG: "defaultdict[str, threading.Event]" = defaultdict(threading.Event)
RELEASE_ALL = threading.Event()  # a test's teardown: no step hangs any more


class StallableParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    steps: int = Field(8, ge=1, le=50)
    hang: list[str] = []


@register_task_type
class Stallable(TaskType):
    name = "test.stallable"
    Params = StallableParams

    def plan(self, params):
        return [StepSpec(f"step-{i:02d}", depends_on=(f"step-{i - 1:02d}",) if i > 1 else ())
                for i in range(1, params.steps + 1)]

    def run_step(self, ctx, step_id):
        if step_id in ctx.params.hang:
            while not (HANG[step_id].is_set() or RELEASE_ALL.is_set()):  # a hung call, as the harness sees it: no progress
                ctx.sleep(0.05)
        else:
            ctx.sleep(0.02)
        return {"step": step_id}
