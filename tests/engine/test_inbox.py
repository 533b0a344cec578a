"""Events into a task (the inbox): sending (validation, dedupe, merge, backpressure), the
operator controls as inbox events with their outcomes, and consumption at resume points —
on the real engine and database. The kill -9 tests are at the end (real workers)."""
import threading
from datetime import timedelta

import pytest
from django.utils import timezone

from orchestrator.engine import inbox, services
from orchestrator.engine.worker import drive_inline
from orchestrator.models import InboundEvent, Step, Task, TaskEvent
from tests.conftest import wait_for
from tests.support.helpers import bearer, settle

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.task_types("tests.support.testtypes")]


def growing(**params) -> Task:
    return services.task_create(type="test.growing", params={"effects": False, **params}, limits={"max_subtasks": 1})


def send(task, type="instruction", **kwargs):
    return inbox.send(task_id=task.pk, type=type, **kwargs)


def refused(task, status, message, **kwargs):
    with pytest.raises(inbox.InboxRefused) as caught:
        send(task, **kwargs)
    assert caught.value.status == status, caught.value
    assert message in str(caught.value)
    return caught.value


# --- sending -----------------------------------------------------------------------------------

def test_an_event_sent_to_a_waiting_task_is_consumed_when_it_runs_and_its_steps_join_the_plan():
    task = growing(items=2)
    sent = send(task, payload={"add": 2, "prefix": "extra"})
    assert sent.event.state == "pending" and sent.event.priority == 1 and sent.event.seq == 1
    assert Task.objects.get(pk=task.pk).inbox_pending == 1
    assert drive_inline(task.pk) == "completed"
    event = InboundEvent.objects.get(pk=sent.event.pk)
    assert event.state == "consumed" and event.outcome == "added 2 step(s)" and event.consumed_in_version
    steps = dict(Step.objects.filter(task=task).values_list("step_id", "added_by"))
    assert steps["extra-0"] == steps["extra-1"] == "inbox#1"
    assert Step.objects.get(task=task, step_id="extra-1").status == "done"
    consumed = TaskEvent.objects.get(task=task, kind="inbox_consumed").payload
    assert consumed["events"][0]["seq"] == 1 and consumed["steps_added"] == ["extra-0", "extra-1"]
    assert Task.objects.get(pk=task.pk).inbox_pending == 0


def test_a_message_to_a_running_task_waits_for_the_step_in_flight_and_aborts_nothing():
    task = growing(mode="chain", items=6, link_ms=150)
    runner = threading.Thread(target=drive_inline, args=(task.pk,))
    runner.start()
    try:
        wait_for(lambda: Step.objects.filter(task=task, status="done").count() >= 2, timeout=20,
                 message="two links done")
        sent = send(task, type="user.message", payload={"text": "also total the amounts in EUR"})
        wait_for(lambda: InboundEvent.objects.get(pk=sent.event.pk).state == "consumed", timeout=20,
                 message="the message consumed")
    finally:
        runner.join(timeout=30)
    task = Task.objects.get(pk=task.pk)
    assert task.status == "completed"
    event = InboundEvent.objects.get(pk=sent.event.pk)
    assert event.outcome == "noted: also total the amounts in EUR"
    # Applied between two steps: no link was interrupted or run twice.
    assert set(Step.objects.filter(task=task).values_list("attempts", flat=True)) == {1}
    assert 2 < event.consumed_in_version < task.checkpoint_version


def test_a_repeated_source_event_id_answers_the_first_event_and_another_payload_is_refused():
    task = growing()
    first = send(task, type="user.message", payload={"text": "hi"}, source_event_id="msg-1")
    again = send(task, type="user.message", payload={"text": "hi"}, source_event_id="msg-1")
    assert again.duplicate and again.event.pk == first.event.pk
    refused(task, 409, "already used", type="user.message", payload={"text": "bye"}, source_event_id="msg-1")
    assert InboundEvent.objects.filter(task=task).count() == 1
    # The same id from another source is another event.
    other = send(task, type="user.message", payload={"text": "hi"}, source_event_id="msg-1", source="user")
    assert not other.duplicate


@pytest.mark.parametrize("kwargs, status, message", [
    ({"type": "nonsense"}, 422, "does not take 'nonsense' events"),
    ({"type": "user.message", "payload": {}}, 422, "payload.text"),
    ({"type": "user.message", "payload": {"text": "x" * 70_000}}, 413, "send a reference"),
    ({"type": "user.message", "payload": {"text": "hi"}, "priority": 0, "source": "user"}, 422, "at P1 at most"),
    ({"type": "user.message", "payload": {"text": "hi"}, "priority": "P2"}, 422, "P2 (recovery)"),
    ({"type": "user.message", "payload": {"text": "hi"}, "priority": 7}, 422, "priority must be 0-4"),
    ({"type": "pause"}, 422, "operator control"),
])
def test_bad_events_are_refused_with_a_reason_and_nothing_is_stored(kwargs, status, message):
    task = growing()
    refused(task, status, message, **kwargs)
    assert not InboundEvent.objects.filter(task=task).exists()


def test_a_task_that_does_not_handle_a_type_refuses_it_naming_what_it_takes():
    task = services.task_create(type="demo.pipeline", params={})
    error = refused(task, 422, "does not take 'user.message'", type="user.message", payload={"text": "hi"})
    assert "progress.external" in str(error)


def test_a_finished_task_takes_no_events_and_its_pending_ones_say_why():
    task = growing(items=1)
    sent = send(task, type="progress.external", payload={"message": "late"})
    services.task_stop(task_id=task.pk)
    assert InboundEvent.objects.get(pk=sent.event.pk).outcome.startswith("not applied: the task ended (stopped)")
    refused(task, 409, "takes no more events", type="user.message", payload={"text": "too late"})


def test_backpressure_refuses_low_priorities_past_their_limits_and_counts_what_it_shed(settings):
    settings.ORCH_INBOX_SHED_P4_AT = 2
    settings.ORCH_INBOX_SHED_P3_AT = 3
    task = growing()
    for i in range(2):
        send(task, type="progress.external", payload={"message": f"p{i}"}, merge_key=f"k{i}")
    error = refused(task, 429, "pending events", type="progress.external", payload={"message": "p2"}, merge_key="k2")
    assert error.retry_after == inbox.RETRY_AFTER_SECONDS and error.pending == 2
    send(task, type="upstream.ready", payload={"resource": "a"})  # P3: its limit is 3
    refused(task, 429, "the limit for P3 is 3", type="upstream.ready", payload={"resource": "b"}, merge_key="b")
    send(task, type="user.message", payload={"text": "P1 always gets through"})
    states = list(InboundEvent.objects.filter(task=task).order_by("seq").values_list("state", flat=True))
    assert states == ["pending", "pending", "shed", "pending", "shed", "pending"]


def test_a_huge_backlog_pauses_the_task(settings):
    settings.ORCH_INBOX_PAUSE_AT = 3
    task = growing()
    for i in range(3):
        send(task, type="user.message", payload={"text": f"m{i}"})
    task = Task.objects.get(pk=task.pk)
    assert task.status == "paused" and "3 events are waiting in its inbox" in task.status_reason


def test_a_burst_of_mergeable_events_collapses_into_the_newest(settings):
    settings.ORCH_INBOX_MERGE_SECONDS = 0.3
    task = growing(mode="chain", items=5, link_ms=150)
    events = [send(task, type="upstream.ready", payload={"resource": "orders", "n": i}, merge_key="orders").event
              for i in range(3)]
    rows = {e.pk: e for e in InboundEvent.objects.filter(task=task)}
    assert [rows[e.pk].state for e in events] == ["merged", "merged", "pending"]
    # The burst collapses into the newest: every merged row points at it.
    assert rows[events[0].pk].superseded_by_id == events[2].pk and rows[events[1].pk].superseded_by_id == events[2].pk
    # Visible ORCH_INBOX_MERGE_SECONDS after it arrived (created_at is stamped a moment after that).
    assert (rows[events[2].pk].visible_at - rows[events[2].pk].created_at).total_seconds() >= 0.2
    assert Task.objects.get(pk=task.pk).inbox_pending == 1
    # Another group is not merged with it.
    other = send(task, type="upstream.ready", payload={"resource": "stock"}, merge_key="stock").event
    assert InboundEvent.objects.get(pk=other.pk).state == "pending"
    assert drive_inline(task.pk) == "completed"
    # Consumed once visible, at a resume point of the run (not at its start: it was not visible yet).
    newest = InboundEvent.objects.get(pk=events[2].pk)
    assert newest.state == "consumed" and newest.outcome.startswith("recorded")
    assert InboundEvent.objects.get(pk=events[0].pk).state == "merged"


def test_an_event_older_than_the_newest_of_its_group_is_recorded_stale_and_never_applied():
    task = growing(mode="chain", items=2)
    now = timezone.now()
    newer = send(task, type="upstream.ready", payload={"resource": "orders", "v": 2}, merge_key="orders",
                 occurred_at=now).event
    late = send(task, type="upstream.ready", payload={"resource": "orders", "v": 1}, merge_key="orders",
                occurred_at=now - timedelta(seconds=30)).event
    assert late.state == "rejected" and late.outcome.startswith("ignored: stale (it occurred at")
    assert InboundEvent.objects.get(pk=newer.pk).state == "pending"  # not superseded by the stale one
    assert Task.objects.get(pk=task.pk).inbox_pending == 1
    # Another group, or no occurred_at, is not compared.
    assert send(task, type="upstream.ready", payload={"resource": "stock"}, merge_key="stock",
                occurred_at=now - timedelta(seconds=60)).event.state == "pending"


# --- the operator controls in the inbox --------------------------------------------------------

def test_controls_on_an_idle_task_are_inbox_events_applied_at_once(make_user):
    olga = make_user("olga", "operator")
    task = growing()
    services.task_pause(task_id=task.pk, actor=olga)
    services.task_resume(task_id=task.pk, actor=olga)
    rows = list(InboundEvent.objects.filter(task=task).order_by("seq").values_list("type", "priority", "state",
                                                                                   "actor_name", "outcome"))
    assert rows[0][:4] == ("pause", 0, "consumed", "olga") and rows[0][4].startswith("applied at once")
    assert rows[1][:4] == ("resume", 1, "consumed", "olga") and rows[1][4].startswith("queued from checkpoint")


def test_a_pause_of_a_running_task_is_acknowledged_by_its_worker():
    task = growing(mode="chain", items=4, link_ms=300)
    runner = threading.Thread(target=drive_inline, args=(task.pk,))
    runner.start()
    try:
        wait_for(lambda: Task.objects.get(pk=task.pk).status == "running", timeout=20, message="running")
        services.task_pause(task_id=task.pk)
        wait_for(lambda: Task.objects.get(pk=task.pk).status == "paused", timeout=20, message="paused")
    finally:
        runner.join(timeout=30)
    event = InboundEvent.objects.get(task=task, type="pause")
    assert event.state == "consumed" and event.outcome.startswith("acknowledged by worker")


# --- the API ------------------------------------------------------------------------------------

def test_the_api_sends_events_answers_repeats_and_refusals_and_lists_the_inbox(client, make_user, settings):
    settings.ORCH_INBOX_SHED_P4_AT = 2
    task = growing()
    headers = bearer(make_user("otto", "operator"))
    url = f"/api/tasks/{task.pk}/events"
    body = {"type": "user.message", "payload": {"text": "hello"}, "source_event_id": "abc"}
    first = client.post(url, body, content_type="application/json", **headers)
    assert first.status_code == 202, first.content
    assert first.json()["state"] == "pending" and first.json()["priority"] == 1
    repeat = client.post(url, body, content_type="application/json", **headers)
    assert repeat.status_code == 200 and repeat.json()["duplicate"] is True
    assert repeat.json()["event_id"] == first.json()["event_id"]
    clash = client.post(url, {**body, "payload": {"text": "other"}}, content_type="application/json", **headers)
    assert clash.status_code == 409
    client.post(url, {"type": "progress.external", "payload": {}}, content_type="application/json", **headers)
    shed = client.post(url, {"type": "progress.external", "payload": {}, "merge_key": "x"},
                       content_type="application/json", **headers)
    assert shed.status_code == 429 and shed["Retry-After"] == "5" and shed.json()["pending"] == 2
    bad = client.post(url, {"type": "user.message", "payload": {"text": 1}}, content_type="application/json",
                      **headers)
    assert bad.status_code == 422 and bad.json()["errors"][0]["field"] == "payload.text"
    paused = client.post(url, {"type": "pause", "source_event_id": "click-1"}, content_type="application/json",
                         **headers)
    assert paused.status_code == 202 and paused.json()["type"] == "pause" and paused.json()["state"] == "consumed"
    again = client.post(url, {"type": "pause", "source_event_id": "click-1"}, content_type="application/json",
                        **headers)
    assert again.status_code == 200 and again.json()["duplicate"] is True
    listed = client.get(f"/api/tasks/{task.pk}/inbox", **headers).json()
    assert [e["type"] for e in listed] == ["pause", "progress.external", "progress.external", "user.message"]
    assert listed[1]["state"] == "shed"
    viewer = bearer(make_user("vera", "viewer"))
    assert client.post(url, body, content_type="application/json", **viewer).status_code == 403
    assert client.get(f"/api/tasks/{task.pk}/events", **viewer).status_code == 200  # the progress log


# --- exactly once across kill -9 ----------------------------------------------------------------

@pytest.mark.workers
@pytest.mark.parametrize("point", ["mid_checkpoint", "after_checkpoint"])
def test_an_event_is_consumed_exactly_once_across_a_kill(point, start_workers, tmp_path):
    task = growing(items=2)
    sent = send(task, payload={"add": 3, "prefix": "extra"})
    start_workers(1, ORCH_EXTRA_TASK_TYPES="tests.support.testtypes", ORCH_FAULTS=f"{point}@inbox:kill-once",
                  ORCH_VAR_DIR=tmp_path)
    task = settle(task.pk)
    assert (tmp_path / "faults" / f"{point}@inbox").exists(), "the crash did not happen"
    assert task.status == "completed" and task.recovery_attempts == 1
    event = InboundEvent.objects.get(pk=sent.event.pk)
    assert event.state == "consumed"
    assert Step.objects.filter(task=task, added_by="inbox#1").count() == 3
    assert TaskEvent.objects.filter(task=task, kind="inbox_consumed").count() == 1


# --- P2: a step that failed outside the task ------------------------------------------------------

def test_a_p2_unit_failed_for_a_pending_step_counts_a_failed_attempt_and_its_retry_policy_applies():
    task = growing(mode="chain", items=3)
    sent = send(task, type="unit.failed", payload={"step": "link-0", "error": "upstream degraded"}).event
    assert sent.priority == 2
    missing = send(task, type="unit.failed", payload={"step": "nope", "error": "x"}).event
    assert drive_inline(task.pk) == "completed"
    assert InboundEvent.objects.get(pk=sent.pk).outcome == "step link-0 counts as a failed attempt; its retry policy applies"
    assert InboundEvent.objects.get(pk=missing.pk).outcome == "rejected: the task has no step 'nope'"
    link = Step.objects.get(task=task, step_id="link-0")
    assert link.status == "done" and link.attempts == 2  # the reported failure, then the retry that passed
    failed = TaskEvent.objects.get(task=task, kind="step_failed")
    assert failed.payload["step"] == "link-0" and "upstream degraded" in failed.payload["error"]


def test_a_p2_unit_failed_cancels_the_running_step_and_past_its_attempts_the_policy_decides(settings):
    settings.ORCH_STEP_MAX_ATTEMPTS = 1
    task = growing(mode="chain", items=2, link_ms=3000)

    def report_when_running():
        wait_for(lambda: any(a.get("label") == "link-0" for a in Task.objects.get(pk=task.pk).activities or []),
                 timeout=20, message="link-0 running")
        send(task, type="unit.failed", payload={"step": "link-0", "error": "the upstream timed out"})

    reporter = threading.Thread(target=report_when_running)
    reporter.start()
    outcome = drive_inline(task.pk)
    reporter.join()
    task = Task.objects.get(pk=task.pk)
    assert outcome == "needs_human" and "the upstream timed out" in task.status_reason
    event = InboundEvent.objects.get(task=task, type="unit.failed")
    assert event.state == "consumed"
    assert event.outcome == ("step link-0 was running: cancelled, and it counts as a failed attempt; its retry "
                             "policy applies")
    # Cancelled long before its 3 s of work were over.
    assert (event.consumed_at - event.created_at).total_seconds() < 2
    assert Step.objects.get(task=task, step_id="link-0").status == "failed"


def test_a_p2_unit_failed_for_a_finished_step_is_rejected_nothing_is_compensated():
    task = growing(mode="chain", items=1)
    assert drive_inline(task.pk) == "completed"
    Task.objects.filter(pk=task.pk).update(status="paused")  # a task at rest that still takes events
    event = send(task, type="unit.failed", payload={"step": "link-0", "error": "late news"}).event
    services.task_resume(task_id=task.pk)
    drive_inline(task.pk)
    assert InboundEvent.objects.get(pk=event.pk).outcome.startswith("rejected: step link-0 is done already")
