"""The ORM broker, taking its messages oldest first, and able to put one ahead of all.

django-q2's ORM broker takes the first rows its query returns, with no ORDER BY: on PostgreSQL
that is the table's physical order, and a new row goes wherever an acknowledged one left room
— often ahead of older rows. Under a backlog (and the sweeper's re-sends) the queue is then in
no order at all, and a message can wait indefinitely behind newer ones: bench/hosts.py saw the
rows of a dead host's prefetch, put back in the queue by the sweeper (engine/stranded.py), not
taken within 120 s. Here the oldest row (by id) goes first: FIFO, as the Redis list is
(Q_CLUSTER["broker_class"], settings.py); and `enqueue_first` puts a message ahead of every
other (an id below the smallest), as LPUSH does on Redis (scheduler.send_first).

On PostgreSQL an idle cluster does not poll: every message sent is announced with NOTIFY, and
the cluster's broker waits on LISTEN (at most Q_CLUSTER's `poll` between looks, in case a
notification is lost with its connection). A task starts as soon as its message commits instead
of up to one poll interval later."""
import logging
import os
from time import sleep

import psycopg
from django.db import DEFAULT_DB_ALIAS, IntegrityError, connections, transaction
from django.db.models import Min
from django.utils import timezone
from django_q.brokers.orm import ORM
from django_q.conf import Conf
from django_q.models import OrmQ

from ..outage import DATABASE_DOWN, check_connection_if_idle, reset_connection


log = logging.getLogger(__name__)

QUEUE_CHANNEL = "orchestrator_queue"


class OrderedORM(ORM):
    _listener: psycopg.Connection | None = None
    _listener_pid: int | None = None

    def enqueue(self, package) -> int:
        alias = Conf.ORM or DEFAULT_DB_ALIAS
        database = connections[alias]
        if database.vendor == "postgresql" and transaction.get_autocommit(using=alias):
            # The message and its announce as one statement, committed on its own: one round trip
            # where BEGIN, INSERT, NOTIFY, COMMIT were four (every task created, every slice).
            if database.errors_occurred:  # what django-q2's get_connection checks, without its health ping
                database.close_if_unusable_or_obsolete()
            with database.cursor() as cursor:
                cursor.execute(f'WITH message AS (INSERT INTO {OrmQ._meta.db_table} ("key", payload, lock) '
                               f"VALUES (%s, %s, %s) RETURNING id) SELECT id, pg_notify(%s, '') FROM message",
                               [self.list_key or Conf.CLUSTER_NAME, package, timezone.now(), QUEUE_CHANNEL])
                return cursor.fetchone()[0]
        with transaction.atomic(using=alias):  # the message and its announce: one commit
            pk = super().enqueue(package)
            self.announce()
        return pk

    def announce(self) -> None:
        """Wake a waiting cluster (PostgreSQL): delivered when the message's transaction commits."""
        database = connections[Conf.ORM or DEFAULT_DB_ALIAS]
        if database.vendor == "postgresql":
            with database.cursor() as cursor:
                cursor.execute("SELECT pg_notify(%s, '')", [QUEUE_CHANNEL])

    def wait_for_message(self, timeout: float) -> None:
        """Until a message is announced or `timeout` passes: LISTEN on PostgreSQL, a sleep elsewhere."""
        listener = self.listener()
        if listener is None:
            sleep(timeout)
            return
        try:
            for _ in listener.notifies(timeout=timeout, stop_after=1):
                pass
        except psycopg.Error as exc:  # its connection lost: polled until a new one listens
            log.warning("broker: LISTEN connection lost (%s); polling until it is back", exc)
            self.close_listener()
            sleep(timeout)

    def listener(self) -> psycopg.Connection | None:
        """This process's LISTEN connection (its own, in autocommit; not Django's, which a
        transaction may hold), opened on first use; None on another database or while down."""
        database = connections[Conf.ORM or DEFAULT_DB_ALIAS]
        if database.vendor != "postgresql":
            return None
        if self._listener is not None and self._listener_pid == os.getpid() and not self._listener.closed:
            return self._listener
        try:
            params = database.get_connection_params()
            self._listener = psycopg.connect(**params, autocommit=True)
            self._listener.execute(f"LISTEN {QUEUE_CHANNEL}")
            self._listener_pid = os.getpid()
        except psycopg.Error as exc:
            log.warning("broker: cannot LISTEN for messages (%s); polling", exc)
            self._listener = None
            return None
        return self._listener

    def close_listener(self) -> None:
        if self._listener is not None and self._listener_pid == os.getpid():
            try:
                self._listener.close()
            except psycopg.Error:
                pass
        self._listener = None

    def enqueue_first(self, package) -> int:
        """Put a message ahead of every other: the order is the ids', so it gets one below the
        smallest in the table (ids go down from there; another sender may take the same one
        at once: then the next)."""
        rows = self.get_connection()
        for _ in range(5):
            smallest = rows.aggregate(smallest=Min("id"))["smallest"]
            if smallest is None:  # an empty table (`or 1` took id 0 for empty too: then every
                smallest = 1      # message put first while row 0 lived went to the back)
            try:
                with transaction.atomic(using=rows.db):
                    pk = rows.create(id=smallest - 1, key=self.list_key or Conf.CLUSTER_NAME, payload=package,
                                     lock=timezone.now()).pk
                    self.announce()
                    return pk
            except IntegrityError:
                continue
        return self.enqueue(package)  # never first: at the back, as any message

    @staticmethod
    def get_connection(list_key: str = None):
        """django-q2's, without a health ping before each statement: its version closes old
        connections on every call (a dequeue pinged before its read and before each row's claim,
        an acknowledgement before its delete); here the connection is checked when it sat idle,
        and a statement that finds it broken is retried once on a new one (`_once_more`)."""
        alias = Conf.ORM or DEFAULT_DB_ALIAS
        if alias == DEFAULT_DB_ALIAS and transaction.get_autocommit(using=alias):
            check_connection_if_idle()
            return OrmQ.objects.using(alias)
        return ORM.get_connection(list_key)

    def dequeue(self):
        return _once_more(self._dequeue)

    def delete(self, task_id):
        return _once_more(lambda: super(OrderedORM, self).delete(task_id))

    def _dequeue(self):
        # As django-q2's ORM.dequeue, with the order: take each row with a compare-and-set on its
        # lock (another cluster may have been faster).
        rows = self.get_connection().filter(key=self.list_key, lock__lt=timezone.now()).order_by("id")[:Conf.BULK]
        taken = []
        for row in rows:
            if self.get_connection().filter(id=row.id, lock=row.lock).update(lock=self.timeout(row)):
                taken.append((row.pk, row.payload))
        if taken:
            return taken
        self.wait_for_message(Conf.POLL)  # an empty queue: spare the CPU


def _once_more(attempt):
    """`attempt()`, and once more on a new connection if the first found its session broken (not
    health-checked: it was used less than outage.IDLE_CHECK_SECONDS ago). A database that is down
    fails the second try too, as django-q2's pusher and monitor expect. Rows a broken dequeue had
    claimed come back after Q_CLUSTER's `retry`, as a dead cluster's do."""
    try:
        return attempt()
    except DATABASE_DOWN:
        reset_connection()
        return attempt()
