"""verify_action for the whole task page (after Zulip's verify_action): a page loaded once
and then kept up to date by the websocket's fragments must equal a freshly rendered page,
region by region, after every change — steps starting, running side by side, failing and
retrying, completing; a side effect recorded then done; pause and resume; a recovery."""
from datetime import datetime, timedelta

import pytest
from channels.db import database_sync_to_async
from django.db import transaction
from django.test import Client
from django.utils import timezone as django_timezone

from orchestrator.engine import services, states
from orchestrator.engine.events import append_event
from orchestrator.models import Step, Task, TaskStatus as S, WalEntry
from orchestrator.presenters import task_page
from tests.live.test_websockets import connect, receive_until, session_headers
from tests.support.fragments import LivePage

pytestmark = pytest.mark.django_db(transaction=True)

# The page's clock, frozen: a fresh page and a live fragment rendered moments apart must
# show the same heartbeat age and the same end for a running step's bar. In the past, so
# that the recovery event (stamped with the real time) comes after the steps.
NOW = django_timezone.now().replace(microsecond=0) - timedelta(minutes=10)
REGIONS = ("task-header", "task-tabs", "task-cards", "task-timeline", "task-steps", "task-reviews", "task-wal",
           "task-inbox", "task-history", "task-events")


def at(seconds: float) -> datetime:
    return NOW - timedelta(seconds=100) + timedelta(seconds=seconds)


def change(task_id: int, kind: str, payload: dict, *, to: str | None = None, steps: dict | None = None,
           task_fields: dict | None = None, **fields):
    """One change as the runner commits it: step rows, task counters, a status move, and an
    event (the event is what makes the live page refresh)."""
    with transaction.atomic():
        task = states.lock_task(task_id)
        for step_id, values in (steps or {}).items():
            Step.objects.filter(task=task, step_id=step_id).update(**values)
        if task_fields:
            Task.objects.filter(pk=task_id).update(**task_fields)
            task.refresh_from_db()
        if to:
            states.transition(task, to, reason=f"test: {to}", **fields)
        append_event(task, kind, payload)


def record_effect(task_id: int):
    with transaction.atomic():
        task = states.lock_task(task_id)
        WalEntry.objects.create(task=task, step_id="copy-1", call_index=0, tool="http.post",
                                args={"url": "https://example.org/rows", "rows": [1, 2]},
                                idempotency_key=f"task-{task_id}-copy-1-0", idempotent=False, lease_epoch=1)
        append_event(task, "progress", {"message": "posting rows"})


def complete_effect(task_id: int):
    with transaction.atomic():
        task = states.lock_task(task_id)
        WalEntry.objects.filter(task=task).update(status="done", completed_at=at(30))
        append_event(task, "progress", {"message": "rows posted"})


def running(seconds):
    return {"status": "pending", "started_at": at(seconds), "finished_at": None}


def done(started, finished, attempts=1):
    return {"status": "done", "started_at": at(started), "finished_at": at(finished), "attempts": attempts}


CHANGES = [
    ("a worker claims it", lambda t: change(t, "progress", {"message": "claimed"}, to=S.RUNNING,
                                            lease_owner="w:1", worker_host="h", worker_pid=7, heartbeat_at=at(1))),
    ("prepare runs", lambda t: change(t, "progress", {"message": "prepare"}, steps={"prepare": running(2)})),
    ("prepare completes", lambda t: change(t, "step_done", {"step": "prepare", "steps_done": 1, "steps_total": 4},
                                           steps={"prepare": done(2, 10)},
                                           task_fields={"steps_done": 1, "checkpoint_version": 2})),
    ("two copies run side by side", lambda t: change(t, "progress", {"message": "copying"},
                                                     steps={"copy-1": running(11), "copy-2": running(12)})),
    ("a side effect is recorded", record_effect),
    ("copy-1 fails and will retry", lambda t: change(
        t, "step_failed", {"step": "copy-1", "attempt": 1, "error": "boom", "retrying": True},
        steps={"copy-1": {"status": "pending", "finished_at": at(20), "attempts": 1, "error": "Timeout: boom"}})),
    ("the side effect completes", complete_effect),
    ("copy-2 completes and copy-1 runs again", lambda t: change(
        t, "step_done", {"step": "copy-2", "steps_done": 2, "steps_total": 4},
        steps={"copy-2": done(12, 25), "copy-1": {**running(26), "attempts": 1, "error": ""}},
        task_fields={"steps_done": 2, "checkpoint_version": 3, "tokens_used": 120, "active_seconds": 23.5})),
    ("an operator asks for a pause", lambda t: services.task_pause(task_id=t)),
    ("the runner pauses it", lambda t: change(t, "step_done", {"step": "copy-1", "steps_done": 3, "steps_total": 4},
                                              steps={"copy-1": done(26, 40, attempts=2)},
                                              task_fields={"steps_done": 3}, to=S.PAUSED, lease_owner="",
                                              control="")),
    ("an operator resumes it", lambda t: services.task_resume(task_id=t)),
    ("its new worker dies; another recovers it", lambda t: change(
        t, "recovery", {"attempt": 1, "dead_worker": "w:2", "cause": "heartbeat"}, to=S.RUNNING,
        lease_owner="w:3", task_fields={"recovery_attempts": 1})),
    ("the summary runs", lambda t: change(t, "progress", {"message": "summary"}, steps={"summary": running(60)})),
    ("it completes", lambda t: change(t, "step_done", {"step": "summary", "steps_done": 4, "steps_total": 4},
                                      steps={"summary": done(60, 70)}, task_fields={"steps_done": 4},
                                      to=S.COMPLETED, lease_owner="")),
]


def render_page(user, task_id: int) -> str:
    client = Client()
    client.force_login(user)
    response = client.get(f"/tasks/{task_id}/")
    assert response.status_code == 200, response.content[:2000]
    return response.content.decode()


@pytest.mark.parametrize("role", ["operator", "viewer"])
async def test_a_page_kept_live_by_fragments_equals_a_fresh_page(role, make_user, monkeypatch, settings):
    settings.ORCH_LIVE_POLL_SECONDS = 0.05
    monkeypatch.setattr(task_page, "page_clock", lambda: NOW)
    user = await database_sync_to_async(make_user)("olga", role)

    @database_sync_to_async
    def setup() -> Task:
        task = services.task_create(type="demo.migrate_rows", params={"rows": 200, "batch_size": 100})
        plan = [("prepare", [], ["rows"]), ("copy-1", ["prepare"], ["batch_size"]),
                ("copy-2", ["prepare"], ["batch_size"]), ("summary", ["copy-1", "copy-2"], [])]
        for position, (step_id, depends_on, reads) in enumerate(plan):
            Step.objects.create(task=task, step_id=step_id, position=position, title=step_id.title(),
                                depends_on=depends_on, declared_reads=reads)
        Task.objects.filter(pk=task.pk).update(steps_total=len(plan))
        return Task.objects.get(pk=task.pk)

    task = await setup()
    first = await database_sync_to_async(render_page)(user, task.pk)
    page = LivePage(first, last_seq=task.event_seq)
    ws = await connect(f"/ws/tasks/{task.pk}/?resume_from={task.event_seq}",
                       await database_sync_to_async(session_headers)(user))
    fresh = database_sync_to_async(render_page)
    seen_timeline = []

    async def verify(what: str):
        seq = await database_sync_to_async(lambda: Task.objects.get(pk=task.pk).event_seq)()
        messages = await receive_until(ws, lambda got: max([page.last_seq] + [
            m["seq"] for m in got if m["type"] == "event"]) >= seq and any(
            m["type"] == "fragments" and m["seq"] >= seq for m in got))
        for message in messages:
            page.apply(message)
        expected = LivePage(await fresh(user, task.pk))
        for region in REGIONS:
            assert page.region(region) == expected.region(region), f"{region} after {what!r} as {role}"
        seen_timeline.append(expected.region("task-timeline"))

    await verify("the page loaded")
    for what, apply_change in CHANGES:
        await database_sync_to_async(apply_change)(task.pk)
        await verify(what)
    await ws.disconnect()

    # The stream went through what the timeline has to show.
    assert any('data-status="running"' in t and 'data-lane="1"' in t for t in seen_timeline)  # side by side
    assert any('data-status="retrying"' in t for t in seen_timeline)
    assert 'data-retried="yes"' in seen_timeline[-1] and 'data-testid="timeline-recovery"' in seen_timeline[-1]
    controls = page.region("task-controls")
    assert (controls != "") == (role == "operator")


async def test_the_list_socket_sends_rows_rendered_like_the_list_page(viewer, settings):
    settings.ORCH_LIVE_POLL_SECONDS = 0.05
    task = await database_sync_to_async(services.task_create)(type="demo.pipeline", params={})
    other = await database_sync_to_async(services.task_create)(type="demo.pipeline", params={})

    def list_page() -> str:
        client = Client()
        client.force_login(viewer)
        return client.get("/").content.decode()

    page = LivePage(await database_sync_to_async(list_page)())
    ws = await connect("/ws/tasks/", await database_sync_to_async(session_headers)(viewer))
    await database_sync_to_async(services.task_pause)(task_id=task.pk, reason="for the test")
    row = f"task-row-{task.pk}"
    messages = await receive_until(ws, lambda got: any(
        m["type"] == "fragments" and any(f["target"] == row and 'data-status="paused"' in f["html"]
                                         for f in m["fragments"]) for m in got))
    for message in messages:
        page.apply(message)
    await ws.disconnect()
    fresh = LivePage(await database_sync_to_async(list_page)())
    assert 'data-status="paused"' in page.region(row)
    for task_id in (task.pk, other.pk):
        assert page.region(f"task-row-{task_id}") == fresh.region(f"task-row-{task_id}")


@pytest.mark.django_db
def test_only_the_events_the_page_keeps_carry_their_row():
    from orchestrator import live

    task = services.task_create(type="demo.pipeline", params={})
    for i in range(4):
        change(task.pk, "progress", {"message": f"tick {i}"})
    events = live.events_after(task.pk, 0, rows_for_last=2)
    assert [e["seq"] for e in events] == [1, 2, 3, 4, 5]
    assert ["fragments" in e for e in events] == [False, False, False, True, True]
    assert events[-1]["fragments"][0]["target"] == "event-rows" and 'data-seq="5"' in events[-1]["fragments"][0]["html"]
    assert all("fragments" in e for e in live.events_after(task.pk, 3, rows_for_last=5))
