"""The ORM broker takes the oldest message first (engine/brokers.py). django-q2's own takes rows
in the table's physical order: on PostgreSQL, new rows reuse the room acknowledged ones left,
ahead of older messages, so a message put back in the queue (engine/stranded.py) could wait
behind every newer one (bench/hosts.py saw it wait more than 120 s)."""
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone
from django_q.models import OrmQ

from orchestrator.engine.brokers import OrderedORM
from tests.support.helpers import terminate_this_threads_session

pytestmark = pytest.mark.django_db(transaction=True)

KEY = "test-order"


def test_the_orm_broker_takes_the_oldest_message_first_whatever_the_tables_order():
    broker = OrderedORM(list_key=KEY)
    first = [broker.enqueue(f"old-{i}") for i in range(400)]
    OrmQ.objects.filter(pk__in=first[:300]).delete()  # acknowledged: their room is free
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(f"VACUUM {OrmQ._meta.db_table}")  # ... and reusable
    newer = [broker.enqueue(f"new-{i}") for i in range(50)]
    if connection.vendor == "postgresql":
        # The precondition: in the table's order (what django-q2's query returns first) a newer
        # message comes before the 100 older ones still waiting.
        physical = list(OrmQ.objects.filter(key=KEY, lock__lt=timezone.now()).values_list("pk", flat=True)[:1])
        assert physical[0] in newer, "the table kept its order: nothing to test on this PostgreSQL"
    waiting = first[300:]
    taken = [broker.dequeue()[0] for _ in range(3)]
    assert taken == [(waiting[0], "old-300"), (waiting[1], "old-301"), (waiting[2], "old-302")]
    # A taken row is locked (for django-q2's `retry`), and a row put back (its lock released)
    # goes first again: its place is its id.
    OrmQ.objects.filter(pk=waiting[1]).update(lock=timezone.now() - timedelta(seconds=1))
    assert broker.dequeue()[0] == (waiting[1], "old-301")
    assert broker.dequeue()[0] == (waiting[3], "old-303")


def test_a_message_put_first_goes_before_every_waiting_one(monkeypatch):
    """enqueue_first (what the sweeper uses for a task whose message a dead host took): an id
    below the smallest in the table, so it is taken next; two put first go newest first, as
    LPUSH on Redis; then the queue goes on in its order."""
    broker = OrderedORM(list_key=KEY)
    waiting = [broker.enqueue(f"m-{i}") for i in range(5)]
    broker.dequeue()  # a cluster took m-0 (its row stays, locked)
    first = broker.enqueue_first("stranded-a")
    second = broker.enqueue_first("stranded-b")
    assert second < first < min(waiting)
    assert [broker.dequeue()[0][1] for _ in range(4)] == ["stranded-b", "stranded-a", "m-1", "m-2"]
    # The sweeper and the send that goes with it: through the scheduler, as a message it sends.
    from django_q.signing import SignedPackage

    from django_q.conf import Conf

    from orchestrator.engine import scheduler

    # Under this test's own key: a cluster another test left running takes (and deletes) messages
    # under the installation's (seen in CI: the row gone before the assert). And on the ordered ORM
    # broker whatever the run's broker is (with REDIS_URL, send_first would LPUSH to Redis).
    monkeypatch.setattr(Conf, "CLUSTER_NAME", KEY)
    monkeypatch.setattr(Conf, "BROKER_CLASS", "orchestrator.engine.brokers.OrderedORM")
    monkeypatch.setattr(Conf, "ORM", "default")
    assert scheduler.send_first(4242)
    row = OrmQ.objects.order_by("id").first()
    assert row.id < second and SignedPackage.loads(row.payload)["args"] == (4242,)


def test_a_message_is_put_first_when_the_smallest_id_is_zero():
    """Row 0 is what the first message put first gets in a table whose ids start at 1; a dead
    host that took it keeps it locked for hours. Every later message put first went to the back
    meanwhile (the smallest id, 0, was read as "no rows": ids 0 tried five times, then a plain
    enqueue): bench/hosts.py saw a dead host's prefetched tasks re-sent "first" every 5 s, each
    copy behind 400 to 1,000 rows, for minutes."""
    from datetime import timedelta

    from django.utils import timezone

    broker = OrderedORM(list_key=KEY)
    OrmQ.objects.create(id=0, key=KEY, payload="taken by a dead host", lock=timezone.now() + timedelta(hours=2))
    waiting = OrmQ.objects.create(id=5, key=KEY, payload="m-5", lock=timezone.now()).pk
    first = broker.enqueue_first("stranded")
    assert first == -1 and first < waiting
    assert broker.dequeue()[0][1] == "stranded"


def test_an_idle_broker_on_postgresql_wakes_when_a_message_is_sent_not_at_its_next_poll():
    """LISTEN/NOTIFY: a cluster waiting for work (its queue empty) starts a task as soon as the
    task's message commits; elsewhere the wait is the poll interval."""
    import threading
    import time

    from django.db import connections

    waiting = OrderedORM(list_key=KEY)
    if connection.vendor != "postgresql":
        assert waiting.listener() is None
        started = time.monotonic()
        waiting.wait_for_message(0.2)
        assert time.monotonic() - started >= 0.2
        return
    assert waiting.listener() is not None  # listening before the message is sent

    def send_from_another_connection():
        OrderedORM(list_key=KEY).enqueue("wake-up")
        connections.close_all()

    sender = threading.Timer(0.3, send_from_another_connection)
    started = time.monotonic()
    sender.start()
    try:
        waiting.wait_for_message(60)  # a poll interval far longer than the wait for the message
        woke_after = time.monotonic() - started
    finally:
        sender.join()
        waiting.close_listener()
    assert woke_after < 30, f"woke after {woke_after:.1f} s: at the poll's end, not at the message"
    assert waiting.dequeue()[0][1] == "wake-up"


def _pings(monkeypatch) -> list[int]:
    """The health checks (Django's `is_usable`: a `SELECT 1`) made from here on."""
    from django.db import connections

    pings: list[int] = []
    real = type(connections["default"]).is_usable

    def is_usable(self):
        pings.append(1)
        return real(self)

    monkeypatch.setattr(type(connections["default"]), "is_usable", is_usable)
    return pings


def test_a_busy_broker_does_not_ping_the_database_before_each_statement_and_retries_one_a_broken_session_fails(
        monkeypatch):
    """OrderedORM.get_connection: django-q2's pinged (`SELECT 1`) before a dequeue's read, before
    each row's claim and before an acknowledgement's delete. Here a connection used less than
    outage.IDLE_CHECK_SECONDS ago is not pinged; a session that broke meanwhile fails its statement,
    which is retried once on a new connection — the message is still delivered and acknowledged,
    and the pusher (which stops for 10 s on an error) never sees it."""
    if connection.vendor != "postgresql":
        pytest.skip("health checks are PostgreSQL's (CONN_HEALTH_CHECKS; SQLite's connections are not kept)")
    from orchestrator import outage

    monkeypatch.setattr(outage, "IDLE_CHECK_SECONDS", 60)  # a slow machine's gaps are not idle
    broker = OrderedORM(list_key=KEY)
    ids = [broker.enqueue(f"m-{i}") for i in range(4)]
    broker.dequeue()  # the first use on this thread: checked
    pings = _pings(monkeypatch)
    assert [pk for pk, _ in broker.dequeue()] == [ids[1]]
    broker.acknowledge(ids[0])
    broker.acknowledge(ids[1])
    assert pings == []  # fails with django-q2's get_connection: a ping before each statement
    terminate_this_threads_session()
    assert broker.dequeue() == [(ids[2], "m-2")]  # its read failed, then ran on a new session
    terminate_this_threads_session()
    broker.acknowledge(ids[2])
    assert set(OrmQ.objects.filter(key=KEY).values_list("pk", flat=True)) == {ids[3]}
    # A connection left with an error is checked before its next use.
    with pytest.raises(Exception):
        with connection.cursor() as cursor:
            cursor.execute("SELECT no_such_column FROM django_q_ormq")
    assert connection.errors_occurred
    assert broker.dequeue() == [(ids[3], "m-3")]
    assert pings == [1]

