"""Bad input on the websockets (answered with an error, the socket stays open) and the
origin check (scheme, host and port)."""
import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.conf import settings
from django.test import override_settings

from orchestrator.asgi import application
from orchestrator.engine import services
from orchestrator.origins import origin_allowed
from tests.live.test_websockets import ORIGIN, add_events, connect, events_of, receive_until, session_headers

pytestmark = pytest.mark.django_db(transaction=True)


async def viewer_socket(viewer, query: str = ""):
    task = await database_sync_to_async(services.task_create)(type="demo.pipeline", params={})
    headers = await database_sync_to_async(session_headers)(viewer)
    ws = await connect(f"/ws/tasks/{task.pk}/{query}", headers)
    state = await ws.receive_json_from(timeout=5)
    assert state["type"] == "state"
    return ws, task


async def assert_still_open(ws, task):
    """The socket still works: a valid resume gets the task's events."""
    await ws.send_json_to({"resume_from": 0})
    seq = await add_events(task.pk, 2)
    messages = await receive_until(ws, lambda ms: seq in events_of(ms))
    assert events_of(messages)[-1] == seq


async def test_a_non_numeric_resume_from_in_the_query_is_an_error_message_not_a_crash(viewer):
    ws, task = await viewer_socket(viewer, "?resume_from=abc")
    error = await ws.receive_json_from(timeout=5)
    assert error["type"] == "error" and "resume_from must be an integer seq" in error["message"]
    await assert_still_open(ws, task)
    await ws.disconnect()


@pytest.mark.parametrize("message", ["not json {", '{"resume_from": 1e400}', '{"resume_from": "abc"}',
                                     '{"resume_from": -3}', '{"resume_from": 99999999999999999999999}',
                                     '{"resume_from": true}', '{"resume_from": [1]}', "[1, 2]", '{"hello": 1}'])
async def test_a_bad_message_is_answered_with_an_error_and_the_socket_stays_open(viewer, message):
    ws, task = await viewer_socket(viewer)
    await ws.send_to(text_data=message)
    error = await ws.receive_json_from(timeout=5)
    assert error["type"] == "error", error
    assert error["message"]
    await assert_still_open(ws, task)
    await ws.disconnect()


async def test_a_binary_frame_is_answered_with_an_error(viewer):
    ws, task = await viewer_socket(viewer)
    await ws.send_to(bytes_data=b"\x00\x01")
    assert (await ws.receive_json_from(timeout=5))["type"] == "error"
    await assert_still_open(ws, task)
    await ws.disconnect()


async def test_the_task_list_socket_answers_bad_messages_too(viewer):
    headers = await database_sync_to_async(session_headers)(viewer)
    ws = await connect("/ws/tasks/", headers)
    assert (await ws.receive_json_from(timeout=5))["type"] == "state"
    await ws.send_to(text_data="{{{")
    assert (await ws.receive_json_from(timeout=5))["type"] == "error"
    await ws.send_to(text_data='{"resume_from": 1}')
    assert (await ws.receive_json_from(timeout=5))["type"] == "error"
    await ws.disconnect()


async def test_an_out_of_range_task_id_is_refused_not_a_crash(viewer):
    headers = await database_sync_to_async(session_headers)(viewer)
    communicator = WebsocketCommunicator(application, "/ws/tasks/99999999999999999999/", headers=headers)
    connected, code = await communicator.connect(timeout=5)
    assert not connected and code == 4404


# --- the origin check ---------------------------------------------------------------------------

async def try_origin(viewer, origin: bytes | None, extra=()) -> bool:
    headers = [h for h in await database_sync_to_async(session_headers)(viewer) if h[0] != b"origin"]
    if origin is not None:
        headers.append((b"origin", origin))
    communicator = WebsocketCommunicator(application, "/ws/tasks/", headers=headers + list(extra))
    connected, _ = await communicator.connect(timeout=5)
    if connected:
        await communicator.disconnect()
    return connected


async def test_another_port_on_an_allowed_host_is_refused(viewer):
    assert ORIGIN[0][1] == f"http://localhost:{settings.PORT}".encode()
    assert await try_origin(viewer, f"http://localhost:{settings.PORT}".encode())
    assert await try_origin(viewer, f"http://127.0.0.1:{settings.PORT}".encode())
    assert not await try_origin(viewer, b"http://127.0.0.1:1")
    assert not await try_origin(viewer, b"http://localhost")  # port 80
    assert not await try_origin(viewer, f"https://localhost:{settings.PORT}".encode())  # another scheme
    # Even when the Host header names the port the page came from, the ports must agree.
    assert not await try_origin(viewer, b"http://127.0.0.1:1", [(b"host", f"127.0.0.1:{settings.PORT}".encode())])


async def test_the_connection_s_own_origin_is_allowed_when_its_host_is_allowed(viewer):
    # Behind a proxy on the default port: Host "localhost" (port 80), Origin http://localhost.
    assert await try_origin(viewer, b"http://localhost", [(b"host", b"localhost")])
    assert not await try_origin(viewer, b"http://evil.example.com", [(b"host", b"evil.example.com")])  # not in ALLOWED_HOSTS


@pytest.mark.parametrize("origin, allowed", [
    ("https://orchestrator.example.com", True),
    ("https://orchestrator.example.com:443", True),
    ("http://orchestrator.example.com", False),
    ("https://orchestrator.example.com:8443", False),
    ("https://a.internal.example.org", True),
    ("https://internal.example.org", False),
    ("https://evilinternal.example.org", False),
    ("null", False),
    ("http://host:notaport", False),
    ("", False),
])
def test_origin_rules(origin, allowed):
    with override_settings(CSRF_TRUSTED_ORIGINS=["https://orchestrator.example.com", "https://*.internal.example.org"]):
        assert origin_allowed(origin, {"headers": []}) is allowed
