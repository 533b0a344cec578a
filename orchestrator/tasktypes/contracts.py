"""demo.contracts: extract parties, dates and amounts from the shipped sample contracts
(the "batch over 20 contracts" workload), one step per contract plus a summary.

A malformed contract does not sink the batch: the type's failure policy is `skip`, so a
contract step that fails for good is skipped (with its error) and the summary, which runs
after skipped steps, reports which contracts were left out and why."""
from decimal import Decimal

from pydantic import BaseModel, ConfigDict, Field

from . import register
from .base import StepSpec, TaskType
from .contract_extraction import list_samples, read_contract

STEP_PREFIX = "contract-"
SUMMARY_STEP = "summary"
TABLE = "demo_contract_extraction"


class ContractsParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    count: int = Field(20, ge=1, le=20, description="How many of the shipped sample contracts to process")


def _step_id(index: int) -> str:
    return f"{STEP_PREFIX}{index:02d}"


@register
class Contracts(TaskType):
    name = "demo.contracts"
    title = "Extract contract terms"
    description = ("Reads the shipped sample contracts, extracts the parties, dates (ISO) and money amounts "
                   "of each one (one step per contract, run in parallel), upserts them into "
                   "demo_contract_extraction and finishes with a summary of totals per currency.")
    Params = ContractsParams
    on_step_failure = "skip"

    def plan(self, params: ContractsParams) -> list[StepSpec]:
        samples = list_samples()[:params.count]
        steps = [StepSpec(id=_step_id(i), title=path.name, depends_on=(), reads=("count",))
                 for i, path in enumerate(samples, start=1)]
        steps.append(StepSpec(id=SUMMARY_STEP, title="Summary", depends_on=tuple(s.id for s in steps), reads=(),
                              on_failure="needs_human", runs_after_skipped=True))
        return steps

    def run_step(self, ctx, step_id: str):
        if step_id == SUMMARY_STEP:
            return self._summary(ctx.deps, ctx.skipped)
        if not step_id.startswith(STEP_PREFIX):
            raise ValueError(f"unknown step {step_id!r}")
        index = int(step_id[len(STEP_PREFIX):])
        samples = list_samples()
        if not 1 <= index <= len(samples):
            raise ValueError(f"step {step_id!r}: there is no sample contract number {index}")
        path = samples[index - 1]
        name = path.name
        if index > ctx.params.count:
            # The plan is fixed at the first run; after `count` was lowered, steps beyond it do nothing.
            return {"contract": name, "skipped": True}
        ctx.token.raise_if_cancelled()
        found = read_contract(path)
        ctx.effect("db.upsert", {
            "table": TABLE,
            "columns": ["contract", "parties", "dates", "amounts", "task_id"],
            "rows": [[name, found["parties"], found["dates"], found["amounts"], ctx.task_id]],
        })
        return {"contract": name, **found}

    @staticmethod
    def _summary(deps: dict, skipped: dict) -> dict:
        totals: dict[str, Decimal] = {}
        parties: set[str] = set()
        contracts = 0
        for result in deps.values():
            if not result or result.get("skipped"):
                continue
            contracts += 1
            parties.update(p.casefold() for p in result.get("parties", []))
            for amount in result.get("amounts", []):
                totals[amount["currency"]] = totals.get(amount["currency"], Decimal("0")) + Decimal(amount["value"])
        return {
            "contracts": contracts,
            "distinct_parties": len(parties),
            "totals": {cur: str(total.quantize(Decimal("0.01"))) for cur, total in sorted(totals.items())},
            "skipped": [{"step": step, "error": error.splitlines()[0][:300]} for step, error in sorted(skipped.items())],
        }
