"""A task type whose step leaves a process tree running (loaded with ORCH_EXTRA_TASK_TYPES):
the subject of tests/engine/test_no_strays.py."""
from pydantic import BaseModel, ConfigDict

from orchestrator.tasktypes import register
from orchestrator.tasktypes.base import StepSpec, TaskType

# A child, a grandchild shell and its child: four processes, none of which ends by itself.
TREE = "sleep 300 & sh -c 'sleep 300 & wait' & wait"
MARK_VARIABLE = "ORCH_TEST_STRAY_MARK"


class StraysParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mark: str


@register
class Strays(TaskType):
    name = "test.strays"
    Params = StraysParams

    def plan(self, params):
        return [StepSpec("spawn")]

    def run_step(self, ctx, step_id):
        # The mark is in the environment, which every descendant inherits.
        ctx.run_subprocess(["sh", "-c", TREE], env={MARK_VARIABLE: ctx.params.mark})
        return {}
