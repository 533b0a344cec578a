"""demo.contracts: extract parties, dates and amounts from the shipped sample contracts
(the "batch over 20 contracts" workload), one step per contract plus a summary.

An operator can preempt the batch (a `preempt` event, engine/preemption.py) with the
subtask `reparse`: re-parse one contract first, e.g. with the strict extractor, which
guesses no ambiguous date. It runs before anything else, the batch then continues where it
was, and the summary uses the re-parsed result (the re-parse is put before the summary).

A malformed contract does not sink the batch: the type's failure policy is `skip`, so a
contract step that fails for good is skipped (with its error) and the summary, which runs
after skipped steps, reports which contracts were left out and why."""
from decimal import Decimal

from pydantic import BaseModel, ConfigDict, Field

from orchestrator.sdk import StepSpec, TaskType, register_task_type
from .contract_extraction import EXTRACTORS, SAMPLES_DIR, list_samples, read_contract

STEP_PREFIX = "contract-"
REPARSE_PREFIX = "reparse-"
SUMMARY_STEP = "summary"
TABLE = "demo_contract_extraction"


class ContractsParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    count: int = Field(20, ge=1, le=20, description="How many of the shipped sample contracts to process")
    pace_seconds: float = Field(0.0, ge=0, le=60, description=(
        "Time each contract takes at least (obeying Stop and preemption): to watch a batch live"))


def _step_id(index: int) -> str:
    return f"{STEP_PREFIX}{index:02d}"


@register_task_type
class Contracts(TaskType):
    name = "demo.contracts"
    title = "Extract contract terms"
    description = ("Reads the shipped sample contracts, extracts the parties, dates (ISO) and money amounts "
                   "of each one (one step per contract, run in parallel), upserts them into "
                   "demo_contract_extraction and finishes with a summary of totals per currency.")
    Params = ContractsParams
    on_step_failure = "skip"
    subtasks = {"reparse": 're-parse one contract first: args {"contract": 5, "extractor": "strict"|"default"}'}

    def plan_subtask(self, name: str, args: dict, params: ContractsParams, event_seq: int) -> list[StepSpec]:
        number, extractor = args.get("contract"), args.get("extractor", "strict")
        if not isinstance(number, int) or not 1 <= number <= params.count:
            raise ValueError(f"args.contract must be a contract number from 1 to {params.count}, got {number!r}")
        if extractor not in EXTRACTORS:
            raise ValueError(f"args.extractor must be one of {', '.join(EXTRACTORS)}, got {extractor!r}")
        name = list_samples()[number - 1].name
        return [StepSpec(id=f"{REPARSE_PREFIX}{number:02d}-{extractor}-e{event_seq}",
                         title=f"Re-parse {name} ({extractor})", before=(SUMMARY_STEP,))]

    def frame_references(self, params: ContractsParams) -> dict:
        from django.conf import settings

        return {"resources": [f"contracts directory {settings.ORCH_CONTRACTS_DIR or SAMPLES_DIR}",
                              f"table {TABLE} (rows upserted by contract name: a re-parse replaces its row)"],
                "temp_files": []}

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
        extractor = "default"
        if step_id.startswith(REPARSE_PREFIX):
            number, extractor, _ = step_id[len(REPARSE_PREFIX):].split("-", 2)
            index = int(number)
        elif step_id.startswith(STEP_PREFIX):
            index = int(step_id[len(STEP_PREFIX):])
        else:
            raise ValueError(f"unknown step {step_id!r}")
        samples = list_samples()
        if not 1 <= index <= len(samples):
            raise ValueError(f"step {step_id!r}: there is no sample contract number {index}")
        path = samples[index - 1]
        name = path.name
        if index > ctx.params.count:
            # The plan is fixed at the first run; after `count` was lowered, steps beyond it do nothing.
            return {"contract": name, "skipped": True}
        if ctx.params.pace_seconds:
            ctx.sleep(ctx.params.pace_seconds)  # raises Cancelled at once on Stop or preemption
        ctx.token.raise_if_cancelled()
        found = read_contract(path, extractor)
        ctx.effect("db.upsert", {
            "table": TABLE,
            "columns": ["contract", "parties", "dates", "amounts", "task_id"],
            "rows": [[name, found["parties"], found["dates"], found["amounts"], ctx.task_id]],
        })
        return {"contract": name, **found, **({"extractor": extractor} if extractor != "default" else {})}

    @staticmethod
    def _summary(deps: dict, skipped: dict) -> dict:
        totals: dict[str, Decimal] = {}
        parties: set[str] = set()
        contracts = 0
        # A re-parse replaces its contract's result (deps are in order: re-parses come last).
        latest: dict[str, dict] = {}
        for step_id, result in deps.items():
            if result and not result.get("skipped"):
                latest[result["contract"]] = result
            elif not step_id.startswith(REPARSE_PREFIX):
                latest.setdefault(step_id, result)
        reparsed = {name: r.get("extractor", "default") for name, r in latest.items()
                    if r and r.get("extractor")}
        ambiguous = [{"contract": name, "items": r["ambiguous"]} for name, r in latest.items()
                     if r and r.get("ambiguous")]
        for result in latest.values():
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
            "reparsed": reparsed,
            "ambiguous": ambiguous,
        }
