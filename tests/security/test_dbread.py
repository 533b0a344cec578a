"""db_query reads only the tables of ORCH_AGENT_DB_TABLES (issue 19, item 2), on SQLite and
PostgreSQL: every harness table refused however it is named, writes refused by the database
itself, no file-reading functions, values encoded, and the connection as it was afterwards."""
import base64
import datetime
import decimal
import json
import uuid

import pytest
from django.contrib.auth.models import User
from django.core.checks import run_checks
from django.core.management import call_command
from django.db import DatabaseError, connection, transaction

from demo.models import DemoContractExtraction, DemoDestination, DemoSource
from orchestrator.tools import dbread
from orchestrator.tools.base import ToolError
from orchestrator.tools.dbread import read_only_query

POSTGRES = connection.vendor == "postgresql"
on_postgres = pytest.mark.skipif(not POSTGRES, reason="PostgreSQL's role")
on_sqlite = pytest.mark.skipif(POSTGRES, reason="SQLite's authorizer")

# Tables that must be among the deny list derived from the apps registry.
MUST_DENY = ["auth_user", "auth_group", "django_session", "django_admin_log", "django_content_type",
             "orchestrator_apitoken", "orchestrator_webhooksource", "orchestrator_inboundevent",
             "orchestrator_task", "orchestrator_walentry", "orchestrator_auditentry", "orchestrator_agentmessage",
             "review_reviewitem", "django_q_task", "django_q_ormq", "axes_accessattempt", "agent_memory"]


@pytest.fixture
def secrets(db, make_user):
    """Rows worth stealing, and demo rows worth reading."""
    admin = make_user("ada", superuser=True)
    DemoSource.objects.bulk_create([DemoSource(id=i, amount=decimal.Decimal(f"{i}.2500")) for i in range(1, 6)])
    DemoDestination.objects.create(id=1, amount=decimal.Decimal("2.5000"))
    DemoContractExtraction.objects.create(contract="c-1", parties=["Acme", "Bolt"], amounts=[{"value": "1.5"}])
    return admin


def refused(sql, **kwargs) -> str:
    with pytest.raises(ToolError) as caught:
        read_only_query(sql, **kwargs)
    return str(caught.value)


# --- what is denied --------------------------------------------------------------------

def test_the_deny_list_holds_every_harness_table_of_the_apps_registry():
    from django.apps import apps

    denied = dbread.harness_tables()
    assert set(MUST_DENY) <= denied
    for model in apps.get_models(include_auto_created=True):
        table = model._meta.db_table
        assert dbread.is_denied(table) == (model._meta.app_label != "demo"), table
    for table in ("django_migrations", "sqlite_master", "pg_authid", "orchestrator_newthing", "AUTH_USER"):
        assert dbread.is_denied(table)


@pytest.mark.parametrize("table", sorted(dbread.harness_tables()))
def test_every_harness_table_is_refused(secrets, table):
    message = refused(f"SELECT * FROM {table}")
    assert "may not read" in message and "demo_source" in message


@pytest.mark.parametrize("sql", [
    "SELECT * FROM AUTH_USER",
    'SELECT * FROM "auth_user"',
    "select password from Auth_User",
    "SELECT password FROM public.auth_user" if POSTGRES else "SELECT password FROM main.auth_user",
    "SELECT count(*) FROM auth_user",
    "SELECT 1 FROM django_session",
    "SELECT EXISTS (SELECT 1 FROM django_session)",
    "SELECT * FROM demo_source WHERE id IN (SELECT id FROM auth_user)",
    "SELECT * FROM (SELECT session_key FROM django_session) s",
    "WITH u AS (SELECT password FROM auth_user) SELECT * FROM u",
    "WITH demo_source AS (SELECT session_key FROM django_session) SELECT * FROM demo_source",
    "SELECT CAST(id AS TEXT) FROM demo_source UNION SELECT password FROM auth_user",
    "SELECT d.id, u.password FROM demo_source d JOIN auth_user u ON u.id = d.id",
    "SELECT d.id FROM demo_source d, orchestrator_apitoken t",
    "SELECT secrets FROM orchestrator_webhooksource",
    "SELECT * FROM review_reviewitem",
    "SELECT value FROM agent_memory",
    "/* comment */ SELECT * FROM auth_user -- trailing",
    "SELECT (SELECT password FROM auth_user LIMIT 1)",
    "SELECT * FROM demo_source NATURAL JOIN auth_user",
    "SELECT * FROM demo_source WHERE EXISTS (SELECT 1 FROM auth_user WHERE password LIKE 'pbkdf2%')",
    "SELECT count(*) FROM (SELECT 1 FROM django_session) AS auth_sessions",
])
def test_harness_tables_are_refused_however_they_are_named(secrets, sql):
    assert "may not" in refused(sql)


@pytest.mark.parametrize("sql", [
    "SELECT sql FROM sqlite_master",
    "SELECT sql FROM sqlite_schema",
    "SELECT * FROM sqlite_temp_master",
    "SELECT * FROM pragma_table_info('auth_user')",
    "SELECT * FROM demo_source, json_each('[1]')",
])
@on_sqlite
def test_sqlite_schema_and_table_valued_functions_are_refused(secrets, sql):
    """Decision: the schema (sqlite_master) is not readable either; the model learns the
    columns of its tables from SELECT * ... LIMIT 1."""
    message = refused(sql)
    assert "may not" in message or "only reads" in message


@pytest.mark.parametrize("sql", [
    "SELECT relname FROM pg_class",
    "SELECT * FROM pg_catalog.pg_class",
    "SELECT * FROM information_schema.columns",
    "SELECT * FROM pg_stat_activity",
    "SELECT pg_get_viewdef('pg_roles'::regclass)",
])
@on_postgres
def test_postgres_catalogs_are_refused(secrets, sql):
    """Decision: catalogs are refused by the gate too (PostgreSQL lets any role read them)."""
    assert "may not" in refused(sql)


def test_a_harness_table_in_the_setting_is_still_refused(secrets, settings):
    settings.ORCH_AGENT_DB_TABLES = ["auth_user", "django_session", "demo_source"]
    assert dbread.allowed_tables() == ["demo_source"]
    assert "never readable" in refused("SELECT password FROM auth_user")
    assert read_only_query("SELECT id FROM demo_source ORDER BY id")["rows"][0] == [1]


def test_a_table_left_out_of_the_setting_is_refused(secrets, settings):
    settings.ORCH_AGENT_DB_TABLES = ["demo_source"]
    assert "not in ORCH_AGENT_DB_TABLES" in refused("SELECT * FROM demo_destination")


def test_a_view_over_a_harness_table_is_refused_even_when_listed(secrets, settings):
    with connection.cursor() as cursor:
        cursor.execute("CREATE VIEW demo_view AS SELECT username, password FROM auth_user")
    settings.ORCH_AGENT_DB_TABLES = [*settings.ORCH_AGENT_DB_TABLES, "demo_view"]
    if POSTGRES:
        # Views are never granted: a view reads with its owner's rights.
        assert dbread.ensure_reader_role()["views"] == ["demo_view"]
    assert "may not" in refused("SELECT * FROM demo_view")


# --- the system check ------------------------------------------------------------------

def test_system_check_refuses_a_harness_table_in_the_setting(settings):
    settings.ORCH_AGENT_DB_TABLES = ["auth_user"]
    errors = [e for e in run_checks(tags=["orchestrator"]) if e.id == "orchestrator.E020"]
    assert len(errors) == 1 and "auth_user" in errors[0].msg
    settings.ORCH_AGENT_DB_TABLES = ["demo_source", "django_session", "orchestrator_task"]
    assert "django_session, orchestrator_task" in [e for e in run_checks(tags=["orchestrator"])
                                                   if e.id == "orchestrator.E020"][0].msg
    settings.ORCH_AGENT_DB_TABLES = ["demo_source", "demo_destination"]
    assert not [e for e in run_checks(tags=["orchestrator"]) if e.id == "orchestrator.E020"]


# --- what is allowed, and how it comes back -------------------------------------------

def test_allowed_tables_are_readable_with_decimals_and_json_encoded(secrets):
    result = read_only_query("SELECT s.id, s.amount, d.amount FROM demo_source s "
                             "LEFT JOIN demo_destination d ON d.id = s.id ORDER BY s.id")
    assert result["columns"] == ["id", "amount", "amount"]
    assert result["rows"][0] == [1, "1.2500" if POSTGRES else result["rows"][0][1], "2.5000" if POSTGRES else
                                 result["rows"][0][2]]
    assert decimal.Decimal(str(result["rows"][0][1])) == decimal.Decimal("1.25")
    assert result["truncated"] is False
    json.dumps(result)
    contract = read_only_query("WITH c AS (SELECT * FROM demo_contract_extraction) SELECT contract, parties FROM c")
    parties = contract["rows"][0][1]
    assert (json.loads(parties) if isinstance(parties, str) else parties) == ["Acme", "Bolt"]


def test_rows_beyond_max_rows_are_cut_and_said_so(secrets):
    result = read_only_query("SELECT id FROM demo_source ORDER BY id", max_rows=3)
    assert result["rows"] == [[1], [2], [3]] and result["truncated"] is True
    assert read_only_query("SELECT id FROM demo_source", max_rows=5)["truncated"] is False


def test_dates_decimals_uuids_and_bytes_are_encoded_never_a_crash(secrets):
    if POSTGRES:
        sql = ("SELECT CAST('2026-01-02' AS date), CAST('2026-01-02 03:04:05+00' AS timestamptz), "
               "CAST('1.50' AS numeric), CAST('a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11' AS uuid), "
               "CAST('\\x00ff' AS bytea), CAST('1 day' AS interval), CAST('NaN' AS float8)")
    else:
        sql = "SELECT date('2026-01-02'), x'00ff', 1.5, CAST('1.50' AS TEXT) FROM demo_source LIMIT 1"
    row = read_only_query(sql)["rows"][0]
    json.dumps(row)
    if POSTGRES:
        assert row[:5] == ["2026-01-02", "2026-01-02T03:04:05+00:00", "1.50", "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11",
                           {"base64": base64.b64encode(b"\x00\xff").decode()}]
        assert row[5] == 86400.0 and row[6] == "nan"
    else:
        assert row == ["2026-01-02", {"base64": "AP8="}, 1.5, "1.50"]


class Unknown:
    def __str__(self):
        return "unknown"


def test_json_safe_encodes_every_kind_of_value():
    value = dbread.json_safe([datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.timezone.utc),
                              datetime.date(2026, 1, 2), datetime.time(3, 4), decimal.Decimal("1.10"),
                              uuid.UUID(int=1), b"\x01", memoryview(b"\x02"), bytearray(b"\x03"),
                              {"k": decimal.Decimal("2")}, float("inf"), (1, 2), Unknown()])
    json.dumps(value)
    assert value[:9] == ["2026-01-02T03:04:05+00:00", "2026-01-02", "03:04:00", "1.10",
                         "00000000-0000-0000-0000-000000000001", {"base64": "AQ=="}, {"base64": "Ag=="},
                         {"base64": "Aw=="}, {"k": "2"}]
    assert value[9:] == ["inf", [1, 2], "unknown"]


def test_a_semicolon_inside_a_string_is_not_a_second_statement(secrets):
    assert read_only_query("SELECT ';' AS s FROM demo_source LIMIT 1")["rows"] == [[";"]]


def test_a_failing_query_is_a_tool_error_the_model_can_read(secrets):
    assert "the query failed" in refused("SELECT no_such_column FROM demo_source")
    assert "does not parse" in refused("SELECT FROM WHERE") or "the query failed" in refused("SELECT FROM WHERE")


# --- one statement, reads only --------------------------------------------------------

@pytest.mark.parametrize("sql", [
    "DELETE FROM demo_source",
    "UPDATE demo_source SET amount = 0",
    "INSERT INTO demo_source VALUES (99, 1)",
    "SELECT 1; DELETE FROM demo_source",
    "SELECT 1; SELECT password FROM auth_user",
    "PRAGMA query_only = OFF",
    "ATTACH DATABASE '/tmp/x.db' AS x",
    "SET ROLE postgres",
    "RESET ROLE",
    "VALUES (1)",
    "",
])
def test_anything_but_one_select_is_refused(secrets, sql):
    refused(sql)
    assert DemoSource.objects.count() == 5


@pytest.mark.parametrize("sql", [
    "WITH x AS (SELECT 1) DELETE FROM demo_source",
    "WITH x AS (SELECT 1) INSERT INTO demo_source VALUES (99, 1)",
    "WITH x AS (SELECT 1) UPDATE demo_source SET amount = 0",
    "WITH x AS (DELETE FROM demo_source RETURNING id) SELECT * FROM x",
    "SELECT * INTO demo_copy FROM demo_source",
    "SELECT * FROM demo_source FOR UPDATE",
])
def test_writes_that_start_like_a_read_are_refused(secrets, sql):
    refused(sql)
    assert DemoSource.objects.count() == 5 and DemoSource.objects.filter(amount=0).count() == 0


@pytest.mark.parametrize("sql", [
    "WITH x AS (SELECT 1) DELETE FROM demo_source",
    "WITH x AS (DELETE FROM demo_source RETURNING id) SELECT * FROM x",
    "SELECT * INTO demo_copy FROM demo_source",
    "INSERT INTO demo_source VALUES (99, 1)",
    "DELETE FROM demo_source",
    "SELECT * FROM demo_source FOR UPDATE",
])
def test_the_database_itself_refuses_writes_without_the_gate(secrets, sql):
    """The layer under the gate: the read-only transaction and role (PostgreSQL) or the
    authorizer and query_only (SQLite) refuse a write the gate let through."""
    execute = dbread._execute_postgres if POSTGRES else dbread._execute_sqlite
    with pytest.raises(ToolError):
        execute(sql, dbread.allowed_tables(), 10)
    assert DemoSource.objects.count() == 5


@pytest.mark.parametrize("table", MUST_DENY)
def test_the_database_itself_refuses_harness_tables_without_the_gate(secrets, table):
    execute = dbread._execute_postgres if POSTGRES else dbread._execute_sqlite
    with pytest.raises(ToolError, match="may not read"):
        execute(f"SELECT * FROM {table}", dbread.allowed_tables(), 10)


# --- functions --------------------------------------------------------------------------

@pytest.mark.parametrize("sql", [
    "SELECT load_extension('/tmp/evil')",
    "SELECT readfile('/etc/passwd')",
    "SELECT writefile('/tmp/x', 'y')",
    "SELECT fts3_tokenizer('simple')",
    "SELECT sqlite_version()",
    "SELECT edit('x')",
    "SELECT django_format_dtdelta('+', 1, 1)",
    "SELECT printf('%.*c', 1000000000, 'x')",
    "SELECT randomblob(1000000000)",
])
@on_sqlite
def test_sqlite_functions_outside_the_allow_list_are_refused(secrets, sql):
    # The sqlite3 shell's file functions are not in Python's build: present them, as an
    # extension could, to prove the authorizer (not their absence) refuses them.
    connection.ensure_connection()
    for name in ("readfile", "writefile", "edit"):
        connection.connection.create_function(name, -1, lambda *args: "the file's content")
    assert "may not call" in refused(sql)


@pytest.mark.parametrize("sql", [
    "SELECT pg_read_file('/etc/passwd')",
    "SELECT pg_read_binary_file('/etc/passwd')",
    "SELECT pg_ls_dir('.')",
    "SELECT pg_stat_file('/etc/passwd')",
    "SELECT lo_import('/etc/passwd')",
    "SELECT dblink('dbname=postgres', 'SELECT 1')",
    "SELECT set_config('role', session_user, true)",
    "SELECT pg_catalog.set_config('role', 'none', true)",
    "SELECT \"set_config\" ('role', 'none', true)",
    "SELECT query_to_xml('SELECT password FROM auth_user', true, false, '')",
    "SELECT current_setting('data_directory')",
    "SELECT pg_sleep(60)",
    "SELECT * FROM demo_source, LATERAL set_config('role', 'none', true)",
    "SELECT '\\', set_config('role', 'none', true), '\\'",
    "SELECT xmlparse(document '<a/>')",
    "SELECT public.count(*) FROM demo_source",
    "SELECT repeat('x', 1000000000)",
])
@on_postgres
def test_postgres_functions_outside_the_allow_list_are_refused(secrets, sql):
    assert "may not call" in refused(sql) or "not allowed" in refused(sql)


@pytest.mark.parametrize("sql", [
    "SELECT pg_read_file('/etc/passwd')",
    "SELECT pg_ls_dir('.')",
    "SELECT lo_import('/etc/passwd')",
    "SELECT pg_read_binary_file('/etc/hostname')",
    "COPY demo_source TO '/tmp/orch_dbread_copy'",
    "COPY demo_source FROM PROGRAM 'id'",
])
@on_postgres
def test_the_role_itself_cannot_read_files_or_run_programs(secrets, sql):
    """Without the gate: as the role (not a superuser, no pg_read_server_files), PostgreSQL
    refuses the functions and COPY that reach the server's files."""
    role = dbread.settings.ORCH_AGENT_DB_ROLE
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(f'SET LOCAL ROLE "{role}"')
        cursor.execute("SELECT current_user")
        assert cursor.fetchone() == (role,)
        with pytest.raises(DatabaseError, match="permission denied|must be superuser|privileges of the"):
            with transaction.atomic():
                cursor.execute(sql)
        transaction.set_rollback(True)


@on_postgres
def test_a_query_that_changes_its_role_gets_no_result(secrets):
    """Why set_config is refused: SET ROLE can be undone from inside a query (to the session
    user). Without the gate, the check after the query still withholds the rows."""
    with pytest.raises(ToolError, match="changed its database role"):
        dbread._execute_postgres("SELECT set_config('role', 'none', true)", dbread.allowed_tables(), 10)
    assert "may not call set_config" in refused("SELECT set_config('role', 'none', true)")


def test_ordinary_functions_are_allowed(secrets):
    result = read_only_query("SELECT count(*), sum(amount), max(id), lower('A'), coalesce(NULL, 1), "
                             "round(avg(amount), 2) FROM demo_source WHERE CAST(id AS TEXT) LIKE '%'")
    assert result["rows"][0][0] == 5 and result["rows"][0][3] == "a"


# --- the PostgreSQL role ---------------------------------------------------------------

@on_postgres
def test_the_role_reads_only_the_allowed_tables(db):
    role = dbread.settings.ORCH_AGENT_DB_ROLE
    with connection.cursor() as cursor:
        cursor.execute("SELECT rolcanlogin, rolsuper FROM pg_roles WHERE rolname = %s", [role])
        assert cursor.fetchone() == (False, False)
        cursor.execute("SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
                       "WHERE n.nspname = current_schema() AND c.relkind IN ('r', 'v', 'm', 'p') "
                       "AND has_table_privilege(%s, c.oid, 'SELECT')", [role])
        assert sorted(r[0] for r in cursor.fetchall()) == sorted(dbread.allowed_tables())
        cursor.execute("SELECT pg_has_role(%s, 'pg_read_server_files', 'MEMBER')", [role])
        assert cursor.fetchone() == (False,)


@on_postgres
def test_a_missing_grant_says_to_run_the_command(secrets):
    role = dbread.settings.ORCH_AGENT_DB_ROLE
    with connection.cursor() as cursor:
        cursor.execute(f'REVOKE SELECT ON demo_destination FROM "{role}"')
    message = refused("SELECT * FROM demo_destination")
    assert "manage.py agent_db_role" in message and "demo_destination" in message
    call_command("agent_db_role")
    assert read_only_query("SELECT id FROM demo_destination")["rows"] == [[1]]


@on_postgres
def test_a_missing_role_says_to_run_the_command(secrets, settings):
    settings.ORCH_AGENT_DB_ROLE = "orchestrator_no_such_role"
    assert "manage.py agent_db_role" in refused("SELECT id FROM demo_source")


@on_postgres
def test_the_command_regrants_after_the_setting_changes(secrets, settings, capsys):
    settings.ORCH_AGENT_DB_TABLES = ["demo_source"]
    call_command("agent_db_role")
    assert "may read: demo_source." in capsys.readouterr().out
    settings.ORCH_AGENT_DB_TABLES = ["demo_source", "demo_destination"]
    with pytest.raises(ToolError, match="agent_db_role"):
        read_only_query("SELECT id FROM demo_destination")
    call_command("agent_db_role")
    assert read_only_query("SELECT id FROM demo_destination")["rows"] == [[1]]


@on_postgres
def test_the_migration_is_reversible(db):
    role = dbread.settings.ORCH_AGENT_DB_ROLE
    dbread.drop_reader_grants()
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_class c WHERE c.relname LIKE 'demo_%%' AND c.relkind = 'r' AND "
                       "EXISTS (SELECT 1 FROM pg_roles WHERE rolname = %s) AND has_table_privilege(%s, c.oid, 'SELECT')",
                       [role, role])
        assert cursor.fetchone() == (0,)
    assert dbread.ensure_reader_role()["granted"] == dbread.allowed_tables()


def test_the_command_on_sqlite_says_nothing_to_do(capsys):
    if POSTGRES:
        pytest.skip("SQLite's message")
    call_command("agent_db_role")
    assert "nothing to do" in capsys.readouterr().out


# --- the connection afterwards ---------------------------------------------------------

def _connection_state():
    with connection.cursor() as cursor:
        if POSTGRES:
            cursor.execute("SELECT current_user = session_user, current_setting('transaction_read_only'), "
                           "current_setting('statement_timeout')")
            return cursor.fetchone()
        cursor.execute("PRAGMA query_only")
        return cursor.fetchone()


@pytest.mark.parametrize("sql", ["SELECT id FROM demo_source", "SELECT password FROM auth_user",
                                 "SELECT no_such_column FROM demo_source"])
def test_the_connection_is_its_own_again_after_a_query_inside_atomic(secrets, sql):
    before = _connection_state()
    with transaction.atomic():
        try:
            read_only_query(sql)
        except ToolError:
            pass
        assert _connection_state() == before
        # The ORM reads and writes auth_user as usual, in the same transaction.
        assert User.objects.filter(username="ada").exists()
        User.objects.filter(username="ada").update(first_name="Ada")
    assert User.objects.get(username="ada").first_name == "Ada"
    if not POSTGRES:
        with connection.cursor() as cursor:
            cursor.execute("SELECT count(*) FROM auth_user")  # no authorizer left behind
            assert cursor.fetchone()[0] == 1


@pytest.mark.django_db(transaction=True)
def test_the_connection_is_its_own_again_outside_atomic(make_user):
    make_user("ada", superuser=True)
    DemoSource.objects.create(id=1, amount=1)
    before = _connection_state()
    assert read_only_query("SELECT id FROM demo_source")["rows"] == [[1]]
    with pytest.raises(ToolError):
        read_only_query("SELECT password FROM auth_user")
    assert connection.get_autocommit() and not connection.in_atomic_block
    assert _connection_state() == before
    User.objects.filter(username="ada").update(last_name="L")
    assert User.objects.get(username="ada").last_name == "L"


@on_sqlite
def test_sqlite_a_statement_prepared_before_is_checked_again(secrets):
    """sqlite3 caches statements by their text: set_authorizer expires them, so the same
    text run by the ORM a moment before is prepared again through the authorizer."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT password FROM auth_user")
        cursor.fetchall()
    assert "may not read" in refused("SELECT password FROM auth_user")


def test_a_long_query_is_cancelled(secrets, monkeypatch):
    monkeypatch.setattr(dbread, "QUERY_TIMEOUT_SECONDS", 0.3)
    sql = ("WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 100000000) "
           "SELECT count(*) FROM n")
    assert "cancelled" in refused(sql)
    assert _connection_state() == _connection_state()
    assert read_only_query("SELECT count(*) FROM demo_source")["rows"] == [[5]]
