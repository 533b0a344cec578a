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

# The columns a StepSpec sets (and, for a step added at run time, its adder and generation), with
# their SQL types for jsonb_to_recordset; every other column takes its model default (bound once
# per statement, read from the model: one definition).
_FROM_SPEC = (("step_id", "text"), ("position", "integer"), ("title", "text"), ("depends_on", "jsonb"),
              ("declared_reads", "jsonb"), ("on_failure", "text"), ("runs_after_skipped", "boolean"),
              ("before", "jsonb"), ("added_by", "text"), ("generation", "integer"))


def step_row(task: Task, spec, position: int, added_by: str = "", generation: int = 0) -> Step:
    """A new Step row from a StepSpec."""
    return Step(task=task, step_id=spec.id, position=position, title=spec.title or spec.id,
                depends_on=list(spec.depends_on), declared_reads=list(spec.reads), on_failure=spec.on_failure,
                runs_after_skipped=spec.runs_after_skipped, added_by=added_by, generation=generation,
                before=list(spec.before))


def plan_rows(task: Task) -> list[tuple]:
    return list(Step.objects.filter(task=task).order_by("position").values_list(*PLAN_FIELDS))


@cache
def _postgresql_insert() -> tuple[str, dict]:
    """INSERT … SELECT of Step rows from %(step_rows)s (step_rows_json()) for task %(task_id)s, and
    the model defaults of the other columns as named parameters with their values."""
    quote = connection.ops.quote_name
    given = {name for name, _ in _FROM_SPEC}
    defaults = [f for f in Step._meta.concrete_fields if not f.primary_key and f.attname != "task_id"
                and f.attname not in given]
    columns = ["task_id", *(name for name, _ in _FROM_SPEC), *(f.column for f in defaults)]
    selected = ["%(task_id)s", *(f"r.{quote(name)}" for name, _ in _FROM_SPEC),
                *(f"%(sd{i})s::{f.db_type(connection)}" for i, f in enumerate(defaults))]
    record = ", ".join(f"{quote(name)} {kind}" for name, kind in _FROM_SPEC)
    sql = (f"INSERT INTO {Step._meta.db_table} ({', '.join(quote(c) for c in columns)}) "
           f"SELECT {', '.join(selected)} FROM jsonb_to_recordset(%(step_rows)s::jsonb) AS r({record})")
    return sql, {f"sd{i}": f.get_db_prep_save(f.get_default(), connection) for i, f in enumerate(defaults)}


@cache
def added_sql() -> tuple[str, dict]:
    """The Step rows a step adds, as a common table expression of the PostgreSQL commit statement
    (fenced on its `t`; commit_statement.py): the rows one parameter, %(step_rows)s
    (step_rows_json()), and the model defaults of the other columns named parameters, returned
    with their values."""
    insert, defaults = _postgresql_insert()
    return f", added_steps AS ({insert} WHERE EXISTS (SELECT 1 FROM t))", defaults


def step_rows_json(added: list[tuple], first: int) -> str:
    """%(step_rows)s: the (spec, added_by, generation) of each step, from position `first` on."""
    return json.dumps([{"step_id": spec.id, "position": first + i, "title": spec.title or spec.id,
                        "depends_on": list(spec.depends_on), "declared_reads": list(spec.reads),
                        "on_failure": spec.on_failure, "runs_after_skipped": spec.runs_after_skipped,
                        "before": list(spec.before), "added_by": adder, "generation": generation}
                       for i, (spec, adder, generation) in enumerate(added)])


def insert(task: Task, specs) -> None:
    """Insert the Step rows of `specs` (a plan, in order) in the caller's transaction."""
    if not specs:
        return
    if connection.vendor != "postgresql":
        Step.objects.bulk_create([step_row(task, spec, i) for i, spec in enumerate(specs)],
                                 batch_size=2000)
        return
    sql, defaults = _postgresql_insert()
    with connection.cursor() as cursor:
        cursor.execute(sql, {"task_id": task.pk, **defaults,
                             "step_rows": step_rows_json([(spec, "", 0) for spec in specs], 0)})
