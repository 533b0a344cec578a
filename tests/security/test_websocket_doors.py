"""Websockets (issue 19, item 8): a deeply nested message is an error message and the socket
stays open (it was a close 1011); an unknown path is refused at the handshake (it was the
router's "No route found" exception)."""
import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator

from orchestrator.asgi import application
from tests.live.test_websocket_hardening import assert_still_open, viewer_socket
from tests.live.test_websockets import connect, session_headers

pytestmark = pytest.mark.django_db(transaction=True)

DEEP = '{"resume_from": ' + "[" * 100_000 + "]" * 100_000 + "}"


@pytest.mark.parametrize("message", [DEEP, '{"resume_from": 1, "x": ' + "[" * 100 + "]" * 100 + "}"])
async def test_a_deeply_nested_message_is_an_error_message_and_the_socket_stays_open(viewer, message):
    ws, task = await viewer_socket(viewer)
    await ws.send_to(text_data=message)
    error = await ws.receive_json_from(timeout=5)
    assert error["type"] == "error" and "nested more than" in error["message"], error
    await assert_still_open(ws, task)
    await ws.disconnect()


async def test_the_task_list_socket_answers_a_deeply_nested_message_too(viewer):
    headers = await database_sync_to_async(session_headers)(viewer)
    ws = await connect("/ws/tasks/", headers)
    assert (await ws.receive_json_from(timeout=5))["type"] == "state"
    await ws.send_to(text_data=DEEP)
    error = await ws.receive_json_from(timeout=5)
    assert error["type"] == "error" and "nested more than" in error["message"], error
    await ws.disconnect()


@pytest.mark.parametrize("path", ["/ws/nowhere/", "/ws/tasks/abc/", "/ws/tasks/1/extra/", "/", "/ws/"])
async def test_an_unknown_websocket_path_is_refused_cleanly(viewer, path):
    headers = await database_sync_to_async(session_headers)(viewer)
    communicator = WebsocketCommunicator(application, path, headers=headers)
    connected, code = await communicator.connect(timeout=5)
    assert not connected and code == 4404
    await communicator.wait()  # the application finished without an exception
