"""The PostgreSQL role db_query reads as (issue 19): NOLOGIN, SELECT on the tables of
ORCH_AGENT_DB_TABLES only, granted to the connecting user so each query can `SET LOCAL ROLE`
to it (orchestrator/tools/dbread.py). Nothing on SQLite (an authorizer callback does it
there). `manage.py agent_db_role` runs the same function after ORCH_AGENT_DB_TABLES changes.

Creating a role needs CREATEROLE: a database user without it gets a notice instead of a
failed deploy, and db_query refuses every query until an administrator runs the command."""
import sys

from django.db import DatabaseError, migrations, transaction


def create(apps, schema_editor):
    from orchestrator.tools.dbread import ensure_reader_role

    connection = schema_editor.connection
    if connection.vendor != "postgresql":
        return
    try:
        with transaction.atomic(using=connection.alias):
            ensure_reader_role(connection)
    except DatabaseError as exc:
        sys.stderr.write(f"\n  db_query's read-only role was not created ({str(exc).strip()}); db_query refuses "
                         f"queries until a user with CREATEROLE runs `manage.py agent_db_role`.\n")


def drop(apps, schema_editor):
    from orchestrator.tools.dbread import drop_reader_grants

    drop_reader_grants(schema_editor.connection)


class Migration(migrations.Migration):
    dependencies = [("orchestrator", "0020_agent_security")]
    operations = [migrations.RunPython(create, drop)]
