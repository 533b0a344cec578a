"""db.upsert: insert-or-update rows by primary key in one of the harness's tables.

Idempotent: upserting the same rows twice leaves the same table. Transactional: the rows,
the WAL intent, the idempotency record and `done` commit in one transaction, so recovery
always knows whether it happened.
"""
import hashlib
import json
from functools import cache, lru_cache

from django.apps import apps
from django.db import DEFAULT_DB_ALIAS, connection, connections, transaction
from django.utils import timezone

from ..primitives.faults import fault_point_for_key
from .base import Tool, ToolError, register

# Tables a task may write through this tool (an allow-list: the table name comes from args), by
# their names in the database: the demo's are the demo app's models (found by name, not imported).
UPSERT_TABLES = ("demo_source", "demo_destination", "demo_contract_extraction", "agent_memory")


@cache
def _upsert_models() -> dict:
    """The allowed tables' models by table name, read from the apps registry once (it does not
    change after start-up): db.upsert looks one up on every batch of a migration."""
    return {m._meta.db_table: m for m in apps.get_models() if m._meta.db_table in UPSERT_TABLES}


@register
class DbUpsert(Tool):
    name = "db.upsert"
    description = "Insert or update rows by primary key: {table, columns, rows}."
    idempotent = True
    transactional = True
    commits_with_step = True

    def _model(self, table: str):
        model = _upsert_models().get(table)
        if model is None:
            raise ToolError(f"db.upsert may not write table {table!r}; allowed: {', '.join(UPSERT_TABLES)}")
        return model

    def validate(self, args: dict) -> None:
        model = self._model(args.get("table", ""))
        columns = args.get("columns") or []
        field_names = _field_names(model)
        unknown = [c for c in columns if c not in field_names]
        if unknown or model._meta.pk.attname not in columns:
            raise ToolError(f"db.upsert columns must include {model._meta.pk.attname!r} and only {sorted(field_names)}; "
                            f"got {columns}")
        uneven = next((i for i, row in enumerate(args.get("rows") or []) if len(row) != len(columns)), None)
        if uneven is not None:
            raise ToolError(f"db.upsert row {uneven} has {len(args['rows'][uneven])} values for {len(columns)} "
                            f"columns {columns}")

    def wal_args(self, args: dict) -> dict:
        # Rows are recomputed by the step on replay; the WAL keeps a verifiable summary
        # (this keeps a 500-row batch's record at ~200 bytes instead of ~10 KB).
        rows = args.get("rows") or []
        digest = hashlib.sha256(json.dumps(rows, sort_keys=True, default=str).encode()).hexdigest()
        return {"table": args.get("table"), "columns": args.get("columns"), "row_count": len(rows),
                "first_key": rows[0][0] if rows else None, "last_key": rows[-1][0] if rows else None,
                "rows_sha256": digest}

    def perform(self, args: dict, *, key: str, token) -> dict:
        token.raise_if_cancelled()
        model = self._model(args["table"])
        rows = args["rows"]
        # Inside the WAL's transaction (a transactional tool): no savepoint of its own; the
        # WAL records `done` and the key in the same transaction, after these rows.
        with transaction.atomic(savepoint=False):
            if rows:
                upsert(model, args["columns"], rows)
            fault_point_for_key("during_effect", key)  # crash tests: rows written, not committed
        return self.planned_result(args)

    def fits_in_commit(self, args: dict) -> bool:
        # One statement carries every value as a parameter; a big batch goes in place.
        return len(args.get("rows") or ()) * max(1, len(args.get("columns") or ())) <= 5_000

    def planned_result(self, args: dict) -> dict:
        return {"table": args["table"], "rows": len(args["rows"])}

    def commit_sql(self, args: dict, *, fence: str, prefix: str) -> tuple[str, dict]:
        model, rows = self._model(args["table"]), args["rows"]
        db = connections[DEFAULT_DB_ALIAS]  # the connection itself: each read through the proxy is a lookup
        _, _, by_position, filled = _upsert_parts(model, args["columns"], db)
        params = {f"{prefix}{r}_{c}": f.get_db_prep_save(row[i], db) if i is not None else filled[f.attname]
                  for r, row in enumerate(rows) for c, (f, i) in enumerate(by_position)}
        return _commit_sql_text(model, tuple(args["columns"]), len(rows), fence, prefix), params


@lru_cache(maxsize=256)
def _commit_sql_text(model, columns: tuple, row_count: int, fence: str, prefix: str) -> str:
    """The statement of commit_sql for one shape (the same on every step of a chain: built once).
    Each value is cast to its column's type: in INSERT ... SELECT the server cannot infer it."""
    head, conflict, by_position, _ = _upsert_parts(model, list(columns))
    casts = [f.cast_db_type(connection) for f, _ in by_position]
    values = ", ".join("(" + ", ".join(f"%({prefix}{r}_{c})s::{cast}" for c, cast in enumerate(casts)) + ")"
                       for r in range(row_count))
    return f"{head} SELECT * FROM (VALUES {values}) AS v WHERE {fence}{conflict}"


def _upsert_parts(model, columns: list[str], db=None):
    """("INSERT INTO table (every column)", " ON CONFLICT ...", [(field, index in `columns` or
    None)], {attname: the value of a column not given}) for an upsert of `columns`."""
    head, conflict, by_position, not_given = _upsert_shape(model, tuple(columns))
    now, db = timezone.now(), db or connections[DEFAULT_DB_ALIAS]
    filled = {f.attname: f.get_db_prep_save(now if stamped else f.get_default(), db)
              for f, stamped in not_given}
    return head, conflict, by_position, filled


@cache
def _field_names(model) -> frozenset[str]:
    return frozenset(f.attname for f in model._meta.concrete_fields)


@lru_cache(maxsize=256)
def _upsert_shape(model, columns: tuple[str, ...]):
    """What _upsert_parts returns that depends only on the table and the columns given, built once
    per shape (a side-effect step's upsert is the same shape on every step): the statement's head
    and conflict clause, the fields by position, and the fields not given (auto_now ones first
    flagged), whose values are made on every call (a callable default, the time)."""
    meta, quote = model._meta, connection.ops.quote_name
    given = {name: i for i, name in enumerate(columns)}
    not_given = tuple((f, bool(getattr(f, "auto_now", False) or getattr(f, "auto_now_add", False)))
                      for f in meta.concrete_fields if f.attname not in given)
    by_position = [(f, given.get(f.attname)) for f in meta.concrete_fields]
    updated = [c for c in columns if c != meta.pk.attname]
    conflict = (f" ON CONFLICT ({quote(meta.pk.column)}) DO "
                + (f"UPDATE SET {', '.join(f'{quote(meta.get_field(c).column)} = EXCLUDED.{quote(meta.get_field(c).column)}' for c in updated)}"
                   if updated else "NOTHING"))
    head = f"INSERT INTO {quote(meta.db_table)} ({', '.join(quote(f.column) for f, _ in by_position)})"
    return head, conflict, by_position, not_given


def upsert(model, columns: list[str], rows: list[list]) -> None:
    """INSERT ... ON CONFLICT (pk) DO UPDATE of `rows` (values in `columns` order): what
    `bulk_create(update_conflicts=True)` writes — every column, those not given at their model
    default (auto_now ones at now), and on a conflict the given columns — without a model
    instance per row (a side-effect step's upsert cost twice the database's work in Python)."""
    head, conflict, by_position, filled = _upsert_parts(model, columns)
    one = "(" + ", ".join(["%s"] * len(by_position)) + ")"
    batch = max(1, min(500, connection.ops.bulk_batch_size([f for f, _ in by_position], rows)))
    with connection.cursor() as cursor:
        for start in range(0, len(rows), batch):
            chunk = rows[start:start + batch]
            params = [f.get_db_prep_save(row[i], connection) if i is not None else filled[f.attname]
                      for row in chunk for f, i in by_position]
            cursor.execute(head + " VALUES " + ", ".join([one] * len(chunk)) + conflict, params)
