"""Rows a step keeps with its checkpoint: `ctx.write_at_commit(model, unique=..., **values)`.

A step's own record of what it did (an agent's tool result in its dialog) need not be a fenced
transaction of its own before the step's checkpoint (BEGIN, the fence's read, the write,
COMMIT): written by the checkpoint, in its transaction — on PostgreSQL as a common table
expression of the one commit statement, fenced on its `t` — it costs no round trip, and a step
that does not commit (it raised, its lease went, the process died) leaves none of it; its next
run writes it again. Each row is an INSERT … ON CONFLICT (unique) DO UPDATE of the values given;
a column not given takes its model default on insert and is left as it is on update.
"""
from dataclasses import dataclass
from functools import lru_cache

from django.db import connection, transaction


@dataclass(frozen=True)
class RowAtCommit:
    model: type
    unique: tuple[str, ...]  # field names of a unique constraint of the model
    values: dict  # field name -> value

    def key(self) -> tuple:
        """The row's unique values (a foreign key given by its `<name>_id` too)."""
        meta = self.model._meta
        return (self.model, self.unique, tuple(self.values.get(name, self.values.get(meta.get_field(name).attname))
                                               for name in self.unique))

    def updated_fields(self) -> list[str]:
        """What an existing row takes of the values: all but its unique ones."""
        unique = {self.model._meta.get_field(name).attname for name in self.unique}
        return [name for name in self.values if self.model._meta.get_field(name).attname not in unique]


def keep(pending: list[RowAtCommit], row: RowAtCommit) -> None:
    """Add `row` to a step's rows; one the step wrote before under the same key is replaced
    (one statement cannot write a row twice)."""
    if not row.unique:
        raise ValueError(f"write_at_commit({row.model.__name__}): name the unique fields that find the row again "
                         f"(unique=...): a step that runs again writes the same row")
    if not row.updated_fields():
        raise ValueError(f"write_at_commit({row.model.__name__}): give a field besides its unique ones "
                         f"({', '.join(row.unique)})")
    pending[:] = [r for r in pending if r.key() != row.key()] + [row]


def write_in_transaction(rows: list[RowAtCommit]) -> list:
    """In the checkpoint's transaction, after its fence held (SQLite, or a PostgreSQL commit of
    more than one statement). Returns the primary key of each row with no `unique` (inserted
    as a new row), None for the others."""
    keys = []
    for row in rows:
        if not row.unique:
            keys.append(row.model.objects.create(**row.values).pk)
            continue
        row.model.objects.bulk_create([row.model(**row.values)], update_conflicts=True, unique_fields=list(row.unique),
                                      update_fields=row.updated_fields())
        keys.append(None)
    return keys


def write_fenced(lease, rows: list[RowAtCommit], *, deleted: tuple = (), probe: tuple[str, dict] | None = None):
    """Rows written (and `deleted`, (model, pk) pairs, removed) if the lease still holds, else
    LeaseLost — outside a step's checkpoint, in autocommit. On PostgreSQL one statement (the
    fence a CTE, as in the commit statement): a fenced transaction of its own costs BEGIN, the
    fence's read, each write and COMMIT, a round trip each. Returns (the primary key of each row
    with no `unique`, None for the others; the value of `probe`, a SQL expression with its named
    parameters, read in the same snapshot as the fence: before the writes)."""
    from .lease import FENCE_ROW_SQL, LeaseLost, hold_fenced

    if connection.vendor != "postgresql":
        with transaction.atomic():
            hold_fenced(lease)
            probed = None
            if probe is not None:
                with connection.cursor() as cursor:
                    cursor.execute(f"SELECT {probe[0]}", probe[1])
                    probed = cursor.fetchone()[0]
            for model, pk in deleted:
                model.objects.filter(pk=pk).delete()
            return write_in_transaction(rows), probed
    ctes, params = sql(rows)
    quote = connection.ops.quote_name
    for index, (model, pk) in enumerate(deleted):
        ctes += (f", rd{index} AS (DELETE FROM {quote(model._meta.db_table)} WHERE id = %(rd{index})s "
                 f"AND EXISTS (SELECT 1 FROM t))")
        params[f"rd{index}"] = pk
    inserted = [f"(SELECT id FROM rc{index})" if not row.unique else "NULL" for index, row in enumerate(rows)]
    probed = [probe[0]] if probe is not None else []
    params.update({"task_id": lease.task_id, "epoch": lease.epoch, "owner": lease.owner, **(probe[1] if probe else {})})
    with connection.cursor() as cursor:
        cursor.execute(f"WITH t AS ({FENCE_ROW_SQL} FOR UPDATE){ctes} "
                       f"SELECT {', '.join(['(SELECT count(*) FROM t)', *inserted, *probed])}", params)
        found = cursor.fetchone()
    if not found[0]:
        raise LeaseLost(f"task {lease.task_id}: lease epoch {lease.epoch} is stale")
    return list(found[1:1 + len(rows)]), (found[-1] if probe is not None else None)


def sql(rows: list[RowAtCommit]) -> tuple[str, dict]:
    """The rows as common table expressions of the PostgreSQL commit statement (after its
    others, hence the leading comma), each fenced on its `t`."""
    parts, params = [], {}
    for index, row in enumerate(rows):
        prefix = f"rc{index}_"
        text, fields = _statement(row.model, tuple(row.values), row.unique, prefix)
        parts.append(f", rc{index} AS ({text})")
        instance = row.model(**row.values)
        params.update({f"{prefix}{i}": field.get_db_prep_save(field.pre_save(instance, True), connection)
                       for i, field in enumerate(fields)})
    return "".join(parts), params


@lru_cache(maxsize=64)
def _statement(model, names: tuple[str, ...], unique: tuple[str, ...], prefix: str) -> tuple[str, list]:
    """The upsert of one row of this shape (built once per shape: the commit statement stays
    one prepared statement) and its fields in parameter order. Each value is cast to its
    column's type: in INSERT ... SELECT the server cannot infer it."""
    meta, quote = model._meta, connection.ops.quote_name
    fields = [f for f in meta.concrete_fields if not f.primary_key]
    given = {meta.get_field(name).attname for name in names} - {meta.get_field(name).attname for name in unique}
    values = ", ".join(f"%({prefix}{i})s::{f.cast_db_type(connection)}" for i, f in enumerate(fields))
    insert = (f"INSERT INTO {quote(meta.db_table)} ({', '.join(quote(f.column) for f in fields)}) "
              f"SELECT {values} WHERE EXISTS (SELECT 1 FROM t)")
    if not unique:  # a new row: its key is returned (write_fenced)
        return f"{insert} RETURNING {quote(meta.pk.column)}", fields
    updates = ", ".join(f"{quote(f.column)} = EXCLUDED.{quote(f.column)}" for f in fields if f.attname in given)
    conflict = ", ".join(quote(meta.get_field(name).column) for name in unique)
    return f"{insert} ON CONFLICT ({conflict}) DO UPDATE SET {updates}", fields
