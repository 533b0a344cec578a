"""The courier: a thread of the sweeper process (`manage.py recover --loop`, started by
`make run` and deployed beside the workers) that sends the webhook deliveries that are due.

Why the sweeper and not a django-q2 schedule: a schedule runs at most once a minute and takes
a worker slot from the tasks, behind whatever the queue holds; the sweeper is already the one
process every installation runs to look after time-based work (stale leases, wait deadlines,
retention), and polls every second or two. Why a thread of its own: a receiver that takes
its whole timeout must not hold up the recovery of a dead worker's tasks. Several sweepers
may run: each attempt is claimed by a compare-and-set (outbox.claim)."""
import logging
import threading

from django.db import connection

from ..outage import DATABASE_DOWN, OutageWatch
from . import outbox

log = logging.getLogger(__name__)


class Courier(threading.Thread):
    def __init__(self, interval: float = 1.0):
        super().__init__(name="notification-courier", daemon=True)
        self.interval = interval
        self.stopping = threading.Event()

    def run(self) -> None:
        database = OutageWatch(log, "notification courier")
        try:
            while not self.stopping.is_set():
                try:
                    sent = outbox.deliver_due()
                except DATABASE_DOWN as exc:
                    database.failed(exc)
                    sent = []
                except Exception:
                    log.exception("notification courier: a pass failed; trying again")
                    sent = []
                else:
                    database.succeeded()
                if len(sent) < outbox.DUE_PER_PASS:  # a full pass: more may be due at once
                    self.stopping.wait(self.interval)
        finally:
            connection.close()  # this thread's own connection

    def stop(self, timeout: float | None = None) -> None:
        self.stopping.set()
        self.join(timeout)


def start(interval: float = 1.0) -> Courier:
    courier = Courier(interval)
    courier.start()
    return courier
