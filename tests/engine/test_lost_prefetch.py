"""Messages lost in a dead host's prefetch run again within a bounded time, under a backlog
(issue 20, item 6; the task issue 14's bench saw not run again for 120 s).

A django-q2 cluster takes messages from the broker ahead of running them (its internal
queue holds up to workers² of them): Redis pops them, the ORM broker locks their rows for
`retry` (twice ORCH_JOB_TIMEOUT_SECONDS). When the cluster is killed, those tasks are queued
in the database, nobody holds them, and their messages are gone. Only the sweeper's re-send
(ORCH_REQUEUE_AFTER_SECONDS) gets them going. It used to look at the 500 newest unclaimed
tasks only: with a backlog of newer ones, the older stranded tasks were never re-sent.

Re-sent, they joined the back of the broker's queue: behind a real backlog (messages waiting
in the broker) they waited for all of it. The sweeper now tells a message a cluster took and
never ran from one waiting in the broker (engine/stranded.py) and puts those tasks first."""
import json
from collections import Counter
from datetime import timedelta

import pytest
from django.utils import timezone
from django_q.conf import Conf
from django_q.models import OrmQ

from orchestrator.engine import services
from orchestrator.models import Task, TaskEvent
from tests.conftest import wait_for

pytestmark = [pytest.mark.workers, pytest.mark.django_db(transaction=True)]

REQUEUE_AFTER = 2
MARGIN = 45  # the sweeper's start (a Django process), a broker poll, two short stages, a loaded CI machine;
# before the fix these tasks never ran again (still queued after minutes), so the bound stays meaningful
BACKLOG = 600  # more than the 500 tasks the sweeper used to look at
BLOCKER = {"mode": "sleep", "steps": 200, "seconds": 0.25}
SHORT = {"stages": 2, "seconds_per_stage": 0.05}


def assert_each_step_ran_once(task_ids) -> None:
    done = Counter(TaskEvent.objects.filter(task_id__in=task_ids, kind="step_done")
                   .values_list("task_id", "payload__step"))
    assert sorted(done) == sorted((t, f"stage-{k:02d}") for t in task_ids for k in (1, 2)), done
    assert set(done.values()) == {1}, done


def messages_taken(broker: str, redis_url: str | None, expected: int) -> bool:
    if broker == "redis":
        import redis

        return redis.Redis.from_url(redis_url).llen("django_q:orchestrator:q") == 0
    return OrmQ.objects.filter(lock__gt=timezone.now()).count() >= expected


def a_cluster_with_four_prefetched(broker: str, use_broker, start_workers):
    """A cluster of 2 workers, both busy (two long blockers), that has taken four more tasks'
    messages from the broker and not started them: (env, cluster, blockers, prefetched)."""
    # The clusters' own schedule must not re-send anything: only the sweeper under test does.
    env = {"ORCH_EXTRA_TASK_TYPES": "tests.support.testtypes", "ORCH_REQUEUE_AFTER_SECONDS": 600}
    redis_url = use_broker(broker, env)
    doomed = start_workers(2, **env)
    blockers = [services.task_create(type="test.interruptible", params=BLOCKER).pk for _ in range(2)]
    wait_for(lambda: Task.objects.filter(pk__in=blockers, status="running").exclude(lease_owner="").count() == 2,
             timeout=60, message="both worker slots busy")
    prefetched = [services.task_create(type="demo.pipeline", params=SHORT).pk for _ in range(4)]
    try:
        wait_for(lambda: messages_taken(broker, redis_url, expected=6), timeout=60,
                 message="the cluster to take the four messages from the broker")
    except AssertionError:
        # The precondition is django-q2's prefetch (its pusher fills the cluster's queue between
        # polls); on a loaded machine it sometimes does not take all four in time (seen once on
        # PostgreSQL in CI). Without it there is nothing lost to recover: say so, do not fail.
        pytest.skip("the cluster did not prefetch the four messages within 60 s: nothing to test this run")
    return env, doomed, blockers, prefetched


@pytest.mark.parametrize("broker", ["orm", "redis"])
def test_tasks_prefetched_by_a_killed_cluster_run_again_within_the_requeue_window(
        broker, use_broker, start_workers, start_sweeper, settings):
    settings.ORCH_EXTRA_TASK_TYPES = ["tests.support.testtypes"]
    env, doomed, blockers, prefetched = a_cluster_with_four_prefetched(broker, use_broker, start_workers)
    assert Task.objects.filter(pk__in=prefetched, lease_epoch=0).count() == 4  # taken, not started
    # A backlog of newer tasks waiting for a worker (their messages are somewhere in the
    # broker, or lost too: the sweeper cannot tell).
    backlog_since = timezone.now()
    Task.objects.bulk_create(Task(type="demo.pipeline", params=SHORT, enqueued_at=backlog_since)
                             for _ in range(BACKLOG))
    survivor = start_workers(2, **env)
    wait_for(lambda: len(survivor.worker_pids()) >= 2, timeout=60, message="the surviving cluster's workers")

    doomed.stop()  # kill -9 of its whole process group: the prefetched messages die with it
    killed = timezone.now()
    for task_id in blockers:  # free the survivor's slots: the stranded tasks are the subject here
        services.task_terminate(task_id=task_id, reason="test: blocker")
    assert Task.objects.filter(pk__in=prefetched, status="queued", lease_owner="").count() == 4
    start_sweeper(ORCH_REQUEUE_AFTER_SECONDS=REQUEUE_AFTER, **{k: v for k, v in env.items()
                                                               if k != "ORCH_REQUEUE_AFTER_SECONDS"})

    wait_for(lambda: Task.objects.filter(pk__in=prefetched, status="completed").count() == 4,
             timeout=REQUEUE_AFTER + MARGIN,
             message=f"the prefetched tasks to run again within {REQUEUE_AFTER + MARGIN} s of the kill")
    waited = timezone.now() - killed
    assert waited < timedelta(seconds=REQUEUE_AFTER + MARGIN)
    # Each step ran once (no duplicate run from a message that came back).
    assert_each_step_ran_once(prefetched)


REAL_BACKLOG = 150  # tasks whose messages wait in the broker: 2 workers need >= 40 s for them
BACKLOG_TASK = {"mode": "sleep", "steps": 1, "seconds": 0.5}


@pytest.mark.parametrize("broker", ["orm", "redis"])
def test_tasks_prefetched_by_a_killed_cluster_go_before_a_real_broker_backlog(
        broker, use_broker, start_workers, start_sweeper, settings):
    """The four tasks a killed cluster had prefetched run again while most of a backlog of
    messages waiting in the broker (sent after theirs) has not run yet: they go first (before:
    re-sent to the back of the queue, they ran after the whole backlog)."""
    from orchestrator.engine.stranded import SEND_LAG

    settings.ORCH_EXTRA_TASK_TYPES = ["tests.support.testtypes"]
    env, doomed, blockers, prefetched = a_cluster_with_four_prefetched(broker, use_broker, start_workers)
    # The backlog's messages are sent after theirs (a hand-over is recorded just before its send).
    last_handover = max(Task.objects.filter(pk__in=prefetched).values_list("enqueued_at", flat=True))
    wait_for(lambda: timezone.now() - last_handover > SEND_LAG, timeout=5, message="the send lag to pass")
    backlog = [services.task_create(type="test.interruptible", params=BACKLOG_TASK).pk
               for _ in range(REAL_BACKLOG)]
    assert Task.objects.filter(pk__in=prefetched, lease_epoch=0).count() == 4  # taken, not started
    survivor = start_workers(2, **env)
    wait_for(lambda: len(survivor.worker_pids()) >= 2, timeout=60, message="the surviving cluster's workers")

    doomed.stop()  # kill -9 of its whole process group: the prefetched messages die with it
    for task_id in blockers:
        services.task_terminate(task_id=task_id, reason="test: blocker")
    sweeper = start_sweeper(ORCH_REQUEUE_AFTER_SECONDS=REQUEUE_AFTER, **{k: v for k, v in env.items()
                                                                         if k != "ORCH_REQUEUE_AFTER_SECONDS"})

    def backlog_left() -> int:
        return Task.objects.filter(pk__in=backlog).exclude(status="completed").count()

    def what_the_sweeper_did() -> str:
        """Its lines about the prefetched tasks (a failure seen once in CI came with none)."""
        ours = [json.loads(line) for line in sweeper.output().splitlines() if line.startswith("{")]
        return "\n".join(json.dumps(r) for r in ours if r.get("task_id") in prefetched
                         or r["message"].startswith("could not look at the broker"))

    # The bound is loose on purpose: what this test proves is the order (the backlog assertion
    # below). Re-sent to the back, the four ran after all 150 (>= 40 s of work for 2 workers).
    try:
        _, left_when_done = wait_for(
            lambda: ("done", backlog_left()) if Task.objects.filter(pk__in=prefetched, status="completed").count() == 4
            else None, timeout=REQUEUE_AFTER + 3 * MARGIN, message="the prefetched tasks to run again")
    except AssertionError as timeout:
        raise AssertionError(f"{timeout}; backlog left: {backlog_left()}; prefetched: "
                             f"{list(Task.objects.filter(pk__in=prefetched).values_list('pk', 'status', 'lease_epoch'))}"
                             f"\nthe sweeper:\n{what_the_sweeper_did()}") from None
    # They went first: most of the backlog, sent after them, was still waiting.
    assert left_when_done > REAL_BACKLOG // 2, \
        f"only {left_when_done} of {REAL_BACKLOG} backlog tasks were left\nthe sweeper:\n{what_the_sweeper_did()}"
    assert_each_step_ran_once(prefetched)


def test_a_look_at_redis_reads_which_tasks_have_a_message_and_tells_nothing_from_an_empty_list(
        private_redis, monkeypatch):
    """What the sweeper's look sees (no workers here: the messages stay in the list): the tasks
    with a message in the list, duplicates put first included. An empty list (a Redis restart)
    has no queue to jump: nothing is told apart."""
    from django_q.signing import SignedPackage

    from orchestrator.engine import scheduler, stranded

    monkeypatch.setattr(Conf, "ORM", None)
    monkeypatch.setattr(Conf, "BROKER_CLASS", None)
    monkeypatch.setattr(Conf, "REDIS", private_redis.url)
    assert stranded.look() is None  # empty list
    old, waiting, newer = (services.task_create(type="demo.pipeline", params=SHORT) for _ in range(3))
    import redis

    client = redis.Redis.from_url(private_redis.url)
    taken = client.lpop("django_q:orchestrator:q")  # a cluster takes the oldest message (and dies)
    assert SignedPackage.loads(taken)["args"] == (old.pk,)
    scheduler.send_first(newer.pk)  # a duplicate put first
    view = stranded.look()
    assert view.kind == "redis" and view.waiting == {waiting.pk, newer.pk}
    for task in (old, waiting, newer):
        task.refresh_from_db()
    assert view.stranded(old.pk, old.enqueued_at)  # its message left the list and never ran
    assert not view.in_broker(old.pk, old.enqueued_at)
    for task in (waiting, newer):
        assert view.in_broker(task.pk, task.enqueued_at) and not view.stranded(task.pk, task.enqueued_at)


def test_a_look_at_a_redis_list_too_long_to_read_tells_from_the_send_time_of_its_head(private_redis, monkeypatch):
    """Past REDIS_SCAN messages the list is not read whole: a task handed over before the oldest
    message still waiting (messages put first are skipped, they are out of order) reads as
    stranded."""
    from django_q.signing import SignedPackage

    from orchestrator.engine import scheduler, stranded

    monkeypatch.setattr(Conf, "ORM", None)
    monkeypatch.setattr(Conf, "BROKER_CLASS", None)
    monkeypatch.setattr(Conf, "REDIS", private_redis.url)
    monkeypatch.setattr(stranded, "REDIS_SCAN", 1)
    old = services.task_create(type="demo.pipeline", params=SHORT)
    wait_for(lambda: timezone.now() - Task.objects.get(pk=old.pk).enqueued_at > stranded.SEND_LAG, timeout=5,
             message="the send lag to pass")
    waiting, newer = (services.task_create(type="demo.pipeline", params=SHORT) for _ in range(2))
    import redis

    client = redis.Redis.from_url(private_redis.url)
    assert SignedPackage.loads(client.lpop("django_q:orchestrator:q"))["args"] == (old.pk,)
    scheduler.send_first(newer.pk)
    view = stranded.look()
    head = Task.objects.get(pk=waiting.pk).enqueued_at
    assert view.kind == "redis" and view.waiting is None and head <= view.head_sent_at < head + timedelta(seconds=1)
    old, waiting = Task.objects.get(pk=old.pk), Task.objects.get(pk=waiting.pk)
    assert view.stranded(old.pk, old.enqueued_at)
    assert not view.stranded(waiting.pk, waiting.enqueued_at)
    assert not view.stranded(newer.pk, Task.objects.get(pk=newer.pk).enqueued_at)


def recorded_sends(monkeypatch) -> list[tuple[str, int]]:
    """The sweeper's sends (which still reach the broker), in order: ("send" | "send_first", id)."""
    from orchestrator.engine import scheduler

    sent = []
    for name in ("send", "send_first"):
        original = getattr(scheduler, name)
        monkeypatch.setattr(scheduler, name, lambda task_id, name=name, original=original:
                            sent.append((name, task_id)) or original(task_id))
    return sent


def test_redis_a_task_whose_message_waits_is_not_re_sent_and_a_lost_send_goes_first(
        use_broker, settings, monkeypatch):
    """Re-sending every waiting task each window multiplied a backlog's messages (14,444 ORM rows
    for 1,000 tasks in bench/hosts.py). A task with its own message in the list gets no copy. A
    send lost between the commit and the broker has no message: it goes first, like a message a
    dead cluster took."""
    import redis
    from django_q.signing import SignedPackage

    from orchestrator.engine import recovery, scheduler

    settings.ORCH_REQUEUE_AFTER_SECONDS = 0
    client = redis.Redis.from_url(use_broker("redis", {}))
    queue = "django_q:orchestrator:q"

    old = services.task_create(type="demo.pipeline", params=SHORT)
    waiting = services.task_create(type="demo.pipeline", params=SHORT)
    with monkeypatch.context() as crash:
        crash.setattr(scheduler, "send", lambda task_id: True)  # committed, never sent
        lost = services.task_create(type="demo.pipeline", params=SHORT)
    assert SignedPackage.loads(client.lpop(queue))["args"] == (old.pk,)  # taken by a cluster that died
    sent = recorded_sends(monkeypatch)

    assert sorted(recovery.requeue_unclaimed()) == sorted([old.pk, lost.pk])
    assert sent == [("send_first", old.pk), ("send_first", lost.pk)]  # waiting's message is in the list
    assert sorted(SignedPackage.loads(m)["args"][0] for m in client.lrange(queue, 0, 1)) == sorted([old.pk, lost.pk])
    assert SignedPackage.loads(client.lindex(queue, -1))["args"] == (waiting.pk,)
    sent.clear()
    assert recovery.requeue_unclaimed() == []  # and again: no copies pile up
    assert sent == []


def test_redis_messages_a_dead_cluster_took_from_the_head_of_a_burst_go_first(use_broker, settings, monkeypatch):
    """A burst of tasks is handed over within milliseconds. A dead host's cluster took the first
    four messages; the rest wait. Told from send times, the four looked as new as the head of
    the list and were not re-sent at all until the head passed them (bench/hosts.py saw them
    wait behind the backlog). Read from the list, they go first in the first pass, and nothing
    else is re-sent."""
    import redis
    from django_q.signing import SignedPackage

    from orchestrator.engine import recovery

    settings.ORCH_REQUEUE_AFTER_SECONDS = 0
    client = redis.Redis.from_url(use_broker("redis", {}))
    queue = "django_q:orchestrator:q"
    burst = [services.task_create(type="demo.pipeline", params=SHORT).pk for _ in range(12)]
    taken = [SignedPackage.loads(client.lpop(queue))["args"][0] for _ in range(4)]
    assert taken == burst[:4]
    sent = recorded_sends(monkeypatch)

    assert sorted(recovery.requeue_unclaimed()) == sorted(taken)
    assert sorted(sent) == sorted(("send_first", task_id) for task_id in taken)
    in_the_list = [SignedPackage.loads(m)["args"][0] for m in client.lrange(queue, 0, -1)]
    assert sorted(in_the_list[:4]) == sorted(taken) and in_the_list[4:] == burst[4:]


def test_orm_a_task_with_a_waiting_row_is_not_re_sent_a_taken_one_goes_first_a_lost_one_goes_back(
        use_broker, settings, monkeypatch):
    from django_q.models import OrmQ

    from orchestrator.engine import recovery, scheduler

    settings.ORCH_REQUEUE_AFTER_SECONDS = 0
    use_broker("orm", {})
    taken = services.task_create(type="demo.pipeline", params=SHORT)
    OrmQ.objects.update(lock=timezone.now() + timedelta(hours=1))  # a cluster took it, and died
    waiting = services.task_create(type="demo.pipeline", params=SHORT)
    with monkeypatch.context() as crash:
        crash.setattr(scheduler, "send", lambda task_id: True)  # committed, never sent
        lost = services.task_create(type="demo.pipeline", params=SHORT)
    assert OrmQ.objects.count() == 2
    sent = recorded_sends(monkeypatch)

    assert sorted(recovery.requeue_unclaimed()) == sorted([taken.pk, lost.pk])
    assert sorted(sent) == [("send", lost.pk), ("send_first", taken.pk)]  # waiting's row is there: no copy
    assert OrmQ.objects.count() == 4
    sent.clear()
    recovery.requeue_unclaimed()
    assert ("send", waiting.pk) not in sent and ("send_first", waiting.pk) not in sent


@pytest.mark.parametrize("broker", ["orm", "redis"])
def test_a_task_whose_turn_a_recovered_task_took_goes_back_to_the_front_of_the_queue(broker, use_broker, monkeypatch):
    """A worker takes the message of the task at the head of the queue and runs a recovered task
    in its slot instead (lease.claim_for_delivery). The task it displaced had waited its turn: it
    is sent again to the front. (At the back, behind a backlog of 900 messages, bench/hosts.py
    saw one not run within 120 s.)"""
    from django_q.brokers import get_broker
    from django_q.signing import SignedPackage

    from orchestrator.engine import worker

    use_broker(broker, {})
    displaced, *backlog = [services.task_create(type="demo.pipeline", params=SHORT).pk for _ in range(4)]
    recovered = services.task_create(type="demo.pipeline", params=SHORT).pk
    Task.objects.filter(pk=recovered).update(recovering_since=timezone.now())
    broker_ = get_broker()
    taken = broker_.dequeue()  # a worker takes the head of the queue: the displaced task's message
    assert [SignedPackage.loads(payload)["args"][0] for _, payload in taken][:1] == [displaced]
    if broker == "orm":  # the rest of what the cluster took goes back: only the head is under test
        OrmQ.objects.filter(pk__in=[pk for pk, _ in taken[1:]]).update(lock=timezone.now() - timedelta(seconds=1))
        OrmQ.objects.filter(pk=taken[0][0]).delete()  # acknowledged
    else:
        for _, payload in reversed(taken[1:]):
            broker_.connection.lpush(broker_.list_key, payload)
    ran = []
    monkeypatch.setattr(worker, "run_isolated", lambda lease: ran.append(lease.task_id) or "completed")
    monkeypatch.setattr(worker, "Runner", lambda lease: type("R", (), {"run": lambda self: ran.append(lease.task_id)
                                                                         or "completed"})())

    worker.drive_task(displaced)

    assert ran == [recovered]  # the recovered task took the slot
    head = broker_.dequeue()[0][1]
    assert SignedPackage.loads(head)["args"][0] == displaced  # and the displaced one is next, not after the backlog
