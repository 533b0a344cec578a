"""Task types for the compatibility gate's tests (tests/engine/test_compatibility.py): the same
two-step type under each resume policy, each step calling the read tool `compat_lookup` (so its
argument schema is part of the types' fingerprint). Loaded with the `task_types` marker."""
from pydantic import BaseModel, ConfigDict, Field

from orchestrator.sdk import READ_ONLY, StepSpec, TaskType, ToolCall, call_tool, register_task_type, tool


class LookupArgs(BaseModel):
    query: str = Field(..., max_length=200)


@tool("compat_lookup", effect=READ_ONLY, description="Look a word up (tests of the compatibility gate).")
def compat_lookup(args: LookupArgs, call: ToolCall):
    return {"found": args.query.upper()}


class CompatParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    label: str = "original"
    steps: int = Field(3, ge=1, le=20)


MIGRATIONS: list[tuple[dict, list[dict]]] = []  # (params, differences) of every migrate() call


class CompatBase(TaskType):
    Params = CompatParams
    uses_tools = ("compat_lookup",)

    def plan(self, params):
        return [StepSpec(f"step-{i}", depends_on=(f"step-{i - 1}",) if i > 1 else (), reads=("label",))
                for i in range(1, params.steps + 1)]

    def run_step(self, ctx, step_id):
        return {"label": ctx.params.label, **call_tool(ctx, "compat_lookup", {"query": step_id})}


@register_task_type
class CompatPin(CompatBase):
    name = "test.compat_pin"
    on_incompatible_resume = "pin"


@register_task_type
class CompatMigrate(CompatBase):
    name = "test.compat_migrate"
    on_incompatible_resume = "migrate"

    def migrate(self, params, differences):
        MIGRATIONS.append((dict(params), list(differences)))
        if params.get("label") == "refuse":
            raise ValueError("a label of 'refuse' cannot be carried over")
        return {**params, "label": "migrated"}


@register_task_type
class CompatAsk(CompatBase):
    name = "test.compat_ask"  # on_incompatible_resume: the default, "ask"
