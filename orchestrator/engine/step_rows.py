"""A plan's Step rows: made from StepSpecs, inserted, read back in plan order.

A first run inserts its whole plan in the transaction that starts it. On PostgreSQL the rows go
in as one statement with one parameter (the specs as JSON, expanded by jsonb_to_recordset):
building a model instance per row and binding some twenty values each cost more than the
database's work for a short task, and a 10,000-step plan sent 200,000 bound values."""
import json
from functools import cache

from django.db import connection

from ..models import Step, Task

PLAN_FIELDS = ("step_id", "depends_on", "status", "attempts", "failure_fingerprint", "generation", "on_failure",
               "runs_after_skipped", "added_by", "position")

# The columns a StepSpec sets, with their SQL types for jsonb_to_recordset; every other column
# takes its model default (bound once per statement, read from the model: one definition).
_FROM_SPEC = (("step_id", "text"), ("position", "integer"), ("title", "text"), ("depends_on", "jsonb"),
              ("declared_reads", "jsonb"), ("on_failure", "text"), ("runs_after_skipped", "boolean"),
              ("before", "jsonb"))


def step_row(task: Task, spec, position: int, added_by: str = "", generation: int = 0) -> Step:
    """A new Step row from a StepSpec."""
    return Step(task=task, step_id=spec.id, position=position, title=spec.title or spec.id,
                depends_on=list(spec.depends_on), declared_reads=list(spec.reads), on_failure=spec.on_failure,
                runs_after_skipped=spec.runs_after_skipped, added_by=added_by, generation=generation,
                before=list(spec.before))


def plan_rows(task: Task) -> list[tuple]:
    return list(Step.objects.filter(task=task).order_by("position").values_list(*PLAN_FIELDS))


@cache
def _postgresql_insert() -> tuple[str, tuple]:
    given = {name for name, _ in _FROM_SPEC}
    defaults = [f for f in Step._meta.concrete_fields if not f.primary_key and f.attname != "task_id"
                and f.attname not in given]
    columns = ["task_id", *(name for name, _ in _FROM_SPEC), *(f.column for f in defaults)]
    selected = ["%s", *(f"r.{connection.ops.quote_name(name)}" for name, _ in _FROM_SPEC),
                *(f"%s::{f.db_type(connection)}" for f in defaults)]
    record = ", ".join(f"{connection.ops.quote_name(name)} {kind}" for name, kind in _FROM_SPEC)
    sql = (f"INSERT INTO {Step._meta.db_table} ({', '.join(connection.ops.quote_name(c) for c in columns)}) "
           f"SELECT {', '.join(selected)} FROM jsonb_to_recordset(%s::jsonb) AS r({record})")
    return sql, tuple(defaults)


def insert(task: Task, specs) -> None:
    """Insert the Step rows of `specs` (a plan, in order) in the caller's transaction."""
    if not specs:
        return
    if connection.vendor != "postgresql":
        Step.objects.bulk_create([step_row(task, spec, i) for i, spec in enumerate(specs)],
                                 batch_size=2000)
        return
    sql, defaults = _postgresql_insert()
    rows = json.dumps([{"step_id": spec.id, "position": i, "title": spec.title or spec.id,
                        "depends_on": list(spec.depends_on), "declared_reads": list(spec.reads),
                        "on_failure": spec.on_failure, "runs_after_skipped": spec.runs_after_skipped,
                        "before": list(spec.before)} for i, spec in enumerate(specs)])
    with connection.cursor() as cursor:
        cursor.execute(sql, [task.pk, *(f.get_db_prep_save(f.get_default(), connection) for f in defaults), rows])
