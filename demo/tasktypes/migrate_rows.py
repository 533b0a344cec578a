"""demo.migrate_rows: the seed's "full data migration".

Fills `demo_source` with `rows` deterministic rows if it holds fewer, then copies them in
batches (one step per batch) into `demo_destination` with amount = source amount × rate,
upserting by id so a re-run batch overwrites. Both writes are idempotent side effects.
"""
from decimal import Decimal

from pydantic import BaseModel, ConfigDict, Field

from orchestrator.sdk import StepSpec, TaskType, register_task_type

from ..models import DemoSource

CENTS = Decimal("0.0001")
SEED_CHUNK = 5000


def source_amount(row_id: int) -> Decimal:
    """The deterministic amount of source row `row_id` (between 1.00 and 1000.99)."""
    return Decimal((row_id * 7919) % 100_000 + 100) / 100


class MigrateRowsParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rows: int = Field(20000, ge=1, le=5_000_000, description="How many source rows to migrate")
    batch_size: int = Field(500, ge=1, le=50_000, description="Rows per batch (one step per batch)")
    rate: float = Field(1.0, ge=0, le=1_000_000, description="Destination amount = source amount × rate")


def batch_ranges(rows: int, batch_size: int) -> list[tuple[int, int]]:
    return [(start, min(start + batch_size - 1, rows)) for start in range(1, rows + 1, batch_size)]


@register_task_type
class MigrateRows(TaskType):
    name = "demo.migrate_rows"
    title = "Migrate rows"
    description = "Copy demo_source into demo_destination in batches, scaling amounts by a rate."
    Params = MigrateRowsParams

    def plan(self, params: MigrateRowsParams) -> list[StepSpec]:
        steps = [StepSpec("prepare-source", f"Ensure {params.rows} source rows", reads=("rows",))]
        width = len(str(len(batch_ranges(params.rows, params.batch_size))))
        for index, (first, last) in enumerate(batch_ranges(params.rows, params.batch_size), start=1):
            steps.append(StepSpec(f"batch-{index:0{max(width, 4)}d}", f"Rows {first}–{last}",
                                  depends_on=("prepare-source",), reads=("rows", "batch_size", "rate")))
        return steps

    def run_step(self, ctx, step_id: str):
        if step_id == "prepare-source":
            return self.prepare_source(ctx)
        return self.copy_batch(ctx, int(step_id.split("-")[1]))

    def prepare_source(self, ctx) -> dict:
        rows = ctx.params.rows
        existing = DemoSource.objects.filter(id__lte=rows).count()
        inserted = 0
        if existing < rows:
            present = set(DemoSource.objects.filter(id__lte=rows).values_list("id", flat=True))
            missing = [i for i in range(1, rows + 1) if i not in present]
            for offset in range(0, len(missing), SEED_CHUNK):
                ctx.token.raise_if_cancelled()
                chunk = missing[offset:offset + SEED_CHUNK]
                ctx.effect("db.upsert", {"table": "demo_source", "columns": ["id", "amount"],
                                         "rows": [[i, str(source_amount(i))] for i in chunk]})
                inserted += len(chunk)
        return {"source_rows": rows, "inserted": inserted}

    def copy_batch(self, ctx, index: int) -> dict:
        rows, batch_size = ctx.params.rows, ctx.params.batch_size
        rate = Decimal(str(ctx.params.rate))
        first, last = batch_ranges(rows, batch_size)[index - 1]
        source = list(DemoSource.objects.filter(id__gte=first, id__lte=last).order_by("id").values_list("id", "amount"))
        if len(source) != last - first + 1:
            raise RuntimeError(f"demo_source holds {len(source)} of rows {first}–{last}; run prepare-source again")
        copied = [[row_id, str((amount * rate).quantize(CENTS))] for row_id, amount in source]
        ctx.effect("db.upsert", {"table": "demo_destination", "columns": ["id", "amount"], "rows": copied})
        return {"first": first, "last": last, "rows": len(copied),
                "sum": str(sum((Decimal(a) for _, a in copied), Decimal(0)))}
