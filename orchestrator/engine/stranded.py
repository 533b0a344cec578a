"""Tasks whose broker message a worker cluster took and never ran: stranded in a dead host's
prefetch, told apart from the tasks merely waiting in the broker so that they go first.

A django-q2 cluster takes messages ahead of running them (its internal queue, up to workers²
of them): Redis pops them, the ORM broker locks their rows for `retry`. When a host dies,
those tasks are waiting in the database, nobody will run them, and the sweeper re-sends them
after ORCH_REQUEUE_AFTER_SECONDS (recovery.requeue_unclaimed). Re-sent to the back of a long
queue they would wait for every message ahead of them: minutes behind a real backlog
(bench/hosts.py counted them). So the sweeper's pass looks at the broker once (`look`) and
puts the stranded ones first:

- Redis: the list is read whole (up to REDIS_SCAN messages) and the tasks with a message in it
  are known. A task due for a re-send with no message in the list was taken by a cluster and
  not run (or its send was lost): it is re-sent to the front of the list
  (scheduler.send_first: LPUSH). (This used to be told from send times: a task handed over
  before the oldest message still waiting was taken for stranded. A burst of tasks is handed
  over within milliseconds, so the messages a dead host took from the head of a burst looked as
  new as the head, read as waiting, and were not re-sent until the head passed them:
  bench/hosts.py saw them wait behind the backlog.) A list longer than REDIS_SCAN is not read
  whole every pass: then the send times tell, as before.
- ORM: a message a cluster took is a row locked until `retry` (twice ORCH_JOB_TIMEOUT_SECONDS:
  hours); a waiting task with such a row was taken and not run. It is re-sent ahead of every
  other row (brokers.OrderedORM, which takes rows by id: an id below the smallest). The
  locked row comes back after `retry` as a duplicate (harmless: a claim ignores it).

Tasks in a live cluster's prefetch look the same. They are at most workers² per cluster, and
going first only moves them up a little (the live cluster's own copy then finds the task
claimed: harmless). Nothing here makes a running task give up its slot (unlike a recovery:
lease.should_yield_to_recovered). An empty Redis list has no queue to jump, so nothing is told
apart (after a Redis restart every waiting task is re-sent, in order, as before).

The same look tells which tasks still have a message waiting in the broker: they are not
re-sent at all (a copy behind their own message would only run after it, as a no-op claim;
re-sending every waiting task each window multiplied a backlog's messages: 14,444 ORM rows for
1,000 tasks in bench/hosts.py). Redis: a task with a message in the list (past REDIS_SCAN: a
task handed over after the oldest message still waiting, which the list holds behind it). A
task whose send was lost (a crash between the commit and the send) has no message: it goes
first at once. ORM: a task with a row not taken. A task with no row at all (a lost send) is
re-sent.
"""
import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.utils import timezone

log = logging.getLogger(__name__)

# A hand-over is recorded (enqueued_at) before its message is sent (after the commit): a task
# is taken for stranded only when its last hand-over is older than the head by this much. Small:
# a dead host took its messages from the head of the list, and those behind them were often sent
# within milliseconds (a burst of tasks, a pass of re-sends). A send that lags more (a long
# transaction) may make a waiting task go first once: harmless (a duplicate message).
SEND_LAG = timedelta(seconds=0.1)
# The longest Redis list read whole on a pass (decoding a message takes ~20 µs); a longer one is
# told from send times (its head, HEAD_SCAN deep: the oldest message not put first).
REDIS_SCAN = 10_000
HEAD_SCAN = 200
# The most ORM rows read for the tasks waiting there; beyond it the look does not tell
# (every due task is re-sent, as before).
ORM_SCAN = 20_000


@dataclass
class BrokerView:
    """What one look at the broker tells: which tasks have a message waiting (`waiting`; None
    when there were too many to read); ORM, which tasks have a row a cluster took (`taken`);
    Redis with a list too long to read, when the oldest message still waiting in FIFO order was
    sent (`head_sent_at`)."""

    kind: str
    head_sent_at: datetime | None = None
    taken: set[int] = field(default_factory=set)
    waiting: set[int] | None = None

    def stranded(self, task_id: int, enqueued_at: datetime | None) -> bool:
        """Whether the task's messages have all left the broker without being run (Redis), or
        one of them was taken and not run (ORM)."""
        if self.kind == "orm":
            return task_id in self.taken
        if self.waiting is not None:
            return task_id not in self.waiting
        return enqueued_at is not None and self.head_sent_at is not None and enqueued_at < self.head_sent_at - SEND_LAG

    def in_broker(self, task_id: int, enqueued_at: datetime | None) -> bool:
        """Whether a message of the task is waiting in the broker (so another copy is useless)."""
        if self.kind == "orm":
            return self.waiting is not None and task_id in self.waiting and task_id not in self.taken
        if self.waiting is not None:
            return task_id in self.waiting
        return (enqueued_at is not None and self.head_sent_at is not None
                and enqueued_at >= self.head_sent_at - SEND_LAG)


def look() -> BrokerView | None:
    """One look at the broker for the sweeper's pass; None when it cannot tell (another broker,
    an empty Redis list, an unreadable message, the broker down)."""
    from django_q.brokers import get_broker
    from django_q.brokers.redis_broker import Redis

    from .brokers import OrderedORM

    broker = get_broker()
    try:
        if isinstance(broker, Redis):
            return _look_at_redis(broker)
        if isinstance(broker, OrderedORM):  # django-q2's own ORM broker has no front to put anything at
            taken, waiting = _taken_and_waiting_in_orm(broker)
            return BrokerView("orm", taken=taken, waiting=waiting)
    except Exception as exc:  # a hint only: without it the tasks are re-sent as before
        log.warning("could not look at the broker for stranded messages: %s: %s", type(exc).__name__, exc)
    return None


def _drive_task_id(package: dict) -> int | None:
    from .scheduler import DRIVE

    args = package.get("args") or ()
    return args[0] if package.get("func") == DRIVE and args and isinstance(args[0], int) else None


def _look_at_redis(broker) -> BrokerView | None:
    connection = broker.connection
    length = connection.llen(broker.list_key)
    if length == 0:
        return None
    if length <= REDIS_SCAN:
        from django_q.signing import SignedPackage

        # A message a live cluster pops meanwhile reads as waiting: not re-sent this pass, and
        # it runs (or its cluster dies and the next pass sees it gone).
        waiting = {_drive_task_id(SignedPackage.loads(raw)) for raw in connection.lrange(broker.list_key, 0, -1)}
        return BrokerView("redis", waiting=waiting - {None})
    sent_at = _fifo_head_sent_at(broker)
    return BrokerView("redis", head_sent_at=sent_at) if sent_at is not None else None


def _fifo_head_sent_at(broker) -> datetime | None:
    from django_q.signing import SignedPackage

    from .scheduler import FIRST_PREFIX

    for raw in broker.connection.lrange(broker.list_key, 0, HEAD_SCAN - 1):
        package = SignedPackage.loads(raw)
        if not str(package.get("name") or "").startswith(FIRST_PREFIX):
            return package.get("started")
    return None


def _taken_and_waiting_in_orm(broker) -> tuple[set[int], set[int] | None]:
    """The tasks with a row a cluster took (locked until `retry`), and those with a row waiting
    (None when there are more than ORM_SCAN rows: too many to read every pass)."""
    from django_q.signing import SignedPackage

    now = timezone.now()
    rows = broker.get_connection().filter(key=broker.list_key)
    taken = set()
    for payload in rows.filter(lock__gt=now).values_list("payload", flat=True):
        task_id = _drive_task_id(SignedPackage.loads(payload))
        if task_id is not None:
            taken.add(task_id)
    waiting_rows = list(rows.filter(lock__lte=now).values_list("payload", flat=True)[:ORM_SCAN + 1])
    if len(waiting_rows) > ORM_SCAN:
        return taken, None
    waiting = {_drive_task_id(SignedPackage.loads(payload)) for payload in waiting_rows}
    return taken, waiting - {None}
