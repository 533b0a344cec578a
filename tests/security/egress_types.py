"""A task type whose one step makes a policed request through the WAL, as the agent's
`http_request` does (loaded with ORCH_EXTRA_TASK_TYPES by tests/security/test_egress.py)."""
from pydantic import BaseModel, ConfigDict

from orchestrator.tasktypes import register
from orchestrator.tasktypes.base import StepSpec, TaskType


class FetchParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: str
    method: str = "GET"


@register
class PolicedFetch(TaskType):
    name = "test.policed_fetch"
    Params = FetchParams

    def plan(self, params):
        return [StepSpec("fetch")]

    def run_step(self, ctx, step_id):
        return ctx.effect("http.request", {"method": ctx.params.method, "url": ctx.params.url, "egress": "policy"})
