"""The suite's flush between transactional tests, faster (mostly on PostgreSQL).

Django empties every table after a test that commits (TransactionTestCase's teardown: `flush`)
with one TRUNCATE of all of them: a new file for each of the ~40 tables, its indexes and its
TOAST table, and a flush of them at commit — 0.25 s per test on these machines, 1,400 tests
(a third of the PostgreSQL run). Most tables are empty after a test, and most of the rest
hold a few rows: those are emptied with DELETE (every foreign key here is DEFERRABLE INITIALLY
DEFERRED, checked at the flush's commit, when the rows that pointed at them are gone too); a
table holding many rows is still truncated (DELETE would leave as many dead rows behind, and
autovacuum is off on these machines). The result is the same: every table empty, sequences
as they were (Django's flush does not reset them either unless asked, and then this steps
aside). On both databases content types and permissions are kept: they are the same before
and after every test, and the flush's post_migrate signal only wrote them again."""
from django.db.backends.postgresql.operations import DatabaseOperations
# Through the backend's base module: importing sqlite3.operations first is a circular import.
from django.db.backends.sqlite3.base import DatabaseOperations as SQLiteOperations

DELETE_AT_MOST_ROWS = 500
KEPT = {"django_content_type", "auth_permission"}

_django_sql_flush = DatabaseOperations.sql_flush
_django_sqlite_sql_flush = SQLiteOperations.sql_flush


def sql_flush(self, style, tables, *, reset_sequences=False, allow_cascade=False):
    if reset_sequences or not tables:
        return _django_sql_flush(self, style, tables, reset_sequences=reset_sequences, allow_cascade=allow_cascade)
    # Content types and permissions are the same before and after every test (the flush's
    # post_migrate signal would only write them again): kept.
    quoted = [self.quote_name(table) for table in tables if table not in KEPT]
    probe = " UNION ALL ".join(f"SELECT {i}, (SELECT count(*) FROM (SELECT 1 FROM {name} LIMIT "
                               f"{DELETE_AT_MOST_ROWS + 1}) rows)" for i, name in enumerate(quoted))
    with self.connection.cursor() as cursor:
        cursor.execute(probe)
        counts = dict(cursor.fetchall())
    many = [quoted[i] for i, rows in counts.items() if rows > DELETE_AT_MOST_ROWS]
    few = [quoted[i] for i, rows in counts.items() if 0 < rows <= DELETE_AT_MOST_ROWS]
    # CASCADE: a table that points at a truncated one is emptied with it (it is in `tables` too).
    return ([f"TRUNCATE {', '.join(many)} CASCADE;"] if many else []) + [f"DELETE FROM {name};" for name in few]


def sqlite_sql_flush(self, style, tables, *, reset_sequences=False, allow_cascade=False):
    """SQLite's flush is already a DELETE per table: only content types and permissions are kept."""
    return _django_sqlite_sql_flush(self, style, [table for table in tables if table not in KEPT],
                                    reset_sequences=reset_sequences, allow_cascade=allow_cascade)


def install() -> None:
    DatabaseOperations.sql_flush = sql_flush
    SQLiteOperations.sql_flush = sqlite_sql_flush
