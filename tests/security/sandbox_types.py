"""A task type whose one step runs a command as the agent's `shell_run` does: through the WAL,
`{"argv", "timeout", "sandbox": true}` (loaded with ORCH_EXTRA_TASK_TYPES by
tests/security/test_sandbox.py)."""
from pydantic import BaseModel, ConfigDict

from orchestrator.tasktypes import register
from orchestrator.tasktypes.base import StepSpec, TaskType


class SandboxedParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    argv: list[str]
    timeout: float = 30


@register
class SandboxedShell(TaskType):
    name = "test.sandboxed_shell"
    Params = SandboxedParams

    def plan(self, params):
        return [StepSpec("run")]

    def run_step(self, ctx, step_id):
        return ctx.effect("shell.run", {"argv": ctx.params.argv, "timeout": ctx.params.timeout, "sandbox": True})
