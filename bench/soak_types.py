"""The soak's own task type (bench/soak.py loads it in the workers with ORCH_EXTRA_TASK_TYPES):
non-idempotent POSTs through the WAL to the soak's HTTP upstream, the effect no shipped demo
type makes. Each step POSTs once; the body and the X-Soak-Ref header carry the request's
reference `t<task>:<step>`, which the upstream records and the soak's reviewer and verdict
look up. With `keyed`, the call sends an Idempotency-Key (the WAL key) and names a status_url,
so it is idempotent (the upstream acts once per key) and the tool's probe can ask.

Steps have a short timeout (StepSpec(timeout=params.step_timeout)): the soak's step_timeout
fault makes the upstream hold its answer past it, and the timeout cuts the POST in flight."""
from pydantic import BaseModel, ConfigDict, Field

from orchestrator.tasktypes import register
from orchestrator.tasktypes.base import StepSpec, TaskType

HTTP_TIMEOUT_SECONDS = 10.0  # the tool's own limit: longer than any hold of the upstream's faults


class PostParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: str = Field(..., description="the upstream's POST endpoint")
    status_url: str = Field("", description="with {key}: where a keyed request is looked up (the probe)")
    requests: int = Field(4, ge=1, le=50)
    keyed: bool = False
    pause: float = Field(0.2, ge=0, le=5, description="seconds before each POST (the task runs long enough to "
                                                        "meet faults)")
    step_timeout: float = Field(3.0, gt=0, le=60, description="seconds each step may run")


def reference(task_id: int, step_id: str) -> str:
    return f"t{task_id}:{step_id}"


@register
class Post(TaskType):
    name = "soak.post"
    title = "Soak: POSTs to an upstream"
    description = "One POST per step through the WAL (non-idempotent unless keyed)."
    Params = PostParams

    def plan(self, params: PostParams) -> list[StepSpec]:
        return [StepSpec(f"post-{i:02d}", f"POST {i}", reads=("url", "status_url", "keyed", "pause"),
                         timeout=params.step_timeout)
                for i in range(1, params.requests + 1)]

    def run_step(self, ctx, step_id: str):
        ctx.sleep(ctx.params.pause)
        ref = reference(ctx.task_id, step_id)
        args = {"method": "POST", "url": ctx.params.url, "json": {"ref": ref}, "headers": {"X-Soak-Ref": ref},
                "timeout": HTTP_TIMEOUT_SECONDS}
        if ctx.params.keyed:
            args.update(idempotency_key=True, status_url=ctx.params.status_url)
        answer = ctx.effect("http.request", args)
        return {"status": answer["status"]}
