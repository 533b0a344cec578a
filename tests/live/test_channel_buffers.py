"""Memory over a long life (bench/memory.py): with the Redis channel layer, a closed websocket
leaves nothing behind in the web process or in Redis — not its groups (also when daphne
cancels an instance that outlived its close timeout, so disconnect() never ran), not the
messages that arrived for its channel after it stopped receiving (channels_redis buffers
those for good: issue #384)."""
import asyncio

import pytest
from channels.db import database_sync_to_async
from channels.layers import get_channel_layer
from channels.testing import WebsocketCommunicator

from orchestrator import live
from orchestrator.asgi import application
from orchestrator.engine import services
from orchestrator.engine.events import TASK_LIST_GROUP, task_group
from orchestrator.settings import redis_channel_layer
from tests.live.test_websockets import connect, session_headers

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def redis_layer(private_redis, settings):
    settings.CHANNEL_LAYERS = {"default": redis_channel_layer(private_redis.url)}  # production's
    yield private_redis


async def test_an_idle_channel_waits_past_the_pop_timeout_without_an_error(redis_layer, viewer):
    """channels_redis waits for a message with BZPOPMIN for 5 s; redis-py 8's default socket
    timeout (5 s) aborted that read first, so every idle page's consumer raised TimeoutError and
    its socket was closed about every 5 s (channels_redis issue #422). With production's layer
    (settings.redis_channel_layer) a socket idle for 7 s is still open and still gets its
    page's news."""
    ws, _ = await opened("/ws/tasks/", await database_sync_to_async(session_headers)(viewer))
    assert await ws.receive_nothing(timeout=7, interval=0.5)  # no close frame after 7 idle seconds
    task = await database_sync_to_async(services.task_create)(type="demo.pipeline", params={"stages": 1})
    news = await ws.receive_json_from(timeout=10)
    assert str(task.pk) in str(news), news
    await ws.disconnect()


async def opened(path: str, headers) -> tuple[WebsocketCommunicator, str]:
    """A connected socket that has had its first message, and its channel name."""
    before = set(live._open_channels)
    ws = await connect(path, headers)
    await ws.receive_json_from(timeout=5)
    (channel,) = set(live._open_channels) - before
    return ws, channel


async def members(layer, group: str) -> set[str]:
    async with layer.connection(layer.consistent_hash(group)) as conn:
        return {m.decode() for m in await conn.zrange(layer._group_key(group), 0, -1)}


async def test_a_message_that_arrives_after_a_socket_closed_is_not_kept(redis_layer, viewer):
    layer = get_channel_layer()
    headers = await database_sync_to_async(session_headers)(viewer)
    gone, gone_channel = await opened("/ws/tasks/", headers)
    staying, _ = await opened("/ws/tasks/", headers)
    await gone.disconnect()
    assert gone_channel not in await members(layer, TASK_LIST_GROUP)
    assert gone_channel not in layer.receive_buffer and gone_channel not in live._open_channels

    # A hint sent to it just before it left its groups: the process reads it from Redis while
    # receiving for another socket, and channels_redis buffers it under the closed channel.
    await layer.send(gone_channel, {"type": "task.changed", "task_id": 1, "seq": 1, "status": "running",
                                    "steps_done": 0, "steps_total": 1})
    await layer.group_send(TASK_LIST_GROUP, {"type": "task.changed", "task_id": 1, "seq": 2, "status": "running",
                                             "steps_done": 0, "steps_total": 1})
    message = await staying.receive_json_from(timeout=5)
    while message.get("type") != "task":
        message = await staying.receive_json_from(timeout=5)
    assert message["seq"] == 2
    assert gone_channel in layer.receive_buffer  # the leak the sweep is for

    assert live.prune_receive_buffers(layer) == 1  # what the tailer does every PRUNE_EVERY seconds
    assert gone_channel not in layer.receive_buffer
    # The open socket keeps receiving.
    await layer.group_send(TASK_LIST_GROUP, {"type": "task.changed", "task_id": 1, "seq": 3, "status": "running",
                                             "steps_done": 0, "steps_total": 1})
    message = await staying.receive_json_from(timeout=5)
    while message.get("type") != "task":
        message = await staying.receive_json_from(timeout=5)
    assert message["seq"] == 3
    await staying.disconnect()
    assert not layer.receive_buffer


async def test_an_instance_cancelled_by_the_server_leaves_its_groups(redis_layer, viewer):
    layer = get_channel_layer()
    headers = await database_sync_to_async(session_headers)(viewer)
    task = await database_sync_to_async(services.task_create)(type="demo.pipeline", params={})
    ws, channel = await opened(f"/ws/tasks/{task.pk}/", headers)
    assert channel in await members(layer, task_group(task.pk))
    assert channel in await members(layer, live.SITE_GROUP)

    # daphne's application_close_timeout: the instance is cancelled, disconnect() never runs.
    ws.future.cancel()
    with pytest.raises(asyncio.CancelledError):
        await ws.future
    assert channel not in await members(layer, task_group(task.pk))
    assert channel not in await members(layer, live.SITE_GROUP)
    assert channel not in live._open_channels and channel not in layer.receive_buffer
