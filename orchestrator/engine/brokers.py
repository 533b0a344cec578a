"""The ORM broker, taking its messages oldest first, and able to put one ahead of all.

django-q2's ORM broker takes the first rows its query returns, with no ORDER BY: on PostgreSQL
that is the table's physical order, and a new row goes wherever an acknowledged one left room
— often ahead of older rows. Under a backlog (and the sweeper's re-sends) the queue is then in
no order at all, and a message can wait indefinitely behind newer ones: bench/hosts.py saw the
rows of a dead host's prefetch, put back in the queue by the sweeper (engine/stranded.py), not
taken within 120 s. Here the oldest row (by id) goes first: FIFO, as the Redis list is
(Q_CLUSTER["broker_class"], settings.py); and `enqueue_first` puts a message ahead of every
other (an id below the smallest), as LPUSH does on Redis (scheduler.send_first)."""
from time import sleep

from django.db import IntegrityError, transaction
from django.db.models import Min
from django.utils import timezone
from django_q.brokers.orm import ORM
from django_q.conf import Conf


class OrderedORM(ORM):
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
                    return rows.create(id=smallest - 1, key=self.list_key or Conf.CLUSTER_NAME, payload=package,
                                       lock=timezone.now()).pk
            except IntegrityError:
                continue
        return self.enqueue(package)  # never first: at the back, as any message

    def dequeue(self):
        # As django-q2's ORM.dequeue, with the order: take each row with a compare-and-set on its
        # lock (another cluster may have been faster).
        rows = self.get_connection().filter(key=self.list_key, lock__lt=timezone.now()).order_by("id")[:Conf.BULK]
        taken = []
        for row in rows:
            if self.get_connection().filter(id=row.id, lock=row.lock).update(lock=self.timeout(row)):
                taken.append((row.pk, row.payload))
        if taken:
            return taken
        sleep(Conf.POLL)  # an empty queue: spare the CPU
