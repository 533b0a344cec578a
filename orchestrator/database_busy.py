"""A busy SQLite database answers a web request with 503 and Retry-After within seconds.

SQLite has one write lock for the whole database. A process stopped while it holds it (SIGSTOP,
a paused VM, a debugger) blocks every other writer until it runs again or dies. Workers wait
for the lock as long as the connection's busy timeout (settings: OPTIONS["timeout"], 30 s):
their writes are checkpoints and outcomes that must land. A person or an API client should
not hang that long: while a request is served, every SQLite connection it uses waits at most
SQLITE_REQUEST_BUSY_TIMEOUT_SECONDS, and "database is locked" becomes a 503 that says what is
going on and when to try again. The role is decided per request, not per process, so it holds
however the web server is started (daphne, runserver, a WSGI server, the test client) and a
web process's own loops (the live tailer) keep the workers' patience.

PostgreSQL locks rows, not the database: there a frozen worker blocks only its own task."""
import contextvars
import logging

from django.conf import settings
from django.db import OperationalError, connections
from django.db.backends.signals import connection_created
from django.http import HttpResponse, JsonResponse
from django.template.loader import render_to_string

log = logging.getLogger(__name__)

RETRY_AFTER_SECONDS = 5

# What SQLite says when its busy timeout ran out (SQLITE_BUSY, SQLITE_LOCKED).
BUSY_ERRORS = ("database is locked", "database table is locked", "database is busy")

_serving_request = contextvars.ContextVar("serving_request", default=False)


def is_database_busy(exc: BaseException) -> bool:
    """True for SQLite's "database is locked": another process holds the write lock (not an outage)."""
    return isinstance(exc, OperationalError) and any(text in str(exc).lower() for text in BUSY_ERRORS)


def busy_message() -> str:
    waited = settings.SQLITE_REQUEST_BUSY_TIMEOUT_SECONDS
    return (f"The database is busy: another process has held SQLite's write lock for more than {waited:g} s "
            f"(SQLite lets one process write at a time, and a worker stopped or paused in the middle of a write "
            f"keeps the lock until it runs again or is killed). Try again in {RETRY_AFTER_SECONDS} s. If this "
            f"lasts, look for a stopped process of this installation (state T in `ps -eo pid,stat,cmd`) and "
            f"continue it (kill -CONT) or kill it; with PostgreSQL (DATABASE_URL) one frozen worker blocks only "
            f"its own task.")


def log_busy(request) -> None:
    log.warning("request refused: the database is busy (write lock held by another process)",
                extra={"outage": "database_busy", "path": request.path})


def busy_response(request) -> HttpResponse:
    """503 with Retry-After: JSON under /api/, a page elsewhere."""
    log_busy(request)
    message = busy_message()
    if request.path.startswith("/api/"):
        response = JsonResponse({"detail": message, "errors": []}, status=503)
    else:
        response = HttpResponse(render_to_string("database_busy.html", {"message": message}, request=None),
                                status=503)
    response["Retry-After"] = str(RETRY_AFTER_SECONDS)
    return response


def _set_busy_timeout(connection, seconds: float) -> None:
    # The same setting as sqlite3.connect(timeout=...), changed on an open connection.
    connection.connection.execute(f"PRAGMA busy_timeout = {int(seconds * 1000)}")


def _shorten_new_connection(sender, connection, **kwargs) -> None:
    """A connection opened while a request is served waits for the write lock briefly."""
    if connection.vendor == "sqlite" and _serving_request.get():
        _set_busy_timeout(connection, settings.SQLITE_REQUEST_BUSY_TIMEOUT_SECONDS)


def _open_sqlite_connections() -> list:
    return [c for c in connections.all(initialized_only=True) if c.vendor == "sqlite" and c.connection is not None]


class RequestBusyTimeoutMiddleware:
    """Near the top of MIDDLEWARE, so the sessions' and messages' writes are covered too: the
    request's SQLite connections wait SQLITE_REQUEST_BUSY_TIMEOUT_SECONDS for the write lock,
    and a connection still open afterwards (the test client keeps it) gets its own timeout back."""

    def __init__(self, get_response):
        self.get_response = get_response
        connection_created.connect(_shorten_new_connection, dispatch_uid="orchestrator.database_busy")

    def __call__(self, request):
        token = _serving_request.set(True)
        try:
            for connection in _open_sqlite_connections():
                _set_busy_timeout(connection, settings.SQLITE_REQUEST_BUSY_TIMEOUT_SECONDS)
            return self.get_response(request)
        finally:
            _serving_request.reset(token)
            for connection in _open_sqlite_connections():
                try:
                    _set_busy_timeout(connection, connection.settings_dict["OPTIONS"].get("timeout", 5))
                except Exception:  # a broken connection is closed and reopened with the settings' timeout
                    pass


class DatabaseBusyMiddleware:
    """After orchestrator.outage.DatabaseOutageMiddleware in MIDDLEWARE (so it is asked first):
    a view that found the write lock taken answers 503 "busy, try again", not "unreachable"."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        return self.get_response(request)

    def process_exception(self, request, exception):
        if is_database_busy(exception):
            return busy_response(request)
        return None
