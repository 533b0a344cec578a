"""On PostgreSQL the web process LISTENs for the NOTIFY each commit sends: events reach an
open page without waiting for the table poll (here set to a minute, so only LISTEN can
deliver them in time)."""
import asyncio

import pytest
from channels.db import database_sync_to_async
from django.db import connection

from orchestrator import live
from orchestrator.engine import services
from tests.live.test_websockets import add_events, connect, events_of, receive_until, session_headers

pytestmark = [pytest.mark.django_db(transaction=True),
              pytest.mark.skipif(connection.vendor != "postgresql", reason="LISTEN/NOTIFY is PostgreSQL's")]


async def test_events_arrive_through_listen_notify_without_the_poll(viewer, settings):
    settings.ORCH_LIVE_POLL_SECONDS = 60
    live.tailer.task = None  # a fresh tailer for this event loop, with the slow poll
    headers = await database_sync_to_async(session_headers)(viewer)
    task = await database_sync_to_async(services.task_create)(type="demo.pipeline", params={})
    ws = await connect(f"/ws/tasks/{task.pk}/", headers)
    state = await ws.receive_json_from(timeout=5)
    await ws.send_json_to({"resume_from": state["seq"]})
    for _ in range(250):  # the listener connects within a few milliseconds
        if live.tailer.listening:
            break
        await asyncio.sleep(0.02)
    assert live.tailer.listening, "the tailer never started listening"
    await add_events(task.pk, 3)
    messages = await receive_until(ws, lambda m: len(events_of(m)) >= 3, timeout=5)
    assert events_of(messages) == [state["seq"] + 1, state["seq"] + 2, state["seq"] + 3]
    await ws.disconnect()
