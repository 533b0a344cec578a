"""No orphaned queued tasks: whatever the broker loses, a task that is runnable in the
database gets run (the sweeper re-sends queued tasks nobody claimed)."""
import subprocess
import sys
from datetime import timedelta

import pytest
from django.utils import timezone
from django_q.brokers import get_broker

from orchestrator.engine import recovery, services
from orchestrator.models import Step, Task
from review.services import review_decide
from tests.conftest import ROOT, process_env, wait_for

pytestmark = pytest.mark.django_db(transaction=True)

PIPELINE = {"stages": 2, "seconds_per_stage": 0.1}


def all_completed(ids) -> bool:
    return Task.objects.filter(pk__in=ids, status="completed").count() == len(ids)


def backdate_enqueue(task_id: int, seconds: float = 120) -> None:
    Task.objects.filter(pk=task_id).update(enqueued_at=timezone.now() - timedelta(seconds=seconds))


@pytest.mark.parametrize("path", ["create", "resume", "review decision"])
def test_a_task_whose_send_was_lost_is_sent_again_by_the_sweeper(path, lost_sends, settings, reviewer):
    settings.ORCH_EXTRA_TASK_TYPES = ["tests.support.testtypes"]
    task = services.task_create(type="demo.pipeline", params=PIPELINE)
    if path == "resume":
        services.task_pause(task_id=task.pk)
        services.task_resume(task_id=task.pk)
    elif path == "review decision":
        from tests.review.conftest import make_review

        item = make_review()
        task = item.task
        review_decide(item_id=item.pk, decision="happened", note="seen", actor=reviewer)
    assert Task.objects.get(pk=task.pk).status == "queued" and task.pk in lost_sends
    lost_sends.clear()

    assert recovery.requeue_unclaimed() == []  # enqueued just now: the message may still be on its way
    backdate_enqueue(task.pk)
    assert recovery.requeue_unclaimed() == [task.pk] and lost_sends == [task.pk]
    assert recovery.requeue_unclaimed() == []  # once per ORCH_REQUEUE_AFTER_SECONDS, and by one sweeper


def test_a_claimed_or_finished_task_is_never_sent_again(lost_sends):
    task = services.task_create(type="demo.pipeline", params=PIPELINE)
    backdate_enqueue(task.pk)
    Task.objects.filter(pk=task.pk).update(lease_owner="host:1:abc", heartbeat_at=timezone.now())
    assert recovery.requeue_unclaimed() == []
    Task.objects.filter(pk=task.pk).update(lease_owner="", status="completed")
    assert recovery.requeue_unclaimed() == []


@pytest.mark.workers
def test_frozen_workers_lost_messages_every_task_completes(start_workers, start_sweeper):
    cluster = start_workers(2)
    wait_for(lambda: len(cluster.worker_pids()) >= 2, timeout=60, message="the cluster's workers to start")
    cluster.freeze()
    ids = [services.task_create(type="demo.pipeline", params=PIPELINE).pk for _ in range(4)]
    get_broker().purge_queue()  # every message for these tasks is gone
    cluster.thaw()
    start_sweeper(ORCH_REQUEUE_AFTER_SECONDS=1)
    wait_for(lambda: all_completed(ids), timeout=90, message="every task to complete")
    # Duplicated messages were harmless: each stage ran once.
    assert set(Step.objects.filter(task_id__in=ids).values_list("attempts", flat=True)) == {1}


@pytest.mark.workers
def test_redis_broker_restarted_while_tasks_run_every_task_completes(start_workers, start_sweeper, private_redis):
    import redis

    env = {"REDIS_URL": private_redis.url, "ORCH_REQUEUE_AFTER_SECONDS": 1}
    start_workers(2, **env)
    start_sweeper(**env)
    # Created by another process configured with this Redis, so their messages go to it; more
    # than the cluster prefetches (workers**2 + workers), so some wait in Redis.
    script = ("from orchestrator.engine import services\n"
              "print(*[services.task_create(type='demo.pipeline', params={'stages': 2, 'seconds_per_stage': 0.2}).pk"
              " for _ in range(14)])")
    out = subprocess.run([sys.executable, str(ROOT / "manage.py"), "shell", "-c", script], cwd=ROOT,
                         env=process_env(**env), capture_output=True, text=True, check=True).stdout
    ids = [int(i) for i in out.strip().splitlines()[-1].split()]
    wait_for(lambda: Task.objects.filter(pk__in=ids, status="running").exists(), timeout=60, message="a task running")
    waiting = redis.Redis.from_url(private_redis.url).llen("django_q:orchestrator:q")
    assert waiting > 0, "no message was waiting in the broker: the restart would lose nothing"
    private_redis.restart()  # kill -9: the queued messages die with it
    wait_for(lambda: all_completed(ids), timeout=120,
             message=f"every task to complete: {list(Task.objects.filter(pk__in=ids).values_list('status', flat=True))}")
    assert set(Step.objects.filter(task_id__in=ids).values_list("attempts", flat=True)) == {1}


def test_a_task_waiting_between_slices_is_sent_again_not_counted_as_a_recovery(lost_sends):
    # A healthy task that used up its time slice waits, `running` with no lease holder, for
    # the next worker; its heartbeat ages while every worker is busy. That is no crash.
    task = services.task_create(type="demo.pipeline", params=PIPELINE)
    Task.objects.filter(pk=task.pk).update(status="running", lease_owner="",
                                           heartbeat_at=timezone.now() - timedelta(seconds=600))
    backdate_enqueue(task.pk)
    lost_sends.clear()
    assert recovery.sweep() == []  # nothing recovered ...
    task = Task.objects.get(pk=task.pk)
    assert task.recovery_attempts == 0 and not task.events.filter(kind="recovery").exists()
    assert lost_sends == [task.pk]  # ... but its message is sent again, in case it was lost
