"""Task types used only by the benchmarks."""
from pydantic import BaseModel, ConfigDict, Field

from orchestrator.tasktypes import register
from orchestrator.tasktypes.base import StepSpec, TaskType


class ChainParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    steps: int = Field(200, ge=1)
    effect: bool = False
    sleep_ms: int = Field(0, ge=0, description="work time per step (the live-latency bench spaces commits)")


@register
class Chain(TaskType):
    """A chain of small steps; with `effect`, each step performs one idempotent upsert."""

    name = "bench.chain"
    Params = ChainParams

    def plan(self, params):
        return [StepSpec(f"s{i:05d}", depends_on=(f"s{i - 1:05d}",) if i else (), reads=("steps",))
                for i in range(params.steps)]

    def run_step(self, ctx, step_id):
        index = int(step_id[1:])
        if ctx.params.sleep_ms:
            ctx.sleep(ctx.params.sleep_ms / 1000)
        if ctx.params.effect:
            ctx.effect("db.upsert", {"table": "demo_destination", "columns": ["id", "amount"],
                                     "rows": [[10_000_000 + index, "1.0000"]]})
        return {"i": index, "sum": index * (index + 1) // 2}
