"""A recovered task runs before the tasks merely queued (lease.claim_for_delivery,
worker.drive_task), with a real worker process, on the ORM broker and on Redis.

One worker slot, a task running and three queued behind it: the running task's executor is
killed (kill -9), its watchdog recovers it at once and sends its message to the back of the
queue. The next message the slot takes names a queued task; the recovered task must run
first, and the queued task whose turn it took must still run (no sweeper re-sends it here,
so only the worker sending it again can get it going)."""
import os
import signal
from datetime import timedelta

import pytest
from django.utils import timezone

from orchestrator.engine import services
from orchestrator.engine.lease import claim_for_delivery
from orchestrator.models import Task, TaskEvent
from tests.conftest import wait_for

pytestmark = [pytest.mark.workers, pytest.mark.django_db(transaction=True)]

TEST_TYPES = {"ORCH_EXTRA_TASK_TYPES": "tests.support.testtypes"}
STEPS = 8


def steps_done(task_id: int) -> list[TaskEvent]:
    return list(TaskEvent.objects.filter(task_id=task_id, kind="step_done").order_by("seq"))


def test_a_delivery_claims_the_task_whose_recovery_began_first_whatever_its_id_and_then_its_own(settings):
    settings.ORCH_EXTRA_TASK_TYPES = ["tests.support.testtypes"]
    named, recovered_later, recovered_first = (
        services.task_create(type="test.interruptible", params={"mode": "sleep", "steps": 1, "seconds": 0}).pk
        for _ in range(3))
    now = timezone.now()
    Task.objects.filter(pk=recovered_later).update(recovering_since=now)
    Task.objects.filter(pk=recovered_first).update(recovering_since=now - timedelta(minutes=1))
    # Every call is a delivery of the named task's message; each takes a lease on a new task.
    assert [claim_for_delivery(named).task_id for _ in range(3)] == [recovered_first, recovered_later, named]
    assert claim_for_delivery(named) is None  # all three held now: a duplicate delivery claims nothing


@pytest.mark.parametrize("broker", ["orm", "redis"])
def test_a_recovered_task_runs_before_the_tasks_queued_behind_it(broker, use_broker, start_workers, settings):
    settings.ORCH_EXTRA_TASK_TYPES = ["tests.support.testtypes"]
    # The sweeper's schedule (every minute, in the cluster) must not re-send the task whose
    # turn was taken: only the worker sending it again may get it going.
    env = {**TEST_TYPES, "ORCH_REQUEUE_AFTER_SECONDS": 600}
    use_broker(broker, env)
    start_workers(1, **env)
    ids = [services.task_create(type="test.interruptible", params={"mode": "sleep", "steps": STEPS, "seconds": 0.25}).pk
           for _ in range(4)]
    # Whichever the slot took first (the ORM broker does not promise FIFO) is the victim,
    # killed once it has committed a step; the other three are queued behind it.
    victim = wait_for(lambda: Task.objects.filter(pk__in=ids, status="running", worker_pid__isnull=False)
                      .exclude(lease_owner="").first(), timeout=60, message="a task running")
    wait_for(lambda: steps_done(victim.pk), timeout=30, message="the victim's first step")
    victim.refresh_from_db()
    queued = [i for i in ids if i != victim.pk]
    assert Task.objects.filter(pk__in=queued, lease_epoch=0).count() == 3  # not one claimed yet
    os.kill(victim.worker_pid, signal.SIGKILL)

    wait_for(lambda: Task.objects.filter(pk__in=ids, status="completed").count() == 4, timeout=90,
             message="every task to complete (the one whose turn was taken too)")
    recovery = TaskEvent.objects.get(task_id=victim.pk, kind="recovery")
    resumed = [e for e in steps_done(victim.pk) if e.seq > recovery.seq]
    assert resumed and len(steps_done(victim.pk)) == STEPS  # continued from its checkpoint, no step twice
    # One slot runs one task at a time: the recovered task's run came before any queued task's.
    firsts = {i: steps_done(i)[0].created_at for i in queued}
    assert all(resumed[0].created_at < first for first in firsts.values()), (resumed[0].created_at, firsts)
    assert all(len(steps_done(i)) == STEPS for i in queued)


def test_a_running_task_gives_its_slot_to_a_task_recovered_from_a_dead_host(start_workers, start_sweeper, settings):
    """Every slot busy: a task that a dead host held must not wait for a whole run elsewhere.
    The one slot's task ends its slice at a step boundary (leases.should_yield_to_recovered),
    the recovered task runs, and the yielding task goes on afterwards from its checkpoint."""
    from datetime import timedelta

    from django.utils import timezone

    settings.ORCH_EXTRA_TASK_TYPES = ["tests.support.testtypes"]
    start_workers(1, **TEST_TYPES, ORCH_REQUEUE_AFTER_SECONDS=600)
    long = services.task_create(type="test.interruptible", params={"mode": "sleep", "steps": 80, "seconds": 0.25})
    wait_for(lambda: steps_done(long.pk), timeout=60, message="the long task's first step")
    # A task a host that just died was running (its heartbeat stopped a minute ago).
    stale = timezone.now() - timedelta(seconds=60)
    orphan = Task.objects.create(type="test.interruptible", params={"mode": "sleep", "steps": 4, "seconds": 0.1},
                                 status="running", lease_owner="dead-host:4242:gone", lease_epoch=1,
                                 worker_host="dead-host", heartbeat_at=stale, started_at=stale)
    start_sweeper(**TEST_TYPES, ORCH_REQUEUE_AFTER_SECONDS=600)

    wait_for(lambda: Task.objects.get(pk=orphan.pk).status == "completed", timeout=60,
             message="the recovered task to run in the busy slot")
    long.refresh_from_db()
    assert long.status == "running" and len(steps_done(long.pk)) < 80  # it gave its slot; it had not finished
    wait_for(lambda: Task.objects.get(pk=long.pk).status == "completed", timeout=90, message="the long task")
    long.refresh_from_db()
    assert long.lease_epoch >= 2 and len(steps_done(long.pk)) == 80  # claimed again, no step twice
    assert len(steps_done(orphan.pk)) == 4


@pytest.mark.django_db
def test_the_runs_that_yield_are_the_settled_ones_with_the_lowest_ids_as_many_as_recovered_tasks_wait():
    """The choice every runner makes alone must agree: as many runs yield as recovered tasks
    wait, the lowest ids among the runs that have held their slot a heartbeat or more. A run
    claimed just now (a recovered task that has only just got its slot) never yields, and it
    does not hold back the next one in line."""
    from datetime import timedelta

    from django.utils import timezone

    from orchestrator.engine import lease as leases

    now = timezone.now()

    def running(claimed_ago: float) -> int:
        return Task.objects.create(type="test.interruptible", status="running", lease_owner="h:1:x", lease_epoch=1,
                                   heartbeat_at=now, claimed_at=now - timedelta(seconds=claimed_ago)).pk

    just_claimed, settled_a, settled_b, settled_c = running(0.1), running(5), running(5), running(5)
    assert not any(leases.should_yield_to_recovered(t) for t in (just_claimed, settled_a, settled_b))  # none waits
    recovered = [Task.objects.create(type="test.interruptible", status="running", lease_owner="",
                                     recovering_since=now - timedelta(seconds=3),
                                     enqueued_at=now - timedelta(seconds=1)) for _ in range(2)]
    assert [leases.should_yield_to_recovered(t) for t in (just_claimed, settled_a, settled_b, settled_c)] == \
        [False, True, True, False]
    Task.objects.filter(pk=recovered[0].pk).update(lease_owner="h:2:y", claimed_at=now)  # one got a slot
    assert [leases.should_yield_to_recovered(t) for t in (just_claimed, settled_a, settled_b, settled_c)] == \
        [False, True, False, False]


def test_the_supervisors_poll_sees_what_the_orm_queries_see():
    """lease.poll (the supervisor's query, written out in SQL): the task's control, lease and inbox
    sequence, and recovered_waiting exactly when lease.recovered_waiting() finds a task."""
    from orchestrator.engine import lease as leases

    polled = services.task_create(type="agent.plan_execute", params={"goal": "g", "tools": []})
    other = services.task_create(type="agent.plan_execute", params={"goal": "g", "tools": []})
    Task.objects.filter(pk=polled.pk).update(control="pause", lease_epoch=7, lease_owner="w:1", inbox_seq=3)
    assert leases.poll(polled.pk) == {"control": "pause", "lease_epoch": 7, "lease_owner": "w:1", "inbox_seq": 3,
                                      "recovered_waiting": False}
    assert leases.poll(10**9) is None
    long_ago = timezone.now() - timedelta(minutes=1)
    for change, waiting in (({"recovering_since": long_ago, "enqueued_at": timezone.now()}, False),  # just queued
                            ({"enqueued_at": long_ago}, True),
                            ({"lease_owner": "w:2"}, False),  # claimed already
                            ({"lease_owner": "", "status": "paused"}, False),
                            ({"status": "running"}, True),
                            ({"recovering_since": None}, False)):
        Task.objects.filter(pk=other.pk).update(**change)
        assert leases.recovered_waiting().exists() is waiting, change
        assert leases.poll(polled.pk)["recovered_waiting"] is waiting, change
