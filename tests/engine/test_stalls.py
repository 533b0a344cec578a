"""Stalled tasks (issue 24, item 5; engine/stalls.py): a running task whose step makes no progress
for ORCH_STALL_FACTOR × the p95 of its type's step durations is detected by the sweeper's pass,
its operators are told once per stall (`task.stalled`: a signed webhook to a real receiver, and
an email), the metric `orch_tasks_stalled` counts it, the list shows it, and all of it clears
when the task makes progress again. A real task run inline (its heartbeats publish the running
step), the real sweep, the real courier pass."""
import threading

import pytest
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from orchestrator.engine import recovery, services, stalls
from orchestrator.models import NotificationDelivery, Task
from orchestrator.notifications import TASK_STALLED, outbox
from orchestrator.presenters.waiting import waiting_on
from tests.conftest import wait_for
from tests.notifications.conftest import people, public_url, start_receiver, subscribe  # noqa: F401 (fixtures)
from tests.support.helpers import drive_and_close
from tests.support.stall_types import HANG, RELEASE_ALL

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.task_types("tests.support.stall_types")]

TOKEN = "stall-metrics-token-0123456789abcdef"


@pytest.fixture
def quick_stalls(settings, monkeypatch):
    """Steps of 20 ms: stalled after 2 × p95, but not before 3 s (the floor, 10 s in production)."""
    settings.ORCH_STALL_FACTOR = 2.0
    settings.ORCH_HEARTBEAT_SECONDS = 0.1
    settings.ORCH_METRICS_TOKEN = TOKEN
    monkeypatch.setattr(stalls, "STALL_FLOOR_SECONDS", 3.0)
    HANG.clear()
    RELEASE_ALL.clear()
    yield
    RELEASE_ALL.set()


def stalled_metric(client) -> dict[str, float]:
    response = client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    assert response.status_code == 200
    found = {}
    for family in text_string_to_metric_families(response.content.decode()):
        if family.name == "orch_tasks_stalled":
            found.update({s.labels["type"]: s.value for s in family.samples})
    return found


def running_step(task_id: int) -> str:
    activities = Task.objects.get(pk=task_id).activities or []
    return next((a.get("label", "") for a in activities if a.get("kind") == "step"), "")


def test_a_hung_step_is_detected_told_once_counted_and_cleared_when_progress_resumes(
        quick_stalls, start_receiver, people, public_url, mailoutbox, client):  # noqa: F811
    receiver = start_receiver()
    subscribe(receiver, events=[TASK_STALLED])
    task = services.task_create(type="test.stallable", params={"steps": 8, "hang": ["step-06", "step-07"]})
    runner = threading.Thread(target=drive_and_close, args=(task.pk,), daemon=True)
    runner.start()
    try:
        # Five quick steps give the type its p95; then step-06 hangs with its worker alive.
        wait_for(lambda: running_step(task.pk) == "step-06", timeout=30, message="step-06 to run")
        wait_for(lambda: stalls.sweep() == [task.pk], timeout=30, interval=0.2, message="the stall to be detected")
        hung = Task.objects.get(pk=task.pk)
        assert hung.status == "running" and hung.stalled_since is not None
        assert waiting_on(hung).stalled  # the list's and the page's badge
        assert stalled_metric(client) == {"test.stallable": 1}

        # Told once: later passes (the sweeper's own, through recovery.sweep) tell nothing more.
        for _ in range(3):
            assert stalls.sweep() == []
            recovery.sweep(requeue=False)
        [delivery] = NotificationDelivery.objects.all()
        assert delivery.event == TASK_STALLED
        assert outbox.deliver_due() == [(delivery.pk, True)]
        [request] = receiver.requests()
        assert request.refusal == "" and request.payload["type"] == TASK_STALLED  # verified by the receiver
        data = request.payload["data"]
        assert (data["task_id"], data["task_type"], data["role"], data["step"]) == (
            task.pk, "test.stallable", "operator", "step-06")
        assert data["url"] == f"{public_url}/tasks/{task.pk}/"
        assert data["reason"].startswith("no progress for ") and "in step step-06" in data["reason"]
        assert outbox.deliver_due() == [] and len(receiver.requests()) == 1
        emails = [m for m in mailoutbox if "stalled" in m.subject]
        assert [m.to for m in emails] == [[people["otto"].email]]  # the operators
        assert f"{public_url}/tasks/{task.pk}/" in emails[0].body

        # Progress: step-06 ends and step-07 starts (it hangs too, but has not run long yet).
        HANG["step-06"].set()
        wait_for(lambda: running_step(task.pk) == "step-07", timeout=30, message="step-07 to start")
        assert stalled_metric(client) == {"test.stallable": 0}
        assert stalls.sweep() == []
        assert Task.objects.get(pk=task.pk).stalled_since is None
        assert not waiting_on(Task.objects.get(pk=task.pk)).stalled
        assert NotificationDelivery.objects.count() == 1

        # A new stall (step-07 hangs past the threshold) is a new one: told again, once.
        wait_for(lambda: stalls.sweep() == [task.pk], timeout=30, interval=0.2, message="the second stall")
        assert stalls.sweep() == []
        assert NotificationDelivery.objects.count() == 2
        assert {d.payload["data"]["step"] for d in NotificationDelivery.objects.all()} == {"step-06", "step-07"}
        HANG["step-07"].set()
        runner.join(30)
        assert Task.objects.get(pk=task.pk).status == "completed"
        stalls.sweep()
        assert Task.objects.get(pk=task.pk).stalled_since is None
        assert stalled_metric(client).get("test.stallable", 0) == 0
    finally:
        RELEASE_ALL.set()
        runner.join(30)


def test_two_sweepers_that_saw_the_same_stall_tell_it_once(quick_stalls, start_receiver, monkeypatch):  # noqa: F811
    """The mark is a compare-and-set: a second sweeper that read the rows before the first one
    marked the stall tells nothing."""
    subscribe(start_receiver())
    task = services.task_create(type="test.stallable", params={"steps": 6, "hang": ["step-06"]})
    runner = threading.Thread(target=drive_and_close, args=(task.pk,), daemon=True)
    runner.start()
    try:
        wait_for(lambda: running_step(task.pk) == "step-06", timeout=30, message="step-06 to run")
        wait_for(lambda: stalls.stalled_among(stalls.running_tasks(), timezone.now()), timeout=30, interval=0.2,
                 message="the stall")
        now = timezone.now()
        seen_by_both = stalls.running_tasks()  # both sweepers read the rows before either marks
        monkeypatch.setattr(stalls, "running_tasks", lambda: seen_by_both)
        assert [t.stalled_since for t in seen_by_both] == [None]
        assert (stalls.sweep(now), stalls.sweep(now)) == ([task.pk], [])
        assert NotificationDelivery.objects.filter(event=TASK_STALLED).count() == 1
        assert Task.objects.get(pk=task.pk).stalled_since is not None
    finally:
        RELEASE_ALL.set()
        runner.join(30)
