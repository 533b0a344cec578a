"""Live progress for websocket clients: what to send, and how a web process learns that
a task changed.

Workers run in other processes. Two ways a change reaches the web process:
- with REDIS_URL, workers publish a hint through channels-redis right after commit;
- always, a tailer in each web process polls the database for tasks whose `updated_at`
  moved (every ORCH_LIVE_POLL_SECONDS: 0.1 s embedded, 1 s as a safety net with Redis,
  where a group over capacity drops messages).
Hints only say "task N has events up to seq S"; consumers read the events themselves from
the database by seq, so a lost or repeated hint never loses or repeats an event.
"""
import asyncio
import logging
from datetime import timedelta

from channels.db import database_sync_to_async
from channels.layers import get_channel_layer
from django.conf import settings
from django.db import close_old_connections, connection
from django.http import HttpRequest
from django.middleware.csrf import CsrfViewMiddleware, get_token
from django.utils import timezone

from .engine import actions
from .engine.events import NOTIFY_CHANNEL, TASK_LIST_GROUP, task_group
from .models import Step, Task, TaskEvent, WalEntry
from .outage import DATABASE_DOWN, OutageWatch
from .presenters import fragments
from .presenters.task_page import EVENTS_SHOWN

try:
    from redis.exceptions import ConnectionError as RedisConnectionError, TimeoutError as RedisTimeoutError
    CHANNEL_LAYER_DOWN = (OSError, RedisConnectionError, RedisTimeoutError)
except ImportError:  # pragma: no cover - redis is a dependency; the in-memory layer never fails this way
    CHANNEL_LAYER_DOWN = (OSError,)

log = logging.getLogger(__name__)

# A commit is stamped (updated_at) before it becomes visible; look back this far so a
# slow commit is not missed. Repeats are harmless: hints are compared by seq.
LOOKBACK = timedelta(seconds=5)
# Every live page's socket is in this group: the tailer tells them when the database is
# unreachable and when it is back (the banner).
SITE_GROUP = "orchestrator.site"
MAX_REPLAY = 5000  # a client further behind than this is told to reload
STEPS_SENT = 2000  # as many as the task page shows


PRUNE_EVERY = 10.0  # seconds between sweeps of the channel layer's receive buffers


def poll_interval() -> float:
    return settings.ORCH_LIVE_POLL_SECONDS


# --- the channels of this process's open websockets -------------------------------------------
# channels_redis buffers, per process-local channel, the messages read from Redis for it until
# its consumer takes them (RedisChannelLayer.receive_buffer). A message that arrives after the
# consumer stopped receiving (a hint in flight while the socket closed, or any hint for a
# socket whose instance daphne killed before it left its groups) is buffered for good: one
# queue of up to `capacity` messages per such channel, for the life of the process
# (channels_redis issue #384). Consumers say when they open and close; a closed channel's
# buffer is dropped, and the tailer sweeps away buffers that filled up after that.
_open_channels: set[str] = set()


def channel_opened(name: str) -> None:
    _open_channels.add(name)


def channel_closed(layer, name: str) -> None:
    """`name`'s consumer is gone (it no longer receives): forget it and its buffered messages."""
    _open_channels.discard(name)
    buffers = getattr(layer, "receive_buffer", None)
    if buffers is not None:
        buffers.pop(name, None)


def prune_receive_buffers(layer) -> int:
    """Drop the buffered messages of channels no open websocket of this process owns; the
    number dropped. Only non-empty buffers: an empty one is a receive waiting, maybe of a
    consumer that has not reached connect() yet (no message can be sent to its channel
    before it joins a group, which it does after saying it is open)."""
    buffers = getattr(layer, "receive_buffer", None)
    if not buffers:
        return 0
    stale = [name for name, queue in list(buffers.items()) if name not in _open_channels and not queue.empty()]
    for name in stale:
        buffers.pop(name, None)
    return len(stale)


# --- what is sent ---------------------------------------------------------------------------

def iso(value):
    return value.isoformat() if value else None


def task_summary(task: Task) -> dict:
    return {"id": task.pk, "task_type": task.type, "title": task.title, "status": task.status,
            "status_reason": task.status_reason, "steps_done": task.steps_done, "steps_total": task.steps_total,
            "progress_percent": task.progress_percent, "seq": task.event_seq, "updated_at": iso(task.updated_at)}


def task_state(task_id: int, user=None) -> dict | None:
    """Everything the task page shows that changes while a task runs, with the actions
    `user` may take now (engine/actions.py): the page shows its controls from them."""
    task = Task.objects.filter(pk=task_id).first()
    if task is None:
        return None
    verdicts = actions.available(task, user)
    steps = [{"id": s.step_id, "title": s.title, "status": s.status, "attempts": s.attempts,
              "depends_on": s.depends_on, "reads": s.reads,
              "started_at": iso(s.started_at), "finished_at": iso(s.finished_at),
              "duration_seconds": s.duration_seconds, "error": s.error[:500]}
             for s in Step.objects.filter(task_id=task_id).order_by("position")[:STEPS_SENT]]
    wal = [{"id": w.pk, "step_id": w.step_id, "tool": w.tool, "idempotency_key": w.idempotency_key,
            "idempotent": w.idempotent, "status": w.status, "created_at": iso(w.created_at),
            "completed_at": iso(w.completed_at), "error": w.error[:300]}
           for w in WalEntry.objects.filter(task_id=task_id).order_by("-id")[:500]]
    heartbeat_age = (timezone.now() - task.heartbeat_at).total_seconds() if task.heartbeat_at else None
    return {**task_summary(task), "checkpoint_version": task.checkpoint_version,
            "tokens_used": task.tokens_used, "active_seconds": round(task.active_seconds, 1),
            "recovery_attempts": task.recovery_attempts, "control": task.control, "limits": task.limits,
            "activities": task.activities,
            "worker": {"host": task.worker_host, "pid": task.worker_pid} if task.lease_owner else None,
            "heartbeat_age": round(heartbeat_age, 1) if heartbeat_age is not None else None,
            "steps": steps, "wal": wal, "paused_by_limit": task.paused_by_limit,
            "actions": actions.as_list(verdicts), "controls_note": actions.controls_note(task, verdicts)}


def event_json(event: TaskEvent) -> dict:
    return {"type": "event", "seq": event.seq, "kind": event.kind, "payload": event.payload,
            "created_at": iso(event.created_at)}


def events_after(task_id: int, seq: int, limit: int = MAX_REPLAY, rows_for_last: int = 0) -> list[dict]:
    """The events after `seq`, in order; the last `rows_for_last` of them carry the
    fragment that adds their row to the task page (older ones would scroll off it)."""
    events = list(TaskEvent.objects.filter(task_id=task_id, seq__gt=seq).order_by("seq")[:limit])
    sent = [event_json(e) for e in events]
    for index in range(max(0, len(events) - rows_for_last), len(events)):
        sent[index]["fragments"] = [fragments.event_row(events[index])]
    return sent


def task_refresh(task_id: int, user, csrf_token: str) -> tuple[dict, tuple[int, dict[str, str]]] | None:
    """A task page's periodic refresh: the JSON `state` and the rendered regions."""
    state = task_state(task_id, user)
    regions = fragments.task_page_regions(task_id, user, csrf_token)
    if state is None or regions is None:
        return None
    return state, regions


def csrf_token_for(scope) -> str:
    """A CSRF token for the forms in rendered fragments, from the CSRF cookie the page's
    own response set (a websocket handshake carries the page's cookies): forms swapped in
    live post like the ones rendered with the page."""
    request = HttpRequest()
    request.COOKIES = dict(scope.get("cookies") or {})
    if scope.get("session") is not None:
        request.session = scope["session"]
    CsrfViewMiddleware(lambda _request: None).process_request(request)
    return get_token(request)


def recent_summaries(limit: int = 50, before: int | None = None) -> list[dict]:
    qs = Task.objects.order_by("-id")
    if before:
        qs = qs.filter(pk__lt=before)
    return [task_summary(t) for t in qs[:limit]]


# --- the tailer -------------------------------------------------------------------------------

def changed_tasks(since) -> list[dict]:
    close_old_connections()
    return list(Task.objects.filter(updated_at__gte=since)
                .values("id", "event_seq", "status", "steps_done", "steps_total"))


class EventTailer:
    """One per web process: turns database changes into channel-layer hints."""

    def __init__(self):
        self.known: dict[int, int] = {}
        self.task: asyncio.Task | None = None
        self.database = OutageWatch(log, "live tailer")
        self.channel_layer = OutageWatch(log, "live tailer", service="the channel layer (Redis)")

    async def announce(self, reachable: bool) -> None:
        await get_channel_layer().group_send(SITE_GROUP, {"type": "database.status", "reachable": reachable})

    def ensure_running(self) -> None:
        loop = asyncio.get_running_loop()
        if self.task is None or self.task.done() or self.task.get_loop() is not loop:
            self.known = {}
            self.listening = False
            self.task = loop.create_task(self.run())
            if connection.vendor == "postgresql":
                self.listener = loop.create_task(self.listen())

    async def hint(self, task_id: int, seq: int, status: str, steps_done: int, steps_total: int) -> None:
        """Tell the pages of `task_id` (and the task list) that it has events up to `seq`."""
        if seq <= self.known.get(task_id, -1):
            return  # already told (the poll and the listener both see most changes)
        self.known[task_id] = seq
        message = {"type": "task.changed", "task_id": task_id, "seq": seq, "status": status,
                   "steps_done": steps_done, "steps_total": steps_total}
        layer = get_channel_layer()
        await layer.group_send(task_group(task_id), message)
        await layer.group_send(TASK_LIST_GROUP, message)

    async def listen(self) -> None:
        """PostgreSQL: LISTEN for the NOTIFY each event's transaction sends (engine/events.py),
        so a commit reaches the pages in milliseconds; the table poll stays as a safety net."""
        import psycopg

        settings_dict = connection.settings_dict
        params = {"dbname": settings_dict["NAME"], "user": settings_dict["USER"] or None,
                  "password": settings_dict["PASSWORD"] or None, "host": settings_dict["HOST"] or None,
                  "port": settings_dict["PORT"] or None}
        while True:
            try:
                async with await psycopg.AsyncConnection.connect(
                        autocommit=True, **{k: v for k, v in params.items() if v is not None}) as conn:
                    await conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
                    self.listening = True
                    async for notify in conn.notifies():
                        task_id, seq, status, done, total = notify.payload.split(":")
                        try:
                            await self.hint(int(task_id), int(seq), status, int(done), int(total))
                        except CHANNEL_LAYER_DOWN as exc:
                            self.channel_layer.failed(exc)
            except asyncio.CancelledError:
                raise
            except (psycopg.OperationalError, OSError):
                # The database is away: the poll reports the outage; listen again when it is back.
                self.listening = False
                await asyncio.sleep(1.0)
            except Exception:
                self.listening = False
                log.warning("live listener failed; listening again", exc_info=True)
                await asyncio.sleep(1.0)

    async def run(self) -> None:
        # Tasks already changed before we started are not news.
        since = timezone.now() - LOOKBACK
        next_prune = asyncio.get_running_loop().time() + PRUNE_EVERY
        try:
            for row in await database_sync_to_async(changed_tasks)(since):
                self.known[row["id"]] = row["event_seq"]
        except DATABASE_DOWN as exc:
            self.database.failed(exc)
            await self.announce(False)
        while True:
            # While LISTEN delivers, the poll is only a safety net (a missed notification).
            await asyncio.sleep(max(poll_interval(), 1.0) if self.listening else poll_interval())
            if asyncio.get_running_loop().time() >= next_prune:
                next_prune = asyncio.get_running_loop().time() + PRUNE_EVERY
                dropped = prune_receive_buffers(get_channel_layer())
                if dropped:
                    log.debug("dropped the buffered messages of %d closed websockets", dropped)
            try:
                poll_started = timezone.now()
                try:
                    rows = await database_sync_to_async(changed_tasks)(since)
                except DATABASE_DOWN as exc:
                    if not self.database.down:
                        await self.announce(False)
                    self.database.failed(exc)
                    continue
                if self.database.down:
                    self.database.succeeded()
                    await self.announce(True)
                since = poll_started - LOOKBACK
                for row in rows:
                    await self.hint(row["id"], row["event_seq"], row["status"], row["steps_done"],
                                    row["steps_total"])
                if len(self.known) > 10_000:
                    self.known = {k: v for k, v in self.known.items() if k in {r["id"] for r in rows}}
                self.channel_layer.succeeded()
            except asyncio.CancelledError:
                raise
            except CHANNEL_LAYER_DOWN as exc:  # hints are lost meanwhile; pages catch up by seq
                self.channel_layer.failed(exc)
            except Exception:  # the database may blip; the next poll catches up
                log.warning("live tailer poll failed", exc_info=True)


tailer = EventTailer()
