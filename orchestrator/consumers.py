"""Websockets: `/ws/tasks/` (the list) and `/ws/tasks/<id>/` (one task).

Protocol (JSON):
- on connect the server sends `{"type": "state", "seq": S, ...}` — the current state;
- a client that saw events up to N sends `{"resume_from": N}` (or connects with
  `?resume_from=N`) and receives every event with seq > N from the database, in order,
  before live ones — no gap, no duplicate; a client too far behind gets `{"type": "reload"}`;
- then `{"type": "event", "seq": n, "kind": ..., "payload": ...}` as they happen, with
  `{"type": "state", ...}` refreshes (throttled) so tables follow along.
Anonymous users and users without a role are refused; origins are checked in asgi.py.
A message the server cannot use (not JSON, a `resume_from` that is not a seq) is answered
with `{"type": "error", "message": ...}`; the connection stays open.

For pages, the same messages carry HTML rendered by the templates the first page used
(orchestrator/presenters/fragments.py): an `event` carries the fragment that adds its row
(`"fragments": [{"target": "event-rows", "html": ..., "swap": "afterbegin"}]`), and each
`state` refresh is followed by `{"type": "fragments", "seq": S, "fragments": [...]}` with
the task page's regions that changed since the last one sent on this connection
(`"swap": "outerHTML"`, by element id; S is the task's seq when they were rendered, not an
event: resuming is by event seq only). The list socket sends the changed tasks' rows the
same way. Pages take their structure from fragments only; `state` and `event` stay for
programmatic clients.
"""
import asyncio
import logging
import json
import time
from urllib.parse import parse_qs

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer, AsyncWebsocketConsumer

from . import live, roles
from .engine.events import TASK_LIST_GROUP, task_group
from .outage import DATABASE_DOWN
from .presenters import fragments
from .primitives import jsonlimits
from .primitives.redaction import redact
from .primitives.errors import HarnessError

log = logging.getLogger(__name__)

OUTAGE_CLOSE_CODE = 4503  # the database is unreachable: reconnect later
CHANNEL_LAYER_CLOSE_CODE = 1011  # the channel layer failed: reconnect

STATE_MIN_INTERVAL = 0.25  # seconds between full state (and fragment) refreshes per connection
RESUME_WAIT = 0.5  # how long to wait for a `resume_from` message before streaming
MAX_SEQ = 2**63 - 1  # seqs and ids are signed 64-bit in the database


class BadSeq(HarnessError, ValueError):
    pass


def parse_seq(value) -> int:
    """A `resume_from` value (an int, or its digits in a query string) as a seq."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    elif isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SEQ:
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:40] + "…"
        raise BadSeq(f"resume_from must be an integer seq between 0 and {MAX_SEQ} (the last event seq you "
                     f"received), got {shown}")
    return value


class RoleRequiredConsumer(AsyncJsonWebsocketConsumer):
    async def __call__(self, scope, receive, send):
        self.groups_joined: set[str] = set()
        # The channel layer (Redis) went away under this socket: close it (the page
        # reconnects with its last seq and catches up from the database) instead of
        # failing inside the application.
        try:
            await super().__call__(scope, receive, send)
        except live.CHANNEL_LAYER_DOWN as exc:
            log.warning("channel layer unreachable: websocket closed, the page will reconnect (%s)", exc)
            try:
                await send({"type": "websocket.close", "code": CHANNEL_LAYER_CLOSE_CODE})
            except Exception:  # the socket may be gone already
                pass
        finally:
            # However it ended: also when daphne cancelled an instance still busy
            # application_close_timeout (10 s) after its client left, so that disconnect()
            # never ran. Left in its groups, the channel would get every hint for a day
            # (group_expiry) and the web process would buffer them (live.channel_closed).
            await self.leave()

    async def join(self, group: str) -> None:
        self.groups_joined.add(group)  # first: a cancel during group_add still leaves it
        await self.channel_layer.group_add(group, self.channel_name)

    async def leave(self) -> None:
        """Leave every group joined and drop what the layer buffered for this channel (idempotent)."""
        channel = getattr(self, "channel_name", None)
        if channel is None:
            return
        try:
            while self.groups_joined:
                await self.channel_layer.group_discard(self.groups_joined.pop(), channel)
        except live.CHANNEL_LAYER_DOWN as exc:  # Redis away: its groups expire (group_expiry)
            log.info("channel layer unreachable: could not leave groups (%s)", exc)
        finally:
            self.groups_joined.clear()
            live.channel_closed(self.channel_layer, channel)

    async def websocket_connect(self, message):
        live.channel_opened(self.channel_name)  # before any group: see live.prune_receive_buffers
        await super().websocket_connect(message)

    async def connect(self):
        try:
            user = self.scope.get("user")
            allowed = await database_sync_to_async(roles.has_role)(user, roles.VIEWER) if user else False
            if not allowed:
                await self.close(code=4403)  # before accept: the handshake is refused (HTTP 403)
                return
            live.tailer.ensure_running()
            await self.join(live.SITE_GROUP)
            await self.start()
        except DATABASE_DOWN:
            # Say so, then close: the page shows the banner and reconnects (with its last
            # seq) until the database is back.
            await self.accept()
            await self.send_json({"type": "outage", "database": "unreachable"})
            await self.close(code=OUTAGE_CLOSE_CODE)

    async def database_status(self, message):
        await self.send_json({"type": "outage", "database": "reachable" if message["reachable"] else "unreachable"})
        if message["reachable"]:
            await self.caught_up()

    async def caught_up(self):
        """After an outage: send what changed meanwhile."""

    async def websocket_disconnect(self, message):
        await self.leave()
        await super().websocket_disconnect(message)

    async def start(self):
        raise NotImplementedError

    async def send_error(self, message: str):
        await self.send_json({"type": "error", "message": message})

    async def receive(self, text_data=None, bytes_data=None, **kwargs):
        """Decode a JSON message; answer an error (and stay connected) if it is not JSON."""
        if text_data is None:
            await self.send_error("Send text frames holding JSON, e.g. {\"resume_from\": 12}.")
            return
        try:
            content = await self.decode_json(text_data)
        except jsonlimits.Unreadable as exc:
            await self.send_error(f"Message not read: {exc}.")
            return
        except ValueError:  # json.JSONDecodeError, and numbers too large to parse
            await self.send_error("Messages must be JSON, e.g. {\"resume_from\": 12}.")
            return
        await self.receive_json(content, **kwargs)

    async def receive_json(self, content, **kwargs):
        await self.send_error("This websocket takes no messages; it only sends the task list's updates.")

    @classmethod
    async def decode_json(cls, text_data):
        return jsonlimits.loads(text_data)  # a deeply nested message is an error message, not a close 1011

    @classmethod
    async def encode_json(cls, content):
        # Every message of every websocket leaves here: the live surface's one redaction
        # boundary (event payloads, task state; orchestrator/primitives/redaction.py).
        return json.dumps(redact(content), default=str)


class TaskConsumer(RoleRequiredConsumer):
    async def start(self):
        self.task_id = int(self.scope["url_route"]["kwargs"]["task_id"])
        state = (await database_sync_to_async(live.task_state)(self.task_id, self.scope.get("user"))
                 if 1 <= self.task_id <= MAX_SEQ else None)
        if state is None:
            await self.close(code=4404)
            return
        self.group = task_group(self.task_id)
        await self.join(self.group)
        await self.accept()
        self.lock = asyncio.Lock()
        self.render_lock = asyncio.Lock()  # one refresh at a time: regions are sent in render order
        self.regions_sent: dict[str, str] = {}
        self.csrf_token = await database_sync_to_async(live.csrf_token_for)(self.scope)
        self.last_state_at = 0.0
        self.state_pending = False
        query = parse_qs(self.scope.get("query_string", b"").decode())
        self.last_sent = state["seq"]
        self.streaming = False
        await self.send_json({"type": "state", **state})
        resume_from = None
        if "resume_from" in query:
            try:
                resume_from = parse_seq(query["resume_from"][0])
            except BadSeq as exc:
                # Keep the connection: the client may still send {"resume_from": N}.
                await self.send_error(f"{exc}; ignored it: send {{\"resume_from\": N}} or reconnect.")
        if resume_from is not None:
            await self.resume(resume_from)
        else:
            # Give a client the chance to send {"resume_from": N} before live events flow,
            # so replayed and live events never interleave out of order.
            self.start_timer = asyncio.get_running_loop().call_later(
                RESUME_WAIT, lambda: asyncio.ensure_future(self.begin_streaming()))

    async def disconnect(self, code):
        # (The groups were left in websocket_disconnect.)
        if getattr(self, "start_timer", None):
            self.start_timer.cancel()

    async def receive_json(self, content, **kwargs):
        if not isinstance(content, dict) or "resume_from" not in content:
            await self.send_error('Unknown message: the only message this websocket takes is {"resume_from": N}.')
            return
        try:
            seq = parse_seq(content["resume_from"])
        except BadSeq as exc:
            await self.send_error(str(exc))
            return
        await self.resume(seq)

    async def resume(self, seq: int):
        if getattr(self, "start_timer", None):
            self.start_timer.cancel()
        async with self.lock:
            if self.streaming and seq >= self.last_sent:
                return
            if self.last_sent - seq > live.MAX_REPLAY or (not self.streaming and seq > self.last_sent):
                # Too far behind to replay, or ahead of the log (the client's view is not
                # this task's history): the client must reload its state.
                await self.send_json({"type": "reload", "reason": "cannot resume from seq %d" % seq})
                await self.close()
                return
            if not self.streaming:
                self.last_sent = max(0, seq)
        await self.begin_streaming()

    async def begin_streaming(self):
        self.streaming = True
        await self.flush()
        # The page may have been rendered a while ago (or before an outage): bring every
        # region up to date once, even when no event came meanwhile.
        await self.refresh_state()

    async def flush(self):
        """Send every event after the last one sent, from the database, in order."""
        if not self.streaming:
            return
        async with self.lock:
            try:
                events = await database_sync_to_async(live.events_after)(self.task_id, self.last_sent,
                                                                         rows_for_last=live.EVENTS_SHOWN)
            except DATABASE_DOWN:
                return  # the banner says so; caught_up() sends what was missed once it is back
            for event in events:
                await self.send_json(event)
                self.last_sent = event["seq"]
        if events:
            await self.refresh_state()

    async def refresh_state(self):
        """A full state refresh, at most every STATE_MIN_INTERVAL seconds."""
        wait = STATE_MIN_INTERVAL - (time.monotonic() - self.last_state_at)
        if wait > 0:
            if not self.state_pending:
                self.state_pending = True
                asyncio.get_running_loop().call_later(wait, lambda: asyncio.ensure_future(self.send_state()))
            return
        await self.send_state()

    async def send_state(self):
        """The JSON state, then the page regions that changed, rendered off the event loop."""
        self.state_pending = False
        self.last_state_at = time.monotonic()
        async with self.render_lock:
            try:
                refreshed = await database_sync_to_async(live.task_refresh)(
                    self.task_id, self.scope.get("user"), self.csrf_token)
            except DATABASE_DOWN:
                return  # caught_up() refreshes once the database is back
            if refreshed is None:
                return
            state, (seq, regions) = refreshed
            await self.send_json({"type": "state", **state})
            changed = [{"target": target, "html": html, "swap": "outerHTML"} for target, html in regions.items()
                       if html and self.regions_sent.get(target) != html]
            self.regions_sent.update(regions)
            if changed:
                await self.send_json({"type": "fragments", "seq": seq, "fragments": changed})

    async def task_changed(self, message):
        if message["seq"] > self.last_sent:
            await self.flush()

    async def caught_up(self):
        if getattr(self, "streaming", False):
            await self.flush()
            await self.send_state()


class TaskListConsumer(RoleRequiredConsumer):
    async def start(self):
        self.rows_pending: set[int] = set()
        self.rows_scheduled = False
        self.last_rows_at = 0.0
        await self.join(TASK_LIST_GROUP)
        await self.accept()
        tasks = await database_sync_to_async(live.recent_summaries)()
        await self.send_json({"type": "state", "tasks": tasks})
        # The newest rows as they are now: the page may have been rendered a while ago.
        self.rows_pending.update(t["id"] for t in tasks)
        self.schedule_rows()

    def schedule_rows(self):
        """Send the pending rows, at most every STATE_MIN_INTERVAL seconds."""
        if self.rows_scheduled or not self.rows_pending:
            return
        self.rows_scheduled = True
        wait = max(0.0, STATE_MIN_INTERVAL - (time.monotonic() - self.last_rows_at))
        asyncio.get_running_loop().call_later(wait, lambda: asyncio.ensure_future(self.send_rows()))

    async def send_rows(self):
        self.rows_scheduled = False
        self.last_rows_at = time.monotonic()
        task_ids, self.rows_pending = sorted(self.rows_pending), set()
        try:
            rows = await database_sync_to_async(fragments.task_rows)(task_ids)
        except DATABASE_DOWN:
            self.rows_pending.update(task_ids)  # sent by caught_up() once the database is back
            return
        if rows:
            await self.send_json({"type": "fragments", "fragments": rows})
        self.schedule_rows()  # rows that changed while these were rendered

    async def caught_up(self):
        self.schedule_rows()

    async def task_changed(self, message):
        await self.send_json({"type": "task", "id": message["task_id"], "seq": message["seq"],
                              "status": message["status"], "steps_done": message["steps_done"],
                              "steps_total": message["steps_total"],
                              "progress_percent": int(100 * message["steps_done"] / message["steps_total"])
                              if message["steps_total"] else (100 if message["status"] == "completed" else 0)})
        self.rows_pending.add(message["task_id"])
        self.schedule_rows()


class UnknownPathConsumer(AsyncWebsocketConsumer):
    """Any other websocket path: refused at the handshake (4404), as an unknown task is,
    instead of the router's "No route found" exception (a 500 in the server's log)."""

    async def connect(self):
        await self.close(code=4404)
