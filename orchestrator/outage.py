"""Living through a database outage in the long-running loops (sweeper, supervisor,
watchdog, live tailer): one log line when the database goes away and one when it is back
(no traceback per poll), and the broken connection closed so the next use reconnects.

Django only health-checks persistent connections at the start of a request; a loop that
never ends a request must do it itself, or it keeps a dead connection forever."""
import logging
import threading
import time

from django.db import InterfaceError, OperationalError, close_old_connections, connection

# What a lost or refused database connection raises (not a constraint violation or a bug).
DATABASE_DOWN = (OperationalError, InterfaceError)


# When a thread of this process last found the database unreachable (wall clock): a step that
# ran out of time meanwhile may have spent it waiting for the database (engine/outcomes.py).
_database_unreachable_at = 0.0


def note_database_unreachable() -> None:
    global _database_unreachable_at
    _database_unreachable_at = time.time()


def database_unreachable_since(moment: float) -> bool:
    """Whether a thread of this process found the database unreachable at or after `moment`
    (a `time.time()`)."""
    return _database_unreachable_at >= moment


class OutageWatch:
    def __init__(self, logger: logging.Logger, where: str, service: str = "database"):
        self.log, self.where, self.service = logger, where, service
        self.down_since: float | None = None
        self.failures = 0

    @property
    def down(self) -> bool:
        return self.down_since is not None

    def failed(self, exc: BaseException, **extra) -> None:
        """A poll failed because the database is unreachable: say so once, then keep quiet."""
        self.failures += 1
        if self.down_since is None:
            self.down_since = time.monotonic()
            self.log.warning("%s: %s unreachable (%s: %s); retrying until it is back", self.where, self.service,
                             type(exc).__name__, str(exc).strip().splitlines()[0][:300] if str(exc) else "",
                             extra={**extra, "outage": self.service})
        if self.service == "database":
            note_database_unreachable()
            reset_connection()

    def succeeded(self, **extra) -> None:
        if self.down_since is not None:
            self.log.info("%s: %s reachable again after %.1f s (%d failed polls)", self.where, self.service,
                          time.monotonic() - self.down_since, self.failures, extra={**extra, "outage": self.service})
            self.down_since, self.failures = None, 0


def reset_connection() -> None:
    """Drop this thread's connection after a failure, so the next query opens a new one."""
    try:
        connection.close()
    except Exception:  # closing a dead socket can fail too; Django forgets it either way
        pass


# A thread's connection is health-checked (CONN_HEALTH_CHECKS: a `SELECT 1` before its next query)
# when it sat idle this long, not before every unit of work of a busy loop: a worker's delivery,
# its broker's polls and acknowledgements, an executor's next run and a pool thread's next step each
# checked it — four to five round trips per three-step task, ~10% of the workers' CPU with 1,000
# tasks in flight (py-spy, bench/compare.py --only latency). A session that breaks between two
# uses closer than this fails the later one, which its caller retries on a new connection.
IDLE_CHECK_SECONDS = 1.0
_last_check = threading.local()


def check_connection_if_idle(*, force: bool = False) -> None:
    """Before a unit of work on this thread: Django's close_old_connections (the connection
    replaced if broken, past CONN_MAX_AGE or left outside autocommit; health-checked at its next
    query) if it sat idle for IDLE_CHECK_SECONDS, an error occurred on it, or `force`; otherwise
    nothing, and no ping even if Django's own hooks (django-q2's before each task) asked for one.
    So a busy thread keeps its connection past CONN_MAX_AGE until its first idle second (SQLite's,
    CONN_MAX_AGE 0, too: reopened after an idle second, not before every unit of work)."""
    now = time.monotonic()
    last = getattr(_last_check, "at", None)
    fresh = (not force and last is not None and now - last < IDLE_CHECK_SECONDS
             and not connection.errors_occurred and connection.autocommit)
    if connection.connection is None:
        pass  # none open: the next query opens one (nothing to check or close)
    elif fresh:
        connection.health_check_done = True  # Django's flag: the ping its hooks asked for is not needed
    else:
        close_old_connections()
    _last_check.at = now


def retry_while_down(attempt, *, seconds: float, logger: logging.Logger, what: str, extra: dict | None = None,
                     on_failure=None):
    """Call `attempt()` until it gets past a database outage (or `seconds` run out: then the
    last error is raised). `on_failure()` undoes in-memory state after each failed try."""
    deadline = time.monotonic() + seconds
    delay = 0.1
    while True:
        try:
            return attempt()
        except DATABASE_DOWN as exc:
            note_database_unreachable()
            if on_failure:
                on_failure()
            if time.monotonic() + delay > deadline:
                raise
            if delay == 0.1:
                logger.warning("%s waits for the database (%s)", what, type(exc).__name__,
                               extra={**(extra or {}), "outage": "database"})
            reset_connection()
            time.sleep(delay)
            delay = min(delay * 2, 2.0)


class DatabaseOutageMiddleware:
    """A page or API call that finds the database unreachable answers 503 with a message a
    person can act on (and Retry-After), not a 500 with a traceback."""

    RETRY_AFTER_SECONDS = 5

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        return self.get_response(request)

    def process_exception(self, request, exception):
        if not isinstance(exception, DATABASE_DOWN):
            return None
        from django.http import HttpResponse, JsonResponse
        from django.template.loader import render_to_string

        logging.getLogger(__name__).warning("request failed: database unreachable (%s)", type(exception).__name__,
                                            extra={"outage": "database", "path": request.path})
        message = ("The database is unreachable right now. Nothing was lost: running tasks wait and continue "
                   "on their own. Try again in a few seconds.")
        if request.path.startswith("/api/"):
            response = JsonResponse({"detail": message}, status=503)
        else:
            response = HttpResponse(render_to_string("database_unreachable.html", {"message": message,
                                                                                 "retry": self.RETRY_AFTER_SECONDS}),
                                    status=503)
        response["Retry-After"] = str(self.RETRY_AFTER_SECONDS)
        return response
