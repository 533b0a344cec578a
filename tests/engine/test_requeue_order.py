"""Stranded tasks are re-sent oldest first, and a backlog starves none of them
(recovery.requeue_unclaimed; issue 20, item 6).

2,000 tasks wait for a worker, none claimed for longer than ORCH_REQUEUE_AFTER_SECONDS
(their messages may be lost). Each pass of the sweeper has a time budget; a clock that
ticks once per look at it makes that budget a fixed number of re-sends, so the figures do
not depend on the machine's speed."""
import math
import random
from datetime import timedelta
from types import SimpleNamespace

import pytest
from django.utils import timezone

from orchestrator.engine import recovery, scheduler
from orchestrator.models import Task

pytestmark = pytest.mark.django_db

STRANDED = 2000
PER_PASS = 300  # re-sends the budget allows per pass (one clock tick per task looked at)


@pytest.fixture
def sends(monkeypatch):
    """The re-sends, in order. The broker is not looked at: these tests are about the order of
    the database's stranded tasks. (A message another test left in the suite's Redis list made
    the look call every task of a pass stranded, and they went by send_first, unrecorded.)"""
    sent = []
    monkeypatch.setattr(recovery.stranded, "look", lambda: None)
    monkeypatch.setattr(scheduler, "send", lambda task_id: sent.append(task_id) or True)
    monkeypatch.setattr(scheduler, "send_first", lambda task_id: pytest.fail(f"task {task_id} sent first"))
    return sent


@pytest.fixture
def ticking_clock(monkeypatch):
    """time.monotonic() for recovery: one second more at every call."""
    ticks = iter(range(10**9))
    monkeypatch.setattr(recovery, "time", SimpleNamespace(monotonic=lambda: float(next(ticks))))


@pytest.fixture
def stranded(settings):
    """{task id: enqueued_at}: queued tasks and tasks between slices (running, no lease holder),
    handed over between 1 and 3 hours ago in an order unrelated to their ids."""
    settings.ORCH_REQUEUE_AFTER_SECONDS = 30
    now = timezone.now()
    ages = list(range(STRANDED))
    random.Random(20).shuffle(ages)
    tasks = Task.objects.bulk_create(
        Task(type="demo.pipeline", status="running" if i % 10 == 0 else "queued", lease_owner="",
             enqueued_at=now - timedelta(hours=1, seconds=age * 3))
        for i, age in enumerate(ages))
    return {t.pk: t.enqueued_at for t in tasks}


def budget_for(re_sends: int) -> float:
    return re_sends + 0.5  # the clock ticks once when the budget starts, then once per task looked at


def test_every_stranded_task_is_re_sent_oldest_first_within_a_bounded_number_of_passes(
        stranded, sends, ticking_clock):
    passes = 0
    while recovery.requeue_unclaimed(budget=budget_for(PER_PASS)):
        passes += 1
        assert passes <= math.ceil(STRANDED / PER_PASS), "more passes than the stranded tasks need"
    assert sorted(sends) == sorted(stranded), "some stranded task was never re-sent, or one twice"
    assert sends == sorted(stranded, key=stranded.get), "not the longest-waiting first"
    # Each one once: a re-sent task is not stranded again before ORCH_REQUEUE_AFTER_SECONDS.
    assert recovery.requeue_unclaimed() == []


def test_under_a_backlog_the_oldest_stranded_task_is_not_starved(stranded, sends, ticking_clock, settings):
    # Passes ORCH_REQUEUE_AFTER_SECONDS apart: every task re-sent by a pass is unclaimed for
    # long enough again at the next one, as in a real backlog (tasks queued behind busy
    # workers look exactly like stranded ones). The newest-first order re-sent the same
    # newest tasks every pass, and the oldest never.
    start = timezone.now()
    first_sent_in = {}
    bound = math.ceil(STRANDED / PER_PASS)
    for number in range(bound):
        now = start + timedelta(seconds=number * settings.ORCH_REQUEUE_AFTER_SECONDS)
        for task_id in recovery.requeue_unclaimed(now=now, budget=budget_for(PER_PASS)):
            first_sent_in.setdefault(task_id, number)
    oldest = min(stranded, key=stranded.get)
    assert oldest in first_sent_in and first_sent_in[oldest] == 0, "the oldest stranded task was not re-sent first"
    assert set(first_sent_in) == set(stranded), (
        f"{STRANDED - len(first_sent_in)} stranded task(s) not re-sent within {bound} passes")
    # And no task was re-sent a second time while another still waited for its first.
    assert len(set(sends[:STRANDED])) == STRANDED


def test_a_task_claimed_or_finished_between_two_passes_is_not_re_sent(stranded, sends, ticking_clock):
    order = sorted(stranded, key=stranded.get)
    assert recovery.requeue_unclaimed(budget=budget_for(PER_PASS)) == order[:PER_PASS]
    claimed, finished = order[PER_PASS], order[PER_PASS + 1]
    Task.objects.filter(pk=claimed).update(lease_owner="host:1:abc", heartbeat_at=timezone.now())
    Task.objects.filter(pk=finished).update(status="completed")
    assert recovery.requeue_unclaimed(budget=budget_for(PER_PASS)) == order[PER_PASS + 2:2 * PER_PASS + 2]
