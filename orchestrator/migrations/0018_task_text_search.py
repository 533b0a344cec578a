"""Text search on the task list stays fast at a million tasks (PostgreSQL only).

The list's search is `icontains` on the title and the type, which Django writes as
`UPPER(col::text) LIKE UPPER('%term%')`: no b-tree index can serve it, so each search read
every row. A trigram GIN index on exactly those expressions (pg_trgm, a trusted extension a
database owner may create) lets PostgreSQL answer from the index. Built CONCURRENTLY, so a
running installation keeps writing tasks while it builds (hence a non-atomic migration).
SQLite keeps scanning: it is the single-machine default, measured at 100,000 tasks.
"""
from django.db import migrations

INDEXES = {
    "task_title_trgm": "UPPER((title)::text)",
    "task_type_trgm": "UPPER((type)::text)",
}


def create(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    schema_editor.execute("CREATE EXTENSION IF NOT EXISTS pg_trgm")
    for name, expression in INDEXES.items():
        schema_editor.execute(f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {name} ON orchestrator_task "
                              f"USING gin ({expression} gin_trgm_ops)")


def drop(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    for name in INDEXES:
        schema_editor.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {name}")


class Migration(migrations.Migration):
    atomic = False
    dependencies = [("orchestrator", "0017_retention")]
    operations = [migrations.RunPython(create, drop)]
