"""Hands tasks to the worker cluster (django-q2) — only after the transaction commits, so
a worker never looks for a task that is not there yet.

The broker is a hint, not the truth: a message can be lost (a Redis restart; a crash
between the commit and the send). `enqueued_at` records each hand-over, and the sweeper
re-sends a queued task that nobody claimed for ORCH_REQUEUE_AFTER_SECONDS
(recovery.requeue_unclaimed). Claims are compare-and-set, so a duplicate is harmless.

A message is a turn on a worker slot rather than an order to run that very task: a worker
runs a task being recovered before the one its message names, and hands that one to the
broker again, ahead of the queue (`send_again`; worker.drive_task and lease.claim_for_delivery
say why)."""
import logging

from datetime import datetime

from django.db import transaction
from django.utils import timezone

from ..models import Task, TaskStatus as S

log = logging.getLogger(__name__)

DRIVE = "orchestrator.engine.worker.drive_task"


def enqueue(task_id: int) -> datetime:
    """Send the task to a worker once the transaction commits; returns its new `enqueued_at`."""
    now = timezone.now()
    Task.objects.filter(pk=task_id).update(enqueued_at=now)
    transaction.on_commit(lambda: send(task_id))
    return now


def enqueue_new(task: Task) -> None:
    """`enqueue` for a task about to be inserted in this transaction: its `enqueued_at` is set
    on the instance (the INSERT saves it), its message goes once the transaction commits."""
    task.enqueued_at = timezone.now()
    transaction.on_commit(lambda: send(task.pk))


def send_again(task_id: int) -> bool:
    """A worker used this task's message to run a recovering task: send it again, if it is
    still waiting for a worker (not claimed meanwhile through a duplicate message, not
    finished). It goes to the FRONT of the queue (send_first): its message had reached a worker,
    so it had waited its turn already. (It used to go to the back: under a backlog of 900
    messages, bench/hosts.py saw such a task not run within 120 s.) False when there was
    nothing to send or the broker is down (then the sweeper re-sends it after
    ORCH_REQUEUE_AFTER_SECONDS, as for a lost message)."""
    if not Task.objects.filter(pk=task_id, status__in=(S.QUEUED, S.RUNNING), lease_owner="").update(
            enqueued_at=timezone.now()):
        return False
    return send_first(task_id)


try:
    from redis.exceptions import ConnectionError as RedisConnectionError, TimeoutError as RedisTimeoutError
    BROKER_DOWN: tuple = (OSError, RedisConnectionError, RedisTimeoutError)
except ImportError:  # pragma: no cover - redis is a dependency
    BROKER_DOWN = (OSError,)


def send(task_id: int) -> bool:
    """Hand the task to the broker; False (and a warning) when the broker is unreachable —
    the task is not lost: the sweeper re-sends it after ORCH_REQUEUE_AFTER_SECONDS."""
    return _send(task_id, name=f"task-{task_id}")


# The name of a message put at the front of the Redis list (send_first): out of FIFO order, so
# a look for the oldest message waiting skips it (stranded.py).
FIRST_PREFIX = "first-"


class _First:
    """A broker whose enqueue puts the message ahead of every other: Redis, at the front of its
    list (LPUSH); the ordered ORM broker, with an id below the smallest (brokers.OrderedORM)."""

    def __init__(self, broker):
        self.broker, self.list_key = broker, broker.list_key

    def enqueue(self, package):
        from .brokers import OrderedORM

        if isinstance(self.broker, OrderedORM):
            return self.broker.enqueue_first(package)
        return self.broker.connection.lpush(self.list_key, package)


def send_first(task_id: int) -> bool:
    """Hand the task to the broker ahead of every message waiting there (Redis; the ordered ORM
    broker); another broker gets it as from `send`. For a task whose message was lost in a dead
    host's prefetch (recovery.requeue_unclaimed)."""
    from django_q.brokers import get_broker
    from django_q.brokers.redis_broker import Redis

    from .brokers import OrderedORM

    broker = get_broker()
    if not isinstance(broker, (Redis, OrderedORM)):
        return send(task_id)
    return _send(task_id, name=f"{FIRST_PREFIX}task-{task_id}", broker=_First(broker))


def _send(task_id: int, *, name: str, **options) -> bool:
    from django_q.tasks import async_task

    try:
        async_task(DRIVE, task_id, task_name=name, group="orchestrator", **options)
    except BROKER_DOWN as exc:
        log.warning("broker unreachable: the sweeper will hand the task over again (%s)", exc,
                    extra={"task_id": task_id})
        return False
    return True
