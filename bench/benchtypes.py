"""Task types used only by the benchmarks."""
from pydantic import BaseModel, ConfigDict, Field

from orchestrator.tasktypes import register
from orchestrator.tasktypes.base import StepSpec, TaskType


class ChainParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    steps: int = Field(200, ge=1)
    effect: bool = False
    at_commit: bool = Field(False, description="with `effect`: the upsert written with the step's checkpoint")
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
                                     "rows": [[10_000_000 + index, "1.0000"]]}, at_commit=ctx.params.at_commit)
        return {"i": index, "sum": index * (index + 1) // 2}


class ListenerParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    steps: int = Field(3000, ge=1)
    sleep_ms: int = Field(20, ge=0, description="work time per step: the gap between resume points")


@register
class Listener(TaskType):
    """A chain of short steps that takes user messages (P1): the event-latency bench's subject
    (P3 `upstream.ready` and P4 `progress.external` every task takes)."""

    name = "bench.listener"
    Params = ListenerParams
    event_types = ("user.message",)

    def handle_event(self, event):
        from orchestrator.engine.inbox import Applied

        return Applied("noted")

    def plan(self, params):
        return [StepSpec(f"s{i:05d}", depends_on=(f"s{i - 1:05d}",) if i else ()) for i in range(params.steps)]

    def run_step(self, ctx, step_id):
        if ctx.params.sleep_ms:
            ctx.sleep(ctx.params.sleep_ms / 1000)
        return int(step_id[1:])
