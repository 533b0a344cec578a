"""Websockets against the real ASGI application: auth, origin, state, gap-free resume,
and events produced by real worker processes (another process than the web one)."""
import asyncio

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.conf import settings

from orchestrator.asgi import application
from orchestrator.engine import services
from orchestrator.engine.events import append_event
from orchestrator.engine.states import lock_task
from orchestrator.models import Task

pytestmark = pytest.mark.django_db(transaction=True)
# A page of this site: the origin the browser sends, port included (see orchestrator/origins.py).
ORIGIN = [(b"origin", f"http://localhost:{settings.PORT}".encode())]


def session_headers(user) -> list:
    from django.test import Client

    client = Client()
    client.force_login(user)
    cookie = client.cookies["sessionid"].value
    return ORIGIN + [(b"cookie", f"sessionid={cookie}".encode())]


async def connect(path: str, headers) -> WebsocketCommunicator:
    communicator = WebsocketCommunicator(application, path, headers=headers)
    connected, code = await communicator.connect(timeout=5)
    assert connected, code
    return communicator


async def receive_until(communicator, predicate, timeout: float = 15.0) -> list[dict]:
    """Collect messages until `predicate(messages)` holds."""
    messages = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate(messages):
        remaining = deadline - loop.time()
        if remaining <= 0:
            raise AssertionError(f"timed out; got {messages[-5:]}")
        messages.append(await communicator.receive_json_from(timeout=remaining))
    return messages


def events_of(messages) -> list[int]:
    return [m["seq"] for m in messages if m["type"] == "event"]


@database_sync_to_async
def add_events(task_id: int, count: int) -> int:
    from django.db import transaction

    for i in range(count):
        with transaction.atomic():
            task = lock_task(task_id)
            append_event(task, "progress", {"message": f"tick {i}"})
    return Task.objects.get(pk=task_id).event_seq


async def test_anonymous_and_roleless_websockets_are_refused(make_user):
    task = await database_sync_to_async(services.task_create)(type="demo.pipeline", params={})
    for path in ("/ws/tasks/", f"/ws/tasks/{task.pk}/"):
        communicator = WebsocketCommunicator(application, path, headers=ORIGIN)
        connected, _ = await communicator.connect(timeout=5)
        assert not connected
        nobody = await database_sync_to_async(make_user)(f"nobody{path.count('/')}")
        communicator = WebsocketCommunicator(application, path, headers=await database_sync_to_async(session_headers)(nobody))
        connected, _ = await communicator.connect(timeout=5)
        assert not connected


async def test_a_foreign_origin_is_refused(viewer):
    headers = await database_sync_to_async(session_headers)(viewer)
    headers = [h for h in headers if h[0] != b"origin"] + [(b"origin", b"http://evil.example.com")]
    communicator = WebsocketCommunicator(application, "/ws/tasks/", headers=headers)
    connected, _ = await communicator.connect(timeout=5)
    assert not connected


async def test_state_then_consecutive_events_then_gap_free_resume(viewer, settings):
    settings.ORCH_LIVE_POLL_SECONDS = 0.05
    headers = await database_sync_to_async(session_headers)(viewer)
    task = await database_sync_to_async(services.task_create)(type="demo.pipeline", params={})
    ws = await connect(f"/ws/tasks/{task.pk}/", headers)
    first = await ws.receive_json_from(timeout=5)
    assert first["type"] == "state" and first["seq"] == 1 and first["status"] == "queued"
    await ws.send_json_to({"resume_from": first["seq"]})
    await add_events(task.pk, 3)
    messages = await receive_until(ws, lambda m: len(events_of(m)) >= 3)
    assert events_of(messages) == [2, 3, 4]
    await ws.disconnect()

    missed_until = await add_events(task.pk, 4)  # while the client is away
    ws = await connect(f"/ws/tasks/{task.pk}/", headers)
    state = await ws.receive_json_from(timeout=5)
    assert state["seq"] == missed_until
    await ws.send_json_to({"resume_from": 4})
    await add_events(task.pk, 2)  # live ones after the replay
    messages = await receive_until(ws, lambda m: len(events_of(m)) >= 6)
    assert events_of(messages) == [5, 6, 7, 8, 9, 10]
    await ws.disconnect()


async def test_resume_from_the_query_string_and_reload_when_ahead(viewer):
    headers = await database_sync_to_async(session_headers)(viewer)
    task = await database_sync_to_async(services.task_create)(type="demo.pipeline", params={})
    await add_events(task.pk, 2)
    ws = await connect(f"/ws/tasks/{task.pk}/?resume_from=0", headers)
    messages = await receive_until(ws, lambda m: len(events_of(m)) >= 3)
    assert messages[0]["type"] == "state"
    assert events_of(messages) == [1, 2, 3]
    await ws.disconnect()
    ws = await connect(f"/ws/tasks/{task.pk}/", headers)
    await ws.receive_json_from(timeout=5)
    await ws.send_json_to({"resume_from": 99})
    assert (await ws.receive_json_from(timeout=5))["type"] == "reload"
    await ws.disconnect()


async def test_the_list_socket_reports_status_changes(viewer, make_user, settings):
    settings.ORCH_LIVE_POLL_SECONDS = 0.05
    headers = await database_sync_to_async(session_headers)(viewer)
    task = await database_sync_to_async(services.task_create)(type="demo.pipeline", params={})
    ws = await connect("/ws/tasks/", headers)
    state = await ws.receive_json_from(timeout=5)
    assert [t["id"] for t in state["tasks"]] == [task.pk]
    await database_sync_to_async(services.task_pause)(task_id=task.pk)
    messages = await receive_until(ws, lambda m: any(x.get("status") == "paused" for x in m))
    assert messages[-1]["id"] == task.pk
    await ws.disconnect()


@pytest.mark.workers
async def test_events_from_a_worker_process_arrive_live_and_in_order(viewer, start_workers, settings):
    settings.ORCH_LIVE_POLL_SECONDS = 0.1
    headers = await database_sync_to_async(session_headers)(viewer)
    await database_sync_to_async(start_workers)(1)
    task = await database_sync_to_async(services.task_create)(
        type="demo.migrate_rows", params={"rows": 600, "batch_size": 100, "rate": 1.0}, limits={"max_subtasks": 1})
    ws = await connect(f"/ws/tasks/{task.pk}/?resume_from=0", headers)
    messages = await receive_until(
        ws, lambda m: any(x["type"] == "event" and x["kind"] == "status" and x["payload"]["to"] == "completed"
                          for x in m), timeout=60)
    seqs = events_of(messages)
    assert seqs == list(range(1, len(seqs) + 1))
    assert sum(1 for m in messages if m["type"] == "event" and m["kind"] == "step_done") == 7
    states = [m for m in messages if m["type"] == "state"]
    assert any(s["status"] == "running" for s in states) or any(
        m["type"] == "event" and m["payload"].get("to") == "running" for m in messages)
    await ws.disconnect()
