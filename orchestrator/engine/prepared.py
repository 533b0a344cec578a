"""A cursor for the hot statements the engine runs on every step (the step commit, an
idempotent effect's record), prepared once per connection on PostgreSQL.

Django binds parameters on the client (its cursors cannot be prepared) and turns psycopg's
automatic preparation off (prepare_threshold=None), so without this PostgreSQL parses and plans
such a statement on every step: measured, the step commit spent parse 0.20 ms + bind 0.28 ms +
execute 0.24 ms; prepared, bind 0.01 ms + execute 0.18 ms."""
import sys

import psycopg
from django.db import DEFAULT_DB_ALIAS, connections
from django.db.backends.utils import CursorWrapper

from ..conf import harness


class _PreparedCursor(CursorWrapper):
    """Django's cursor wrapper (its error translation and execute wrappers kept) around a
    server-side-binding cursor whose statements are prepared when ORCH_PREPARE_STEP_COMMIT is on."""

    def _execute(self, sql, params, *ignored_wrapper_args):
        self.db.validate_no_broken_transaction()
        prepare = harness.prepare_step_commit
        if prepare and self.cursor.connection.prepare_threshold is None:
            # psycopg prepares nothing while the threshold is None; a threshold never reached
            # prepares only what is asked for by name (these statements), never Django's own.
            self.cursor.connection.prepare_threshold = sys.maxsize
        with self.db.wrap_database_errors:
            return self.cursor.execute(sql, params, prepare=prepare)


def prepared_cursor() -> CursorWrapper:
    """A cursor on Django's connection (use it in a `with`) whose statements are prepared."""
    # This thread's connection itself, not `django.db.connection`: each attribute read through
    # that proxy is a thread-local lookup, and the cursor reads several per statement.
    db = connections[DEFAULT_DB_ALIAS]
    db.ensure_connection()
    return _PreparedCursor(psycopg.Cursor(db.connection), db)
