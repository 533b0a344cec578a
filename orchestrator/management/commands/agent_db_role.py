from django.core.management.base import BaseCommand, CommandError
from django.db import DatabaseError, connection

from orchestrator.tools.dbread import denied_in_setting, ensure_reader_role


class Command(BaseCommand):
    help = ("PostgreSQL: create or update the read-only role db_query runs as (ORCH_AGENT_DB_ROLE) with SELECT on "
            "the tables of ORCH_AGENT_DB_TABLES only. Run it after changing ORCH_AGENT_DB_TABLES; it needs a "
            "database user with CREATEROLE.")

    def handle(self, *args, **options):
        if connection.vendor != "postgresql":
            self.stdout.write("SQLite: nothing to do (db_query's authorizer reads ORCH_AGENT_DB_TABLES at each query).")
            return
        denied = denied_in_setting()
        if denied:
            self.stderr.write(f"Never granted (harness tables, whatever ORCH_AGENT_DB_TABLES says): {', '.join(denied)}")
        try:
            result = ensure_reader_role()
        except (DatabaseError, RuntimeError) as exc:
            raise CommandError(f"Could not update the role: {exc}".strip()) from None
        self.stdout.write(f"Role {result['role']} may read: {', '.join(result['granted']) or 'no table'}.")
        if result["views"]:
            self.stdout.write(f"Not granted, views read with their owner's rights: {', '.join(result['views'])} "
                              f"(list the tables they read instead).")
        if result["missing"]:
            self.stdout.write(f"Not granted, no such table yet: {', '.join(result['missing'])} "
                              f"(run this command again once they exist).")
