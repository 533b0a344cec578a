"""db.upsert: insert-or-update rows by primary key in one of the harness's tables.

Idempotent: upserting the same rows twice leaves the same table. Transactional: the rows,
the WAL intent, the idempotency record and `done` commit in one transaction, so recovery
always knows whether it happened.
"""
import hashlib
import json
from functools import cache

from django.apps import apps
from django.db import transaction

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

    def _model(self, table: str):
        model = _upsert_models().get(table)
        if model is None:
            raise ToolError(f"db.upsert may not write table {table!r}; allowed: {', '.join(UPSERT_TABLES)}")
        return model

    def validate(self, args: dict) -> None:
        model = self._model(args.get("table", ""))
        columns = args.get("columns") or []
        field_names = {f.attname for f in model._meta.concrete_fields}
        unknown = [c for c in columns if c not in field_names]
        if unknown or model._meta.pk.attname not in columns:
            raise ToolError(f"db.upsert columns must include {model._meta.pk.attname!r} and only {sorted(field_names)}; "
                            f"got {columns}")

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
        columns, pk = args["columns"], model._meta.pk.attname
        objs = [model(**dict(zip(columns, row))) for row in args["rows"]]
        result = {"table": args["table"], "rows": len(objs)}
        # Inside the WAL's transaction (a transactional tool): no savepoint of its own; the
        # WAL records `done` and the key in the same transaction, after these rows.
        with transaction.atomic(savepoint=False):
            if objs:
                model.objects.bulk_create(objs, update_conflicts=True, unique_fields=[pk],
                                          update_fields=[c for c in columns if c != pk], batch_size=500)
            fault_point_for_key("during_effect", key)  # crash tests: rows written, not committed
        return result
