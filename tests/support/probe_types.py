"""A task type for the probe tests (loaded with ORCH_EXTRA_TASK_TYPES): one side effect,
any tool and arguments, between two plain steps."""
from pydantic import BaseModel, ConfigDict

from orchestrator.tasktypes import register
from orchestrator.tasktypes.base import StepSpec, TaskType


class OneEffectParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tool: str
    args: dict
    on_failure: str = ""


@register
class OneEffect(TaskType):
    name = "test.one_effect"
    Params = OneEffectParams

    def plan(self, params):
        return [StepSpec("prepare"), StepSpec("effect", depends_on=("prepare",), on_failure=params.on_failure),
                StepSpec("finish", depends_on=("effect",))]

    def run_step(self, ctx, step_id):
        if step_id != "effect":
            return {"step": step_id}
        return ctx.effect(ctx.params.tool, ctx.params.args)
