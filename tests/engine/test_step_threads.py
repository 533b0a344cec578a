"""The threads a run's parallel steps run on are kept between the runs of a process
(engine/step_threads.py): the next run's steps find them with their database connections open,
a pool whose steps were abandoned is never reused, and a forked process never takes its
parent's (their threads did not survive the fork: a job sent to them would never run)."""
import os
import threading

import pytest
from django.db import connection

from orchestrator import outage
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
        # ... with the connections they had open: a thread that ran an item of the first run (a
        # kept thread that ran none there may have had none yet: CI saw one open it in the second).
        assert not set(connects) & seen[second.pk] & seen[first.pk]


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


def test_a_pool_threads_connection_is_checked_at_its_first_step_of_a_run_not_before_each_step(settings,
                                                                                              monkeypatch):
    """step_threads.before_step: a pool thread's connection is health-checked (a `SELECT 1`) at its
    first step of a run — so a session that died while its kept pool sat idle (here: its server
    process terminated between two runs) is replaced, and no step fails for it — then not again
    while the run's steps follow each other."""
    from django.db import connections

    from orchestrator.models import Step

    if connection.vendor != "postgresql":
        pytest.skip("health checks are PostgreSQL's (CONN_HEALTH_CHECKS; SQLite's connections are not kept)")
    settings.ORCH_EXTRA_TASK_TYPES = ["tests.support.testtypes"]
    backends: dict[int, int] = {}
    original = Growing.run_step

    def recording(self, ctx, step_id):
        if step_id.startswith("item-"):
            from django.db import connection as thread_connection

            with thread_connection.cursor() as cursor:  # a query as a step makes (the check comes before it)
                cursor.execute("SELECT pg_backend_pid()")
                backends[threading.get_ident()] = cursor.fetchone()[0]
        return original(self, ctx, step_id)

    checks: list[int] = []
    real_is_usable = type(connections["default"]).is_usable

    def is_usable(self):
        checks.append(threading.get_ident())
        return real_is_usable(self)

    monkeypatch.setattr(Growing, "run_step", recording)
    first = services.task_create(type="test.growing", params={"items": 3}, limits={"max_subtasks": 3})
    assert drive_inline(first.pk, watched=True) == "completed"
    with connection.cursor() as cursor:  # the kept pool's sessions die while it is idle
        for pid in set(backends.values()):
            cursor.execute("SELECT pg_terminate_backend(%s)", [pid])
    monkeypatch.setattr(type(connections["default"]), "is_usable", is_usable)
    backends.clear()
    second = services.task_create(type="test.growing", params={"items": 12}, limits={"max_subtasks": 3})
    assert drive_inline(second.pk, watched=True) == "completed"
    assert not Step.objects.filter(task=second, attempts__gt=1).exists()  # no step failed for a dead session
    pool_checks = [ident for ident in checks if ident in backends]
    assert 1 <= len(pool_checks) <= 3 < 12, pool_checks  # once per pool thread, not once per step


def test_a_runs_supervisor_polls_on_a_kept_thread_whose_connection_the_next_run_finds_open(settings, monkeypatch):
    """The supervisor's loop (heartbeat, operator requests) runs on a kept thread
    (step_threads.run_kept): the next run's polls come from the same thread and, on PostgreSQL,
    the same session — no connection opened beside the run's first steps, none closed beside its
    end — and once a run has returned that thread is idle (an executor retires when a run leaves
    a thread running). A session that died while the thread sat idle is replaced, not an error."""
    from django.db.backends.signals import connection_created

    from orchestrator.engine import lease as leases

    settings.ORCH_EXTRA_TASK_TYPES = ["tests.support.testtypes"]
    settings.ORCH_CONTROL_POLL_SECONDS = 0.01
    polls: dict[int, list[tuple[threading.Thread, int | None]]] = {}
    polled = threading.Event()
    real_poll, original = leases.poll, Growing.run_step

    def poll(task_id):
        row = real_poll(task_id)  # a dead session fails here, unless it was replaced first
        from django.db import connection as thread_connection

        session = thread_connection.connection.info.backend_pid if thread_connection.vendor == "postgresql" else None
        polls.setdefault(task_id, []).append((threading.current_thread(), session))
        polled.set()
        return row

    def after_a_poll(self, ctx, step_id):
        assert polled.wait(10), "the supervisor never polled"
        return original(self, ctx, step_id)

    monkeypatch.setattr(leases, "poll", poll)
    monkeypatch.setattr(Growing, "run_step", after_a_poll)
    runs = [services.task_create(type="test.growing", params={"items": 2}, limits={"max_subtasks": 1})
            for _ in range(3)]
    assert drive_inline(runs[0].pk, watched=True) == "completed"
    (thread, session), = set(polls[runs[0].pk])
    assert thread in step_threads.kept_threads()  # idle now, waiting for the next run

    opened: list[threading.Thread] = []

    def on_connect(sender, connection, **kwargs):
        opened.append(threading.current_thread())

    polled.clear()
    connection_created.connect(on_connect)
    try:
        assert drive_inline(runs[1].pk, watched=True) == "completed"
    finally:
        connection_created.disconnect(on_connect)
    assert set(polls[runs[1].pk]) == {(thread, session)}
    if connection.vendor == "postgresql":  # SQLite's connections are not kept (CONN_MAX_AGE 0)
        assert thread not in opened
        with connection.cursor() as cursor:  # the idle thread's session dies
            cursor.execute("SELECT pg_terminate_backend(%s)", [session])
    polled.clear()
    assert drive_inline(runs[2].pk, watched=True) == "completed"
    assert {polled_on for polled_on, _ in polls[runs[2].pk]} == {thread}
    assert thread in step_threads.kept_threads()
    if connection.vendor == "postgresql":
        assert session not in {s for _, s in polls[runs[2].pk]}  # replaced at the loop's start


def test_a_database_error_on_a_pool_thread_has_its_next_step_of_the_run_check_the_connection(settings,
                                                                                              monkeypatch):
    """step_threads.before_step's third case: a step whose query failed (the step went on) leaves
    `errors_occurred` on its thread's connection; the next step on that thread has it checked
    (close_old_connections: Django tries the connection and clears the flag) though the run is
    the same and no second has passed — and the steps after it do not."""
    from django.db import DatabaseError

    settings.ORCH_EXTRA_TASK_TYPES = ["tests.support.testtypes"]
    order: list[tuple[str, int, int, bool]] = []  # (step, thread, checks on that thread before it, flag at its start)
    checks: list[int] = []
    original, real_close_old = Growing.run_step, outage.close_old_connections

    def recording(self, ctx, step_id):
        from django.db import connection as thread_connection

        if step_id.startswith("item-"):
            ident = threading.get_ident()
            order.append((step_id, ident, checks.count(ident), thread_connection.errors_occurred))
            if step_id == "item-0":
                try:  # in autocommit: a rollback (the end of an atomic block) would clear the flag
                    with thread_connection.cursor() as cursor:
                        cursor.execute("SELECT no_such_column FROM orchestrator_task")
                except DatabaseError:
                    pass  # the step handles it and goes on; its connection remembers the error
                assert thread_connection.errors_occurred
        return original(self, ctx, step_id)

    def close_old_connections():
        checks.append(threading.get_ident())
        real_close_old()

    monkeypatch.setattr(Growing, "run_step", recording)
    monkeypatch.setattr(outage, "close_old_connections", close_old_connections)
    monkeypatch.setattr(outage, "IDLE_CHECK_SECONDS", 60)  # a slow machine's gaps between steps are not idle
    # Not watched: every step runs on the pool (one thread), one after the other; no effects (an
    # effect's transaction would end with a commit, which clears the flag too).
    task = services.task_create(type="test.growing", params={"items": 4, "effects": False},
                                limits={"max_subtasks": 1})
    assert drive_inline(task.pk) == "completed"
    assert [step for step, *_ in order] == ["item-0", "item-1", "item-2", "item-3"], order
    (thread,) = {ident for _, ident, _, _ in order}
    assert thread != threading.get_ident()
    before = {step: seen for step, _, seen, _ in order}
    # `discover` was the thread's first step of the run (checked then); item-0 was not checked,
    # item-1 was (the error), item-2 and item-3 were not.
    assert before["item-0"] == 1, order
    assert before["item-1"] == 2 and before["item-2"] == 2 and before["item-3"] == 2, order
    assert not any(flag for *_, flag in order), order  # item-1 started with the flag cleared by its check


def test_a_worker_claims_on_a_session_broken_since_its_last_delivery(settings):
    """worker.drive_task does not ping the database before each delivery
    (outage.check_connection_if_idle): a session broken less than a second after the last one
    fails the claim, which is retried on a new connection — the task runs, nothing is lost."""
    from orchestrator.engine.worker import drive_task
    from orchestrator.models import Task
    from tests.support.helpers import terminate_this_threads_session

    if connection.vendor != "postgresql":
        pytest.skip("health checks are PostgreSQL's (CONN_HEALTH_CHECKS; SQLite's connections are not kept)")
    settings.ORCH_ISOLATE_EXECUTION = False  # run in this process, on this thread's connection
    settings.ORCH_EXTRA_TASK_TYPES = ["tests.support.testtypes"]
    first = services.task_create(type="test.growing", params={"items": 1}, limits={"max_subtasks": 1})
    assert drive_task(first.pk) == "completed"
    second = services.task_create(type="test.growing", params={"items": 1}, limits={"max_subtasks": 1})
    terminate_this_threads_session()
    assert drive_task(second.pk) == "completed"
    assert Task.objects.get(pk=second.pk).status == "completed"
