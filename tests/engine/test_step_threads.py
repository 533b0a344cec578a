"""The threads a run's parallel steps run on are kept between the runs of a process
(engine/step_threads.py): the next run's steps find them with their database connections open,
a pool whose steps were abandoned is never reused, and a forked process never takes its
parent's (their threads did not survive the fork: a job sent to them would never run)."""
import os
import threading

import pytest
from django.db import connection

from orchestrator.engine import services, step_threads
from orchestrator.engine.worker import drive_inline
from tests.support.testtypes import Growing

pytestmark = pytest.mark.django_db(transaction=True)


def test_the_next_run_in_the_process_runs_its_parallel_steps_on_kept_threads_and_connections(settings,
                                                                                             monkeypatch):
    from django.db.backends.signals import connection_created

    settings.ORCH_EXTRA_TASK_TYPES = ["tests.support.testtypes"]
    seen: dict[int, set[int]] = {}
    original = Growing.run_step

    def recording(self, ctx, step_id):
        if step_id.startswith("item-"):
            seen.setdefault(ctx.task_id, set()).add(threading.get_ident())
        return original(self, ctx, step_id)

    connects: list[int] = []

    def opened(sender, connection, **kwargs):
        connects.append(threading.get_ident())

    monkeypatch.setattr(Growing, "run_step", recording)
    first = services.task_create(type="test.growing", params={"items": 3}, limits={"max_subtasks": 3})
    second = services.task_create(type="test.growing", params={"items": 3}, limits={"max_subtasks": 3})
    assert drive_inline(first.pk, watched=True) == "completed"
    alive = {thread.ident for thread in threading.enumerate()}
    connection_created.connect(opened)
    try:
        assert drive_inline(second.pk, watched=True) == "completed"
    finally:
        connection_created.disconnect(opened)
    assert threading.get_ident() not in seen[first.pk] | seen[second.pk]  # three at once: the pool
    # The second run's steps ran on the first run's pool: on threads kept from before it (a
    # pool starts a thread only when all of its threads are busy), never more than its size.
    assert seen[second.pk] & alive
    assert len(seen[first.pk] | seen[second.pk]) <= 3
    if connection.vendor == "postgresql":  # SQLite's connections are not kept (CONN_MAX_AGE 0)
        assert not set(connects) & seen[second.pk] & alive  # ... with the connections they had open


def test_a_pool_whose_steps_were_abandoned_is_not_reused():
    pool = step_threads.take(5)
    blocked = threading.Event()
    pool.submit(blocked.wait, 10)  # a step that ignores its cancellation
    step_threads.give_back(pool, 5, abandon=True)
    try:
        again = step_threads.take(5)
        assert again is not pool
        assert again.submit(lambda: "runs").result(timeout=5) == "runs"
        step_threads.give_back(again, 5, abandon=False)
        assert step_threads.take(5) is again  # a pool given back normally is the next one taken
        step_threads.give_back(again, 5, abandon=False)
    finally:
        blocked.set()


def test_a_forked_process_never_takes_its_parents_pool():
    pool = step_threads.take(6)
    assert pool.submit(lambda: "warm").result(timeout=5) == "warm"  # its thread exists in this process
    step_threads.give_back(pool, 6, abandon=False)
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through the pipe
        try:
            taken = step_threads.take(6)
            answer = b"fresh" if taken is not pool and taken.submit(lambda: 1).result(timeout=5) == 1 else b"parent's"
        except Exception as exc:  # noqa: BLE001
            answer = repr(exc).encode()
        os.write(write, answer)
        os._exit(0)
    os.close(write)
    _, status = os.waitpid(child, 0)
    answer = os.read(read, 200)
    os.close(read)
    assert answer == b"fresh" and status == 0
    assert step_threads.take(6) is pool  # the parent's is still there for the parent
