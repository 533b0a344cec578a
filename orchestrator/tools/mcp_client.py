"""The MCP client: sessions with MCP servers through the official SDK (`mcp`), for the
synchronous code of steps and pages. Imported on first use (orchestrator/tools/mcp.py).

One asyncio event loop per process runs in a thread of its own ("mcp-client"); a caller
submits a coroutine to it and waits. Each server has one session per process, opened on
first use and kept (its listing of tools too): calls do not open sessions. A session that
failed, or whose declaration changed, is replaced at the next use. A process that forks
(a worker starting an executor) starts afresh in the child: sessions never cross a fork.

A stdio server is a child process of the process that uses it — in an executor, part of
the executor's tree: its own process group, in the executor's session, with a clean
environment (process_groups.clean_environment: nothing of the worker's secrets) plus the server's
`env`. So it dies with the executor: the watchdog kills what an executor leaves behind, and
the session keeper kills the executor's session if the worker itself dies
(engine/processes.py). Its stderr goes to the log, a line a record (logger
orchestrator.tools.mcp_client, `mcp_server` field), redacted like every record.

A call with a side effect carries its idempotency key in `_meta`; the stdio transport
records which keys it wrote, so that a failure before the request left reads *not
performed* and one after it *outcome unknown*. Cancelling the caller's token cancels the
call's task: the SDK sends `notifications/cancelled` for a request it wrote (on streamable
HTTP it aborts the request's POST instead, as the 2026 wire says).
"""
import asyncio
import concurrent.futures
import logging
import os
import signal
import threading
import time
from contextlib import AsyncExitStack, asynccontextmanager

import anyio
import httpx2
import mcp_types as types
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp.shared.message import SessionMessage
from pydantic import ValidationError

from ..primitives.cancellation import Cancelled
from .base import OutcomeUnknown, ToolError
from .mcp_protocol import IDEMPOTENCY_META_KEY, ListedTool, ServerConfig, result_text
from .process_groups import clean_environment

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_SECONDS = 20.0  # start (a stdio server's interpreter may take seconds on a loaded host) and handshake
LIST_TIMEOUT_SECONDS = 20.0
RETRY_AFTER_FAILURE_SECONDS = 3.0  # a server that could not be reached is not tried again sooner (pages list tools)
ABANDON_WAIT_SECONDS = 3.0  # a cancelled call: time for its notifications/cancelled to go out
STDIO_EXIT_GRACE_SECONDS = 1.0  # after its stdin closes, before SIGTERM (then SIGKILL) to its group
MAX_LINE_BYTES = 16 * 1024 * 1024
CLIENT_INFO = types.Implementation(name="orchestrator", version="0.1")


class _Runtime:
    """This process's event loop, in a daemon thread."""

    def __init__(self):
        self.pid = os.getpid()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="mcp-client", daemon=True)
        self.thread.start()

    def submit(self, coroutine) -> tuple[concurrent.futures.Future, threading.Event]:
        """Run `coroutine` on the loop: its future, and an event set when it has really
        finished (a cancelled future returns at once; the task may still be sending its
        notifications/cancelled)."""
        finished = threading.Event()

        async def run():
            try:
                return await coroutine
            finally:
                finished.set()

        return asyncio.run_coroutine_threadsafe(run(), self.loop), finished

    def run(self, coroutine, timeout: float):
        future, finished = self.submit(coroutine)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            finished.wait(ABANDON_WAIT_SECONDS)
            raise


_lock = threading.Lock()
_runtime: _Runtime | None = None
_sessions: dict[str, "_Session"] = {}


def _current() -> _Runtime:
    global _runtime
    with _lock:
        if _runtime is None or _runtime.pid != os.getpid():
            _runtime = _Runtime()
        return _runtime


def _forget_after_fork() -> None:
    """In a forked child: the parent's loop thread is not here and its sessions are not
    ours. Close our copies of their pipes (a stdio server sees EOF only when every copy of
    its stdin is closed) and start afresh."""
    global _runtime, _lock
    _lock = threading.Lock()  # another thread may have held it at the fork
    for session in list(_sessions.values()):
        for fd in session.inherited_fds:
            try:
                os.close(fd)
            except OSError:
                pass
    _sessions.clear()
    _runtime = None


os.register_at_fork(after_in_child=_forget_after_fork)


class _Session:
    """One server's session in this process; lives in an owner task on the loop."""

    def __init__(self, config: ServerConfig):
        self.config = config
        self.client: Client | None = None
        self.ready = threading.Event()
        self.ended = threading.Event()
        self.failure: BaseException | None = None
        self.failed_at = 0.0
        self.closed = False
        self.tools: dict[str, ListedTool] | None = None
        self.written_keys: set[str] = set()  # stdio: idempotency keys whose request was written
        self.inherited_fds: list[int] = []
        self.process_alive = lambda: True
        self._closing: asyncio.Event | None = None
        self._owner: asyncio.Task | None = None

    @property
    def usable(self) -> bool:
        return self.client is not None and self.failure is None and not self.closed and self.process_alive()

    async def start(self) -> None:
        self._closing = asyncio.Event()
        self._owner = asyncio.get_running_loop().create_task(self._own(), name=f"mcp-session-{self.config.name}")

    async def _own(self) -> None:
        try:
            async with AsyncExitStack() as stack:
                if self.config.command:
                    transport = _stdio_transport(self)
                else:
                    http = await stack.enter_async_context(httpx2.AsyncClient(
                        headers=dict(self.config.headers), follow_redirects=False,
                        timeout=httpx2.Timeout(30.0, read=max(self.config.timeout, 30.0) + 30.0)))
                    transport = streamable_http_client(self.config.url, http_client=http)
                client = Client(transport, client_info=CLIENT_INFO, message_handler=self._on_message,
                                read_timeout_seconds=self.config.timeout, cache=None)
                await stack.enter_async_context(client)
                self.client = client
                self.ready.set()
                await self._closing.wait()
        except BaseException as exc:  # noqa: BLE001 (a transport's task group failing ends the session: recorded)
            if not self.closed:
                self.failure, self.failed_at = exc, time.monotonic()
                log.warning("MCP session with %s ended: %s", self.config.name, _describe(exc),
                            extra={"mcp_server": self.config.name})
        finally:
            self.client = None
            self.closed = True
            self.ready.set()
            self.ended.set()

    async def _on_message(self, message) -> None:
        if isinstance(message, types.ToolListChangedNotification):
            self.tools = None  # listed again at the next use
        elif isinstance(message, Exception):
            log.warning("MCP server %s sent what could not be read: %s", self.config.name, _describe(message),
                        extra={"mcp_server": self.config.name})

    async def close(self) -> None:
        self.closed = True
        if self._closing is not None:
            self._closing.set()
        if self._owner is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._owner), STDIO_EXIT_GRACE_SECONDS + 5)
            except (asyncio.TimeoutError, Exception):
                self._owner.cancel()

    async def list(self) -> dict[str, ListedTool]:
        tools: dict[str, ListedTool] = {}
        cursor = None
        for _ in range(100):  # a paginator that never ends cannot hang a page
            page = await self.client.list_tools(cursor=cursor, cache_mode="refresh")
            for tool in page.tools:
                tools[tool.name] = ListedTool(
                    name=tool.name, description=(tool.description or tool.title or "")[:2000],
                    input_schema=dict(tool.input_schema or {"type": "object"}),
                    annotations=tool.annotations.model_dump(by_alias=True, exclude_none=True)
                    if tool.annotations else {})
            cursor = page.next_cursor
            if not cursor:
                break
        self.tools = tools
        return tools


# --- stdio: the server as a child in this process's session --------------------------------

@asynccontextmanager
async def _stdio_transport(session: _Session):
    config = session.config
    try:
        process = await asyncio.create_subprocess_exec(
            *config.command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=clean_environment(dict(config.env)), process_group=0,
            limit=MAX_LINE_BYTES)
    except OSError as exc:
        raise ToolError(f"the MCP server {config.name} could not be started ({config.command[0]}: {exc})") from exc
    session.process_alive = lambda: process.returncode is None
    session.inherited_fds = [f.fileno() for f in _pipes(process)]
    log.info("MCP server %s started (pid %d)", config.name, process.pid, extra={"mcp_server": config.name})
    read_writer, read_stream = anyio.create_memory_object_stream[SessionMessage | Exception](0)
    write_stream, write_reader = anyio.create_memory_object_stream[SessionMessage](0)

    async def stdout_reader():
        async with read_writer:
            while True:
                try:
                    line = await process.stdout.readline()
                except (ValueError, OSError) as exc:  # a line over MAX_LINE_BYTES, a broken pipe
                    await read_writer.send(exc)
                    return
                if not line:
                    return  # EOF: the session sees the connection end
                if not line.strip():
                    continue
                try:
                    message = SessionMessage(types.jsonrpc_message_adapter.validate_json(line, by_name=False))
                except ValueError as exc:
                    await read_writer.send(exc)
                    continue
                await read_writer.send(message)

    async def stdin_writer():
        try:
            async with write_reader:
                async for session_message in write_reader:
                    message = session_message.message
                    data = message.model_dump_json(by_alias=True, exclude_unset=True) + "\n"
                    process.stdin.write(data.encode())
                    await process.stdin.drain()
                    key = _idempotency_key(message)
                    if key:
                        session.written_keys.add(key)
        except (OSError, anyio.ClosedResourceError, anyio.BrokenResourceError):
            await read_writer.aclose()  # the server's stdin is gone: the session sees the end

    async def stderr_logger():
        while True:
            try:
                line = await process.stderr.readline()
            except ValueError:  # a line over MAX_LINE_BYTES: dropped
                continue
            except OSError:
                return
            if not line:
                return
            text = line.decode(errors="replace").rstrip()
            if text:
                log.info("MCP server %s: %s", config.name, text[:4000],
                         extra={"mcp_server": config.name, "stream": "stderr"})

    async with anyio.create_task_group() as group:
        group.start_soon(stdout_reader)
        group.start_soon(stdin_writer)
        group.start_soon(stderr_logger)
        try:
            yield read_stream, write_stream
        finally:
            session.inherited_fds = []  # before they close: a later fork must not close reused numbers
            with anyio.CancelScope(shield=True):
                await _stop_stdio_server(process, config.name)
                for stream in (read_stream, write_stream, read_writer, write_reader):
                    await stream.aclose()
            group.cancel_scope.cancel()


def _pipes(process) -> list:
    found = []
    for stream in (process.stdin, process.stdout, process.stderr):
        transport = getattr(stream, "_transport", None) or getattr(stream, "transport", None)
        pipe = transport.get_extra_info("pipe") if transport is not None else None
        if pipe is not None:
            found.append(pipe)
    return found


async def _stop_stdio_server(process, name: str) -> None:
    """The spec's shutdown: close its stdin, wait, then SIGTERM and SIGKILL its process group."""
    try:
        process.stdin.close()
    except OSError:
        pass
    for sig in (None, signal.SIGTERM, signal.SIGKILL):
        if sig is not None:
            try:
                os.killpg(process.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            await asyncio.wait_for(process.wait(), STDIO_EXIT_GRACE_SECONDS)
            break
        except asyncio.TimeoutError:
            continue
    else:
        log.warning("MCP server %s (pid %d) outlived SIGKILL", name, process.pid, extra={"mcp_server": name})


def _idempotency_key(message) -> str | None:
    if not isinstance(message, types.JSONRPCRequest) or message.method != "tools/call":
        return None
    meta = (message.params or {}).get("_meta") or {}
    return meta.get(IDEMPOTENCY_META_KEY)


def _describe(exc: BaseException) -> str:
    """The innermost causes of an exception (groups flattened), for a person."""
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(_describe(e) for e in exc.exceptions)
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _leaves(exc: BaseException | None) -> list[BaseException]:
    if exc is None:
        return []
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for e in exc.exceptions for leaf in _leaves(e)]
    return [exc]


# --- the synchronous side -----------------------------------------------------------------

def _session(config: ServerConfig) -> _Session:
    """The live session with this server, opened if needed (ToolError when it cannot be)."""
    runtime = _current()
    with _lock:
        session = _sessions.get(config.name)
        if session is not None and session.config.connection != config.connection:
            runtime.loop.call_soon_threadsafe(lambda s=session: asyncio.ensure_future(s.close()))
            session = None
        if session is not None and not session.usable and session.ready.is_set():
            if session.failure is not None and time.monotonic() - session.failed_at < RETRY_AFTER_FAILURE_SECONDS:
                raise ToolError(f"the MCP server {config.name} could not be reached: {_describe(session.failure)}")
            runtime.loop.call_soon_threadsafe(lambda s=session: asyncio.ensure_future(s.close()))
            session = None
        if session is None:
            session = _Session(config)
            _sessions[config.name] = session
            asyncio.run_coroutine_threadsafe(session.start(), runtime.loop).result(5)
    if not session.ready.wait(CONNECT_TIMEOUT_SECONDS):
        session.failure, session.failed_at = TimeoutError(f"no answer within {CONNECT_TIMEOUT_SECONDS:g} s"), \
            time.monotonic()
        runtime.loop.call_soon_threadsafe(lambda: asyncio.ensure_future(session.close()))
        raise ToolError(f"the MCP server {config.name} did not answer within {CONNECT_TIMEOUT_SECONDS:g} s")
    if not session.usable:
        raise ToolError(f"the MCP server {config.name} could not be reached: "
                        f"{_describe(session.failure) if session.failure else 'its session ended'}")
    return session


def list_tools(config: ServerConfig, *, refresh: bool = False) -> dict[str, ListedTool]:
    session = _session(config)
    if session.tools is not None and not refresh:
        return session.tools
    try:
        return _current().run(session.list(), LIST_TIMEOUT_SECONDS)
    except (MCPError, ValidationError, concurrent.futures.TimeoutError, OSError) as exc:
        raise ToolError(f"the MCP server {config.name} did not list its tools: {_describe(exc)}") from exc


def call(config: ServerConfig, tool: str, arguments: dict, *, token, key: str | None) -> dict:
    token.raise_if_cancelled()
    session = _session(config)  # ToolError: nothing was sent
    meta = {IDEMPOTENCY_META_KEY: key} if key else None
    future, finished = _current().submit(session.client.call_tool(tool, arguments, meta=meta))
    unregister = token.on_cancel(lambda reason: future.cancel())
    label = f"MCP {config.name}__{tool}"
    try:
        with token.track("mcp", label):
            result = future.result(config.timeout + 30)  # the SDK times the call out first
    except concurrent.futures.CancelledError:
        finished.wait(ABANDON_WAIT_SECONDS)  # its notifications/cancelled goes out first
        if key is None or not _written(session, key):
            raise Cancelled(token.reason or "cancelled") from None
        raise OutcomeUnknown(f"{label} was cancelled ({token.reason}) after the request was sent; the server was "
                             f"told (notifications/cancelled) but may have acted already",
                             evidence={"phase": "cancelled after sending", "server": config.name, "tool": tool}) \
            from None
    except concurrent.futures.TimeoutError:
        future.cancel()
        finished.wait(ABANDON_WAIT_SECONDS)
        raise _after_sending(session, key, label, f"no answer within {config.timeout + 30:g} s") from None
    except MCPError as exc:
        if exc.code == types.CONNECTION_CLOSED:
            raise _after_sending(session, key, label, f"the connection closed ({exc})") from exc
        if exc.code == types.REQUEST_TIMEOUT:
            raise _after_sending(session, key, label, f"no answer within {config.timeout:g} s (ORCH_MCP_CALL_"
                                                      f"TIMEOUT_SECONDS); the server was told to cancel") from exc
        if exc.code in (types.INVALID_PARAMS, types.METHOD_NOT_FOUND):
            session.tools = None  # perhaps the tool is gone: list again at the next use
        raise ToolError(f"{label} refused: {exc.message}") from exc
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:3])
        raise _after_sending(session, key, label, f"its answer is not a valid MCP tool result ({problems})",
                             unreadable=True) from exc
    except Exception as exc:  # noqa: BLE001 (the transport failed in a way the SDK did not sort: fail closed)
        raise _after_sending(session, key, label, _describe(exc)) from exc
    finally:
        unregister()
    plain = _plain(result)
    if result.is_error:
        session.tools = None  # "no such tool" is told this way too: list again at the next use
        raise ToolError(f"{label} failed: {_error_text(plain)}")
    return plain


def _written(session: _Session, key: str) -> bool:
    """Whether the request with this key may have reached the server. Over stdio the
    transport knows; over HTTP a request handed to the transport counts as sent, unless the
    connection could not even be made."""
    if session.config.command:
        return key in session.written_keys
    session.ended.wait(1.0)  # the transport's failure is recorded as its session ends
    return not any(isinstance(e, (httpx2.ConnectError, httpx2.ConnectTimeout)) for e in _leaves(session.failure))


def _after_sending(session: _Session, key: str | None, label: str, what: str, *, unreadable: bool = False):
    """The error for a call that failed in flight: not performed when its request was never
    written, else outcome unknown (a read without a key: an error the model reads)."""
    session.tools = None
    if key is None:
        return ToolError(f"{label}: {what}")
    if not unreadable and not _written(session, key):
        return ToolError(f"{label} was not sent: {_describe(session.failure) if session.failure else what}")
    return OutcomeUnknown(f"{label}: {what}; the request had been sent, so it may have been performed",
                          evidence={"phase": "after sending", "server": session.config.name, "error": what})


def _plain(result: types.CallToolResult) -> dict:
    content = []
    for part in result.content:
        item = part.model_dump(mode="json", exclude_none=True)
        for bulky in ("data", "blob"):  # images, audio, binary resources: kept out of the WAL and the dialog
            if isinstance(item.get(bulky), str):
                item[bulky] = f"[{len(item[bulky])} base64 characters not kept]"
        resource = item.get("resource")
        if isinstance(resource, dict):
            item.setdefault("uri", resource.get("uri"))
            if isinstance(resource.get("blob"), str):
                resource["blob"] = f"[{len(resource['blob'])} base64 characters not kept]"
        content.append(item)
    return {"content": content, "structured_content": result.structured_content}


def _error_text(plain: dict) -> str:
    return result_text(plain)[:2000]


def close_all() -> None:
    """Close every session of this process (its stdio servers exit)."""
    with _lock:
        sessions, runtime = list(_sessions.values()), _runtime
        _sessions.clear()
    if runtime is None or runtime.pid != os.getpid() or not sessions:
        return

    async def close():
        await asyncio.gather(*(s.close() for s in sessions), return_exceptions=True)

    try:
        runtime.run(close(), STDIO_EXIT_GRACE_SECONDS * 3 + 10)
    except Exception:  # noqa: BLE001 (closing is best effort: the watchdog kills what is left)
        log.warning("MCP sessions did not close in time", exc_info=True)
