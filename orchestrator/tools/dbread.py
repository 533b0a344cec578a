"""db_query's reader: the model's SELECT reads only the tables in ORCH_AGENT_DB_TABLES.

The model's SQL is untrusted (a prompt-injected document can write it), and it runs on the
harness's own connection, which can read password hashes, sessions, API tokens and webhook
secrets. Three layers, each enough on its own for the tables:

1. A gate before the database sees anything: one statement, a SELECT (or WITH ... SELECT).
   On PostgreSQL, PostgreSQL's own parser (pglast) also lists every table and function the
   statement names: only allowed tables, only ordinary functions. The function allow-list is
   what stops `set_config('role', ...)`, which would undo `SET ROLE` from inside the query,
   and `query_to_xml('...')`, which runs SQL from a string.
2. The database's own refusal. PostgreSQL: a read-only transaction, `SET LOCAL ROLE` to a
   NOLOGIN role granted SELECT on the allowed tables only (`manage.py agent_db_role`), a
   statement timeout. SQLite: `PRAGMA query_only` and an authorizer callback that allows
   reading the allowed tables and calling ordinary functions, and denies everything else
   (other tables, sqlite_master, ATTACH, PRAGMA, load_extension, every write).
3. Afterwards the connection is as it was: the savepoint or transaction is rolled back
   (so SET LOCAL and READ ONLY end with it), the authorizer is removed.

The deny list always wins over the setting: a harness table named in ORCH_AGENT_DB_TABLES
is refused at start-up (system check orchestrator.E020) and at query time.
"""
import base64
import datetime
import decimal
import fnmatch
import math
import sqlite3
import time
import uuid
from functools import lru_cache

import sqlparse
from django.apps import apps
from django.conf import settings
from django.db import DatabaseError, connection, transaction

from .base import ToolError

QUERY_TIMEOUT_SECONDS = 5
ROLE_COMMAND = "manage.py agent_db_role"

# Names never readable, whatever ORCH_AGENT_DB_TABLES says. With the apps registry below:
# tables that are not models (django_migrations, the full-text tables of a migration) and
# the databases' own catalogs are covered by their prefixes.
DENIED_PATTERNS = ("auth_*", "django_*", "axes_*", "review_*", "orchestrator_*", "agent_memory",
                   "sqlite_*", "pg_*", "information_schema*")

# Ordinary functions the model may call (names as the database sees them, lower case).
# Anything else is refused: an allow-list, because the dangerous ones are many and vary by
# version and extension (set_config, query_to_xml, pg_read_file, lo_import, dblink_*,
# load_extension, readfile, fts3_tokenizer, ...). Left out too: functions that build a
# huge value from a small call (repeat, lpad, printf('%.*c', ...), randomblob).
COMMON_FUNCTIONS = {
    "count", "sum", "avg", "min", "max", "abs", "round", "lower", "upper", "length", "substr", "substring",
    "trim", "ltrim", "rtrim", "replace", "coalesce", "nullif", "row_number", "rank", "dense_rank", "ntile",
    "lag", "lead", "first_value", "last_value", "nth_value", "percent_rank", "cume_dist", "sign", "ceil",
    "ceiling", "floor", "mod", "power", "sqrt", "exp", "ln", "log", "string_agg",
}
POSTGRES_FUNCTIONS = COMMON_FUNCTIONS | {
    "bool_and", "bool_or", "every", "array_agg", "json_agg", "jsonb_agg", "json_object_agg", "jsonb_object_agg",
    "stddev", "stddev_pop", "stddev_samp", "variance", "var_pop", "var_samp", "percentile_cont",
    "percentile_disc", "mode", "trunc", "div", "char_length", "character_length", "octet_length", "btrim",
    "concat", "concat_ws", "left", "right", "position", "strpos", "split_part", "initcap",
    "reverse", "starts_with", "to_char", "to_date", "to_timestamp", "to_number", "date_trunc",
    "date_part", "extract", "age", "now", "make_date", "make_timestamp", "make_interval", "justify_days",
    "timezone", "json_array_elements", "jsonb_array_elements", "json_array_elements_text",
    "jsonb_array_elements_text", "json_array_length", "jsonb_array_length", "json_each", "jsonb_each",
    "json_each_text", "jsonb_each_text", "json_extract_path", "jsonb_extract_path", "json_extract_path_text",
    "jsonb_extract_path_text", "json_typeof", "jsonb_typeof", "json_build_object", "jsonb_build_object",
    "json_build_array", "jsonb_build_array", "to_json", "to_jsonb", "json_object_keys", "jsonb_object_keys",
    "array_length", "unnest", "cardinality", "array_to_string", "generate_series",
}
SQLITE_FUNCTIONS = COMMON_FUNCTIONS | {
    "total", "group_concat", "ifnull", "iif", "instr", "date", "time", "datetime",
    "julianday", "strftime", "unixepoch", "typeof", "like", "glob", "json", "json_extract", "json_array_length",
    "json_type", "json_valid", "json_object", "json_array", "json_group_array", "json_group_object", "->",
    "->>", "trunc",
}
# PostgreSQL node types refused outright: XML parsing (entity loading), and writes hidden in
# a CTE (the read-only transaction refuses them too; this says so before the database).
POSTGRES_REFUSED_NODES = {
    "XmlExpr": "XML functions", "XmlSerialize": "XML functions", "RangeTableFunc": "XMLTABLE",
    "InsertStmt": "INSERT", "UpdateStmt": "UPDATE", "DeleteStmt": "DELETE", "MergeStmt": "MERGE",
    "IntoClause": "SELECT ... INTO", "LockingClause": "FOR UPDATE/SHARE",
}


# --- which tables ---------------------------------------------------------------------

@lru_cache(maxsize=1)
def harness_tables() -> frozenset[str]:
    """Every table of every installed app's models, except the demo workloads' tables.

    Derived from the apps registry, so a new model (of the orchestrator, review, django-q2,
    axes, Django's own apps) is denied without editing a list."""
    tables = set()
    for model in apps.get_models(include_auto_created=True):
        table = model._meta.db_table.lower()
        if model._meta.app_label == "demo":  # the demo workloads' data (demo/models.py)
            continue
        tables.add(table)
    return frozenset(tables)


def is_denied(table: str) -> bool:
    table = table.lower()
    return table in harness_tables() or any(fnmatch.fnmatchcase(table, p) for p in DENIED_PATTERNS)


def denied_in_setting() -> list[str]:
    """Tables named in ORCH_AGENT_DB_TABLES that are on the deny list (a configuration error)."""
    return [t for t in settings.ORCH_AGENT_DB_TABLES if is_denied(t)]


def allowed_tables() -> list[str]:
    """ORCH_AGENT_DB_TABLES less the deny list, lower case, in order."""
    return [t.lower() for t in settings.ORCH_AGENT_DB_TABLES if not is_denied(t)]


def _refusal(table: str, allowed: list[str]) -> ToolError:
    listed = ", ".join(allowed) or "none (ORCH_AGENT_DB_TABLES is empty)"
    why = "never readable: a table of the harness or a catalog" if is_denied(table) else "not in ORCH_AGENT_DB_TABLES"
    return ToolError(f"db_query may not read {table!r} ({why}); the tables it may read: {listed}")


# --- the query ------------------------------------------------------------------------

def read_only_query(sql: str, *, max_rows: int = 100) -> dict:
    """Run the model's SELECT with only the allowed tables readable.

    Returns {"columns", "rows" (JSON-safe values), "truncated"}; raises ToolError, with a
    message the model can act on, when the query is refused or fails."""
    statement = _one_select(sql)
    allowed = allowed_tables()
    if connection.vendor == "postgresql":
        _postgres_gate(statement, allowed)
        return _execute_postgres(statement, allowed, max_rows)
    if connection.vendor == "sqlite":
        return _execute_sqlite(statement, allowed, max_rows)
    raise ToolError(f"db_query supports PostgreSQL and SQLite, not {connection.vendor}")


def _one_select(sql: str) -> str:
    """The light gate: one statement, starting with SELECT or WITH. (The databases decide
    the rest: sqlite3 refuses a second statement itself, PostgreSQL's parser counts them.)"""
    statements = [s for s in sqlparse.parse(sql or "") if str(s).strip(" \t\r\n;")]
    if len(statements) != 1:
        raise ToolError("db_query runs exactly one SELECT statement (no ';' between statements)")
    first = statements[0].token_first(skip_ws=True, skip_cm=True)
    if first is None or first.normalized.upper() not in ("SELECT", "WITH"):
        raise ToolError("db_query only reads: the statement must start with SELECT or WITH")
    return str(statements[0]).strip().rstrip(";").strip()


def _postgres_gate(sql: str, allowed: list[str]) -> None:
    """PostgreSQL's own parser: every table the statement names is allowed, every function
    is an ordinary one, nothing writes, locks or parses XML."""
    import pglast

    try:
        parsed = pglast.parse_sql(sql)
    except pglast.parser.ParseError as exc:
        raise ToolError(f"the query does not parse: {exc}") from None
    if len(parsed) != 1 or type(parsed[0].stmt).__name__ != "SelectStmt":
        raise ToolError("db_query runs exactly one SELECT statement")
    nodes = list(_postgres_nodes(parsed[0].stmt))
    cte_names = {n.ctename.lower() for n in nodes if type(n).__name__ == "CommonTableExpr"}
    for node in nodes:
        kind = type(node).__name__
        if kind in POSTGRES_REFUSED_NODES:
            raise ToolError(f"db_query only reads: {POSTGRES_REFUSED_NODES[kind]} is not allowed")
        if kind == "FuncCall":
            names = [n.sval.lower() for n in node.funcname]
            if len(names) > 2 or (len(names) == 2 and names[0] != "pg_catalog") or names[-1] not in POSTGRES_FUNCTIONS:
                raise ToolError(f"db_query may not call {'.'.join(names)}(); it may call ordinary functions: "
                                f"{', '.join(sorted(POSTGRES_FUNCTIONS))}")
        elif kind == "RangeVar":
            table = node.relname.lower()
            if node.schemaname is None and table in cte_names and not is_denied(table):
                continue  # a CTE of the statement
            if node.catalogname or (node.schemaname and node.schemaname.lower() != "public") or table not in allowed:
                raise _refusal(".".join(p for p in (node.schemaname, node.relname) if p), allowed)


def _postgres_nodes(root):
    """Every node of a pglast tree."""
    from pglast import ast

    pending = [root]
    while pending:
        node = pending.pop()
        if isinstance(node, tuple):
            pending.extend(node)
        elif isinstance(node, ast.Node):
            yield node
            pending.extend(getattr(node, member) for member in node)


def _execute_postgres(sql: str, allowed: list[str], max_rows: int) -> dict:
    from psycopg import sql as pgsql

    role = settings.ORCH_AGENT_DB_ROLE
    failure = None
    try:
        # A transaction, or a savepoint when the caller is inside atomic(); rolled back
        # either way (set_rollback at the end), so SET LOCAL ROLE and READ ONLY end with it.
        with transaction.atomic(), connection.cursor() as cursor:
            try:
                cursor.execute("SET TRANSACTION READ ONLY")
                try:
                    cursor.execute(pgsql.SQL("SET LOCAL ROLE {}").format(pgsql.Identifier(role)).as_string(None))
                except DatabaseError as exc:
                    raise ToolError(f"db_query cannot switch to its read-only role {role!r} ({_first_line(exc)}); "
                                    f"an administrator must run `{ROLE_COMMAND}`") from None
                cursor.execute(f"SET LOCAL statement_timeout = {int(QUERY_TIMEOUT_SECONDS * 1000)}")
                try:
                    cursor.execute(sql)
                    columns = [c.name for c in cursor.description or ()]
                    rows = cursor.fetchmany(max_rows + 1)
                except DatabaseError as exc:
                    failure = exc
                else:
                    cursor.execute("SELECT current_user")
                    now_as = cursor.fetchone()[0]
            finally:
                transaction.set_rollback(True)
    except ToolError:
        raise
    except DatabaseError as exc:  # the SETs above: the role or the connection
        raise ToolError(f"the query failed: {_first_line(exc)}") from None
    if failure is not None:
        raise _postgres_failure(failure, sql, allowed, role)
    if now_as != role:  # the gate should make this impossible; never hand over what was read
        raise ToolError("db_query refused the result: the query changed its database role")
    return _result(columns, rows, max_rows)


def _postgres_failure(exc: DatabaseError, sql: str, allowed: list[str], role: str) -> ToolError:
    state = getattr(exc.__cause__, "sqlstate", None)
    if state == "57014":
        return ToolError(f"the query took longer than {QUERY_TIMEOUT_SECONDS} s and was cancelled; "
                         f"narrow it (WHERE, LIMIT)")
    if state == "25006":
        return ToolError("db_query only reads: the database refused a write")
    if state == "42501":
        ungranted = [t for t in _postgres_missing_grants(role, allowed) if t in sql.lower()]
        if ungranted:
            return ToolError(f"the read-only role {role!r} has no grant on {', '.join(ungranted)} "
                             f"(ORCH_AGENT_DB_TABLES changed since); an administrator must run `{ROLE_COMMAND}`")
        return ToolError(f"db_query may not read that ({_first_line(exc)}); the tables it may read: "
                         f"{', '.join(allowed) or 'none'}")
    return ToolError(f"the query failed: {_first_line(exc)}")


def _postgres_missing_grants(role: str, allowed: list[str]) -> list[str]:
    with connection.cursor() as cursor:
        existing = set(connection.introspection.table_names(cursor))
        missing = []
        for table in allowed:
            if table in existing:
                cursor.execute("SELECT has_table_privilege(%s, %s, 'SELECT')", [role, table])
                if not cursor.fetchone()[0]:
                    missing.append(table)
    return missing


# SQLite: what the authorizer allows. Everything else (writes, ATTACH, PRAGMA, triggers,
# temp objects, transactions) is denied.
_SQLITE_ALWAYS = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_RECURSIVE}


def _execute_sqlite(sql: str, allowed: list[str], max_rows: int) -> dict:
    allowed_set = set(allowed)
    refused: list[str] = []

    def authorize(action, arg1, arg2, db_name, _source):
        if action in _SQLITE_ALWAYS:
            return sqlite3.SQLITE_OK
        if action == sqlite3.SQLITE_READ:
            table = (arg1 or "").lower()
            if table in allowed_set and db_name in (None, "main"):
                return sqlite3.SQLITE_OK
            # A count(*) reads no column: SQLite then names the table, or the CTE, with an
            # empty column and no database. A CTE's name is not a table of the schema.
            if arg2 == "" and db_name is None and table not in schema_names and not is_denied(table):
                return sqlite3.SQLITE_OK
            refused.append(_refusal(arg1 or "?", allowed).args[0])
            return sqlite3.SQLITE_DENY
        if action == sqlite3.SQLITE_FUNCTION:
            if (arg2 or "").lower() in SQLITE_FUNCTIONS:
                return sqlite3.SQLITE_OK
            refused.append(f"db_query may not call {arg2}(); it may call ordinary functions: "
                           f"{', '.join(sorted(SQLITE_FUNCTIONS))}")
            return sqlite3.SQLITE_DENY
        refused.append("db_query only reads: the statement does more than SELECT from tables")
        return sqlite3.SQLITE_DENY

    deadline = time.monotonic() + QUERY_TIMEOUT_SECONDS

    def past_deadline():
        return 1 if time.monotonic() > deadline else 0

    connection.ensure_connection()
    raw: sqlite3.Connection = connection.connection
    with connection.cursor() as cursor:
        cursor.execute("SELECT lower(name) FROM sqlite_schema UNION SELECT lower(name) FROM sqlite_temp_schema")
        schema_names = {row[0] for row in cursor.fetchall()}
        cursor.execute("PRAGMA query_only")
        was_query_only = cursor.fetchone()[0]
        cursor.execute("PRAGMA query_only = ON")
        # Setting an authorizer expires statements prepared earlier: a cached statement
        # (the same text run before by the ORM) is prepared again, through the authorizer.
        raw.set_authorizer(authorize)
        raw.set_progress_handler(past_deadline, 10_000)
        try:
            cursor.execute(sql)
            columns = [c[0] for c in cursor.description or ()]
            rows = cursor.fetchmany(max_rows + 1)
        except (DatabaseError, sqlite3.Error) as exc:
            if refused:
                raise ToolError(refused[0]) from None
            if "interrupted" in str(exc):
                raise ToolError(f"the query took longer than {QUERY_TIMEOUT_SECONDS} s and was cancelled; "
                                f"narrow it (WHERE, LIMIT)") from None
            raise ToolError(f"the query failed: {_first_line(exc)}") from None
        except sqlite3.Warning as exc:  # "You can only execute one statement at a time."
            raise ToolError(f"db_query runs exactly one SELECT statement ({exc})") from None
        finally:
            raw.set_authorizer(None)
            raw.set_progress_handler(None, 0)
            cursor.execute(f"PRAGMA query_only = {'ON' if was_query_only else 'OFF'}")
    return _result(columns, rows, max_rows)


# --- rows the model can read ----------------------------------------------------------

def _result(columns: list[str], rows: list, max_rows: int) -> dict:
    return {"columns": columns, "rows": [[json_safe(v) for v in row] for row in rows[:max_rows]],
            "truncated": len(rows) > max_rows}


def json_safe(value):
    """A database value as JSON: exact decimals and times as strings, bytes as base64."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, (datetime.datetime, datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"base64": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return str(value)


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


# --- the PostgreSQL role --------------------------------------------------------------

def ensure_reader_role(conn=None) -> dict:
    """Create or update the read-only role: NOLOGIN, USAGE on the schema, SELECT on the
    allowed tables and nothing else, granted to the connecting user (so it can SET ROLE).
    Called by migration 0021 and `manage.py agent_db_role`. Nothing to do on SQLite.

    Returns {"role", "granted", "views" (listed, not granted), "missing" (no such table yet)}."""
    conn = conn or connection
    if conn.vendor != "postgresql":
        return {"role": None, "granted": [], "views": [], "missing": []}
    from psycopg import sql as pgsql

    role = settings.ORCH_AGENT_DB_ROLE
    ident = pgsql.Identifier(role).as_string(None)
    allowed = allowed_tables()
    with conn.cursor() as cursor:
        cursor.execute("SELECT c.relname, c.relkind FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
                       "WHERE n.nspname = current_schema() AND c.relkind IN ('r', 'p', 'v', 'm', 'f')")
        kinds = dict(cursor.fetchall())
        cursor.execute("SELECT current_schema()")
        schema = pgsql.Identifier(cursor.fetchone()[0]).as_string(None)
        cursor.execute("SELECT rolcanlogin OR rolsuper OR rolcreatedb OR rolcreaterole OR rolreplication OR rolbypassrls "
                       "FROM pg_roles WHERE rolname = %s", [role])
        found = cursor.fetchone()
        if found is None:
            # Another database of the same cluster may create it at the same moment.
            cursor.execute(f"DO $$ BEGIN CREATE ROLE {ident} NOLOGIN; "
                           f"EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL; END $$")
        elif found[0]:  # ALTER only when needed: concurrent ALTERs of one role fail ("tuple concurrently updated")
            cursor.execute(f"ALTER ROLE {ident} NOLOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS")
        cursor.execute("SELECT pg_has_role(CURRENT_USER, %s, 'MEMBER')", [role])
        if not cursor.fetchone()[0]:
            cursor.execute(f"GRANT {ident} TO CURRENT_USER")
        cursor.execute(f"REVOKE ALL ON ALL TABLES IN SCHEMA {schema} FROM {ident}")
        cursor.execute(f"REVOKE ALL ON ALL SEQUENCES IN SCHEMA {schema} FROM {ident}")
        cursor.execute(f"GRANT USAGE ON SCHEMA {schema} TO {ident}")
        # Tables only: a view (or materialized view) reads with its owner's rights, so a view
        # over auth_user would hand its rows to the role.
        granted = [t for t in allowed if kinds.get(t) in ("r", "p")]
        for table in granted:
            cursor.execute(f"GRANT SELECT ON TABLE {pgsql.Identifier(table).as_string(None)} TO {ident}")
        # PUBLIC has no privileges on new tables, but a grant to PUBLIC by hand would reach the role.
        for table in sorted(t for t in kinds if is_denied(t)):
            cursor.execute(f"REVOKE ALL ON TABLE {pgsql.Identifier(table).as_string(None)} FROM PUBLIC")
        cursor.execute("SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
                       "WHERE n.nspname = current_schema() AND c.relkind IN ('r', 'p', 'v', 'm', 'f') "
                       "AND has_table_privilege(%s, c.oid, 'SELECT')", [role])
        readable = {r[0] for r in cursor.fetchall()}
    leaked = sorted(readable - set(granted))
    if leaked:
        raise RuntimeError(f"the role {role!r} can still read {', '.join(leaked)} through a grant to another role "
                           f"it belongs to, or to PUBLIC by another owner; revoke it and run `{ROLE_COMMAND}` again")
    return {"role": role, "granted": granted,
            "views": [t for t in allowed if kinds.get(t) in ("v", "m", "f")],
            "missing": [t for t in allowed if t not in kinds]}


def drop_reader_grants(conn=None) -> None:
    """Undo ensure_reader_role in this database; drop the role if no other database uses it."""
    conn = conn or connection
    if conn.vendor != "postgresql":
        return
    from psycopg import sql as pgsql

    ident = pgsql.Identifier(settings.ORCH_AGENT_DB_ROLE).as_string(None)
    with conn.cursor() as cursor:
        cursor.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", [settings.ORCH_AGENT_DB_ROLE])
        if cursor.fetchone() is None:
            return
        cursor.execute(f"DROP OWNED BY {ident}")  # its privileges in this database
        try:
            with transaction.atomic(using=conn.alias):
                cursor.execute(f"DROP ROLE {ident}")
        except DatabaseError:
            pass  # still granted in another database of the cluster: it stays
