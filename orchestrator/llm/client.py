"""One streamed Chat Completions call to an OpenAI-compatible server, through the official
`openai` package, with what a durable agent needs around it.

    completion = chat(messages, tools=[function_tool("contracts.read", "...", schema)],
                      max_tokens_cap=2000, on_token=print, cancel=ctx.token)
    history.append(completion.assistant_message())
    for call in completion.tool_calls:          # call.arguments is the raw JSON string
        history.append(tool_result_message(call.id, run(call)))

What this layer adds to `openai.OpenAI`:
- it always streams (with `stream_options.include_usage`, unless the server is one that
  refuses it: `include_usage=False`) and assembles the content, the reasoning and the
  tool-call fragments (keyed by `index`) into one `Completion`; when the server sends no
  usage, the usage is estimated (characters / 4) and flagged `estimated=True`;
- reasoning deltas (`reasoning_content`, as llama.cpp and DeepSeek send them, or `reasoning`,
  as vLLM >= 0.16 and Ollama do) are kept apart from the content (`Completion.reasoning`,
  `on_reasoning`), never mixed into the answer; the history sends them back only when asked
  (`assistant_message(include_reasoning=True)`), as servers differ in accepting them;
- `max_completion_tokens` is sent; a server that rejects it (HTTP 400 naming the parameter)
  gets `max_tokens` instead, once, and is remembered as such per base URL;
- its own retry policy (`RetryPolicy`: 429/5xx/unreachable, honouring `Retry-After`, bounded
  attempts, cancellable waits) instead of the package's (created with max_retries=0), so every
  retry is logged, a cancellation is not held up by a back-off, and the prompt of every
  attempt the server read is counted (`retry_tokens`, on the Completion and on an LLMError);
- cancellation: a `CancellationToken` (or any callable returning True when the call should
  stop, polled every 20 ms) shuts the stream's socket at once, so even a read blocked on a
  slow server ends within milliseconds; the partial answer is in `LLMCancelled.partial`;
- errors a person can act on: `LLMUnavailable`, `LLMRequestRejected`, `LLMStreamCut`,
  `LLMBadResponse`, `LLMCancelled` (all `LLMError`; each says what to check).

A partial answer (stream cut or cancelled) keeps its text and drops the tool calls whose
arguments are not complete JSON (AGENT.md "Interruption"); its usage is estimated unless
the server had already sent it. A complete answer keeps every tool call as the model sent
it, malformed arguments included: the agent returns the parse error to the model.
"""
from __future__ import annotations

import json
import logging
import math
import os
import socket
import ssl
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime
from typing import Any, Protocol

import httpx2  # openai's HTTP client
import openai

from ..primitives.cancellation import Cancelled
from . import responses
from .results import (
    CHARACTERS_PER_TOKEN,
    Completion,
    FailedAttempt,
    ToolCall,
    Usage,
    estimate_prompt_tokens,
    estimate_tokens,
    function_tool,
    tool_result_message,
)
from ..primitives.errors import HarnessError

logger = logging.getLogger(__name__)

# Servers known to reject `max_completion_tokens` (base URLs). Process-wide on purpose: the
# parameter a server understands does not change between calls, so only the first call to
# such a server pays for the rejected request.
_LEGACY_TOKEN_PARAMETER_SERVERS: set[str] = set()
_LEGACY_LOCK = threading.Lock()

class LLMError(HarnessError):
    """A model call that did not produce a complete answer. `partial` is what had arrived
    (a Completion flagged stream_cut/cancelled), when anything had."""

    def __init__(self, message: str, *, base_url: str = "", status_code: int | None = None,
                 attempts: int = 0, partial: Completion | None = None):
        super().__init__(message)
        self.base_url, self.status_code, self.attempts, self.partial = base_url, status_code, attempts, partial
        # Prompt tokens (estimated) of the failed attempts the server took in (Completion.retry_tokens).
        self.retry_tokens = 0
        self.failed_attempts: list[FailedAttempt] = []  # every failed attempt, the last one included


class LLMUnavailable(LLMError):
    """The server could not be reached, or kept answering 429/5xx until the attempts ran out."""


class LLMRequestRejected(LLMError):
    """The server refused the request itself (400, 401, 403, 404, ...): retrying will not help."""


class LLMContextExceeded(LLMRequestRejected):
    """The server refused the request because its prompt does not fit the model's context window
    (OpenAI's `context_length_exceeded`; other servers say so in words): the caller can shorten
    the dialog and try again."""


class LLMStreamCut(LLMError):
    """The stream ended (connection closed or silent past the read timeout) before the
    server finished the message; `partial` holds what arrived."""


class LLMResponseGone(LLMError):
    """A background response cannot be given back (gone, failed, or the server is away): ask again."""


class LLMBadResponse(LLMError):
    """The server sent something that is not a Chat Completions stream."""


class LLMCancelled(LLMError, Cancelled):
    """The caller cancelled the call; `partial` holds what had arrived. Also a `Cancelled`,
    so step code that already handles cancellation handles this too."""

    def __init__(self, message: str, *, reason: str, **kwargs):
        LLMError.__init__(self, message, **kwargs)
        self.reason = reason


# --- cancellation ----------------------------------------------------------------------

class CancelToken(Protocol):
    """What this module needs of orchestrator.primitives.cancellation.CancellationToken."""
    cancelled: bool
    reason: str | None

    def on_cancel(self, callback: Callable[[str], None]) -> Callable[[], None]: ...


CancelHook = CancelToken | Callable[[], bool] | None


class _CancelWatch:
    """Normalises the cancel hook. With a token the stream is closed by the cancelling
    thread itself (no polling); a plain callable is polled every POLL_SECONDS by a watcher
    thread while a stream is open, so a slow stream is cut promptly in both cases."""

    POLL_SECONDS = 0.02

    def __init__(self, hook: CancelHook):
        self.hook = hook
        self._fired = threading.Event()
        self._reason = "cancelled"
        self._close: Callable[[], None] | None = None
        self._lock = threading.Lock()
        self._unregister: Callable[[], None] = lambda: None
        self._token = hook if hook is not None and hasattr(hook, "on_cancel") else None
        if self._token is not None:
            self._unregister = self._token.on_cancel(self._fire)

    def _fire(self, reason: str = "cancelled") -> None:
        with self._lock:
            self._reason = reason or "cancelled"
            self._fired.set()
            close = self._close
        if close is not None:
            _close_quietly(close)

    def is_set(self) -> bool:
        if not self._fired.is_set() and self._token is None and self.hook is not None and self.hook():
            self._fire("cancelled by the caller")
        return self._fired.is_set()

    @property
    def reason(self) -> str:
        return self._reason

    def wait(self, seconds: float) -> bool:
        """Sleep up to `seconds`, waking early on cancellation; True if cancelled."""
        if self._token is not None or self.hook is None:
            return self._fired.wait(seconds)
        deadline = time.monotonic() + seconds
        while not self.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            time.sleep(min(self.POLL_SECONDS, remaining))
        return True

    def arm(self, close: Callable[[], None]) -> None:
        """Close the open stream with `close` as soon as the call is cancelled."""
        with self._lock:
            self._close = close
            fired = self._fired.is_set()
        if fired:
            _close_quietly(close)
        elif self._token is None and self.hook is not None:
            threading.Thread(target=self._poll, args=(close,), name="llm-cancel-watch", daemon=True).start()

    def _poll(self, close) -> None:
        while True:
            with self._lock:
                if self._close is not close:
                    return  # disarmed: that stream is over
            if self.is_set():
                return
            time.sleep(self.POLL_SECONDS)

    def disarm(self) -> None:
        with self._lock:
            self._close = None

    def release(self) -> None:
        self.disarm()
        self._unregister()


def _abort_stream(stream) -> None:
    """Stop a stream now, from any thread. `Stream.close()` alone does not wake a read that
    is blocked waiting for the next chunk (measured: it ends only when that chunk comes), so
    the socket is shut down first, through the transport's documented `network_stream`
    response extension; the blocked read then fails at once."""
    response = getattr(stream, "response", None)
    network_stream = (getattr(response, "extensions", None) or {}).get("network_stream")
    sock = network_stream.get_extra_info("socket") if network_stream is not None else None
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # already closed by the server or by an earlier abort
            pass
    stream.close()


def _close_quietly(close: Callable[[], None]) -> None:
    try:
        close()
    except Exception:  # closing a response that is already broken must not mask why
        logger.debug("closing the model stream failed", exc_info=True)


# --- retries ---------------------------------------------------------------------------

@dataclass(frozen=True)
class RetryPolicy:
    """When a call is tried again. Delays double from `base_delay` up to `max_delay`; a
    server's `Retry-After` (or `retry-after-ms`) wins when it asks for longer, unless it asks
    for more than `max_retry_after`, in which case the call gives up at once and says so."""
    max_attempts: int = 4
    base_delay: float = 0.5
    max_delay: float = 8.0
    max_retry_after: float = 60.0
    retry_statuses: frozenset[int] = frozenset({408, 409, 429, 500, 502, 503, 504})

    def backoff(self, attempt: int) -> float:
        return min(self.max_delay, self.base_delay * (2 ** (attempt - 1)))


def retry_after_seconds(headers) -> float | None:
    """The wait a 429/503 asks for: `retry-after-ms`, else `Retry-After` as seconds (fractions
    accepted) or an HTTP date; None when absent or unreadable."""
    if headers is None:
        return None
    milliseconds = headers.get("retry-after-ms")
    if milliseconds:
        try:
            return max(0.0, float(milliseconds) / 1000)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


# Answers that refuse a request before the model reads it: no tokens were spent on them.
REFUSED_UNREAD = frozenset({429, 503})


class _Retry(Exception):
    """Internal: this attempt failed in a way worth another attempt. `spent`: the server may
    have read the prompt (it answered 500/502/504, timed out, or opened a stream that ended
    before its first chunk), so the attempt's prompt counts against the budget; a refused
    connection, a 429 or a 503 spent nothing."""

    def __init__(self, reason: str, *, status_code: int | None = None, retry_after: float | None = None,
                 spent: bool = True):
        super().__init__(reason)
        self.reason, self.status_code, self.retry_after, self.spent = reason, status_code, retry_after, spent


# --- the client ------------------------------------------------------------------------

_tls_lock = threading.Lock()
_tls: ssl.SSLContext | None = None


def _tls_context() -> ssl.SSLContext:
    """The HTTP client's default TLS context (the system's CA certificates, as httpx builds it),
    built once per process: a client is made per model call, and building the context each
    time was ~20 ms of the harness's overhead per agent turn (bench/agent.py). The context only
    holds settings and certificates, no connection; each client keeps its own pool."""
    global _tls
    with _tls_lock:
        if _tls is None:
            _tls = httpx2.create_ssl_context()
        return _tls


_SHARED_LIMIT = 32
_shared_lock = threading.Lock()
_shared: OrderedDict[tuple, "LLMClient"] = OrderedDict()


class LLMClient:
    """A configured connection to one OpenAI-compatible server. Thread-safe: one instance
    may serve many concurrent calls (the underlying HTTP client pools connections)."""

    def __init__(self, *, base_url: str, api_key: str, model: str, connect_timeout: float = 5.0,
                 read_timeout: float = 60.0, retry: RetryPolicy | None = None, include_usage: bool = True):
        self.base_url = base_url.rstrip("/")
        self.model = model
        # False for a server that refuses `stream_options` (its usage is then estimated,
        # unless it sends usage of its own accord, as llama.cpp does).
        self.include_usage = include_usage
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.retry = retry or RetryPolicy()
        # max_retries=0: the package's own retries would sleep without looking at the cancel
        # hook and without logging; RetryPolicy does both.
        self._openai = openai.OpenAI(base_url=self.base_url, api_key=api_key or "none", max_retries=0,
                                     timeout=self._timeout(read_timeout),
                                     http_client=openai.DefaultHttpxClient(verify=_tls_context()))

    @classmethod
    def from_settings(cls) -> "LLMClient":
        from django.conf import settings

        return cls(base_url=settings.LLM_BASE_URL, api_key=settings.LLM_API_KEY, model=settings.LLM_MODEL,
                   connect_timeout=settings.LLM_CONNECT_TIMEOUT, read_timeout=settings.LLM_READ_TIMEOUT,
                   retry=RetryPolicy(max_attempts=max(1, settings.LLM_MAX_ATTEMPTS)))

    def close(self) -> None:
        self._openai.close()

    @classmethod
    def shared(cls, *, base_url: str, api_key: str, model: str, connect_timeout: float, read_timeout: float,
               retry: RetryPolicy, include_usage: bool = True) -> "LLMClient":
        """The process's client for this server and these settings, made once and kept (not to
        be closed by the caller): a client per model call opened a new connection per agent turn
        (bench/agent.py: opening the stream was ~40 % of a turn's time in the model call). Keyed
        by the process id too: an executor forked from a worker must not use its parent's
        sockets. At most _SHARED_LIMIT are kept; one dropped is not closed (a call may still be
        using it): its connections close when it is collected."""
        key = (os.getpid(), base_url.rstrip("/"), api_key, model, connect_timeout, read_timeout, retry, include_usage)
        with _shared_lock:
            client = _shared.get(key)
            if client is None:
                client = _shared[key] = cls(base_url=base_url, api_key=api_key, model=model,
                                            connect_timeout=connect_timeout, read_timeout=read_timeout, retry=retry,
                                            include_usage=include_usage)
                while len(_shared) > _SHARED_LIMIT:
                    _shared.popitem(last=False)
            else:
                _shared.move_to_end(key)
            return client

    def _timeout(self, read_timeout: float) -> openai.Timeout:
        # `read` bounds the silence between two chunks, not the whole call: a long answer
        # that keeps streaming is fine, a server that stalls is not.
        return openai.Timeout(read_timeout, connect=self.connect_timeout)

    @property
    def uses_legacy_token_parameter(self) -> bool:
        with _LEGACY_LOCK:
            return self.base_url in _LEGACY_TOKEN_PARAMETER_SERVERS

    def chat(self, messages: Sequence[dict], *, tools: Sequence[dict] | None = None, model: str | None = None,
             temperature: float | None = None, max_tokens_cap: int | None = None,
             on_token: Callable[[str], None] | None = None, cancel: CancelHook = None,
             timeout: float | None = None, tool_choice: str | dict | None = None,
             on_reasoning: Callable[[str], None] | None = None, background: bool = False,
             on_response_id: Callable[[str], None] | None = None) -> Completion:
        """Stream one assistant message. `messages`/`tools` are in the Chat Completions wire
        format; `max_tokens_cap` caps the completion (sent as `max_completion_tokens`, or
        `max_tokens` to servers that only know that); `on_token(piece)` receives each piece of
        content text as it arrives, `on_reasoning(piece)` each piece of reasoning; `cancel` is a CancellationToken or a callable returning
        True to stop; `timeout` overrides the read timeout (seconds of silence allowed).
        `background`: ask through the Responses API in background mode (responses.py): the
        server keeps the response whatever happens to this process, and `on_response_id(id)`
        is called with its id before the first token, for `reattach`.

        Returns a complete Completion, or raises an LLMError subclass (see the module doc)."""
        model = model or self.model
        watch = _CancelWatch(cancel)
        request: dict[str, Any] = {"model": model, "messages": list(messages), "stream": True}
        if self.include_usage:
            request["stream_options"] = {"include_usage": True}
        if tools:
            request["tools"] = list(tools)
        if tool_choice is not None:
            request["tool_choice"] = tool_choice
        if temperature is not None:
            request["temperature"] = temperature
        started = time.monotonic()
        attempt = 0
        # The package's own retries are off (max_retries=0 in __init__): every attempt is made
        # here, and those the server read are counted (retry_tokens).
        retry_tokens, prompt_tokens = 0, estimate_prompt_tokens(request["messages"], request.get("tools"))
        failed: list[FailedAttempt] = []
        try:
            while True:
                attempt += 1
                if watch.is_set():
                    raise LLMCancelled(f"The model call was cancelled ({watch.reason}) before attempt {attempt}.",
                                       reason=watch.reason, base_url=self.base_url, attempts=attempt - 1)
                try:
                    if background:
                        stream = self._open_background(request, max_tokens_cap, timeout, attempt)
                        assembly = responses.EventAssembly(request, on_response_id)
                    else:
                        stream = self._open_stream(request, max_tokens_cap, timeout, attempt)
                        assembly = _Assembly(request)
                    completion = self._consume(stream, request, watch, on_token, attempt, on_reasoning, assembly)
                except _Retry as retry:
                    retry_tokens += prompt_tokens if retry.spent else 0
                    failed.append(FailedAttempt(retry.reason, retry.status_code, prompt_tokens if retry.spent else 0))
                    delay = self._delay_or_give_up(retry, attempt, model)
                    logger.warning("model call failed, retrying", extra={
                        "llm_base_url": self.base_url, "llm_model": model, "llm_attempt": attempt,
                        "llm_reason": retry.reason, "llm_status": retry.status_code,
                        "llm_retry_in_seconds": round(delay, 3)})
                    if watch.wait(delay):
                        raise LLMCancelled(f"The model call was cancelled ({watch.reason}) while waiting to retry "
                                           f"after: {retry.reason}.", reason=watch.reason,
                                           base_url=self.base_url, attempts=attempt) from None
                    continue
                completion.attempts, completion.retry_tokens = attempt, retry_tokens
                completion.failed_attempts = failed
                logger.info("model call finished", extra={
                    "llm_base_url": self.base_url, "llm_model": model, "llm_attempts": attempt,
                    "llm_finish_reason": completion.finish_reason, "llm_tool_calls": len(completion.tool_calls),
                    "llm_prompt_tokens": completion.usage.prompt_tokens,
                    "llm_completion_tokens": completion.usage.completion_tokens,
                    "llm_usage_estimated": completion.usage.estimated,
                    "llm_duration_ms": round((time.monotonic() - started) * 1000)})
                return completion
        except LLMError as exc:
            exc.retry_tokens = retry_tokens
            exc.failed_attempts = failed
            raise
        finally:
            watch.release()

    def _delay_or_give_up(self, retry: _Retry, attempt: int, model: str) -> float:
        policy = self.retry
        if retry.retry_after is not None and retry.retry_after > policy.max_retry_after:
            raise LLMUnavailable(
                f"The model server at {self.base_url} asked to wait {retry.retry_after:.0f} s before retrying "
                f"({retry.reason}), more than the {policy.max_retry_after:.0f} s this client waits. Try later, "
                f"or use another server (LLM_BASE_URL).",
                base_url=self.base_url, status_code=retry.status_code, attempts=attempt)
        if attempt >= policy.max_attempts:
            if retry.status_code == 429:
                advice = "it is rate-limiting this client: lower the load, or raise LLM_MAX_ATTEMPTS"
            elif retry.status_code:
                advice = "look at the server's own logs"
            else:
                advice = ("is it running? `make run` starts the stand-in (manage.py standin_llm); "
                          "or set LLM_BASE_URL to a server that is")
            raise LLMUnavailable(
                f"The model server at {self.base_url} did not answer model {model!r} after {attempt} "
                f"attempt{'s' if attempt > 1 else ''} (last: {retry.reason}); {advice}.",
                base_url=self.base_url, status_code=retry.status_code, attempts=attempt)
        backoff = policy.backoff(attempt)
        return max(backoff, retry.retry_after) if retry.retry_after is not None else backoff

    def _open_stream(self, request: dict, max_tokens_cap: int | None, timeout: float | None, attempt: int):
        timeout_config = self._timeout(timeout) if timeout is not None else openai.NOT_GIVEN
        legacy_retried = False
        while True:
            limit = {}
            if max_tokens_cap is not None:
                limit = ({"max_tokens": max_tokens_cap} if self.uses_legacy_token_parameter
                         else {"max_completion_tokens": max_tokens_cap})
            try:
                return self._openai.chat.completions.create(**request, **limit, timeout=timeout_config)
            except openai.APIStatusError as exc:
                if (exc.status_code == 400 and "max_completion_tokens" in limit and not legacy_retried
                        and _names_parameter(exc, "max_completion_tokens")):
                    with _LEGACY_LOCK:
                        _LEGACY_TOKEN_PARAMETER_SERVERS.add(self.base_url)
                    legacy_retried = True
                    logger.info("model server rejects max_completion_tokens; using max_tokens from now on",
                                extra={"llm_base_url": self.base_url, "llm_attempt": attempt})
                    continue
                raise self._classify_status(exc, request["model"], attempt) from None
            except openai.APIConnectionError as exc:  # includes the timeout
                raise self._not_answered(exc, timeout) from None

    def _not_answered(self, exc: openai.APIConnectionError, timeout: float | None) -> "_Retry":
        """A request the server never answered: retried (a timeout may have been read: spent)."""
        if isinstance(exc, openai.APITimeoutError):
            return _Retry(f"no answer within {self.connect_timeout} s to connect / "
                          f"{timeout or self.read_timeout} s to respond")
        return _Retry(f"cannot connect: {_root_cause(exc)}", spent=False)

    def _open_background(self, request: dict, max_tokens_cap: int | None, timeout: float | None, attempt: int):
        timeout_config = self._timeout(timeout) if timeout is not None else openai.NOT_GIVEN
        try:
            return self._openai.responses.create(**responses.request_of(request, max_tokens_cap),
                                                 timeout=timeout_config)
        except openai.APIStatusError as exc:
            raise self._classify_status(exc, request["model"], attempt) from None
        except openai.APIConnectionError as exc:  # includes the timeout
            raise self._not_answered(exc, timeout) from None

    def reattach(self, response_id: str, *, model: str | None = None, cancel: CancelHook = None,
                 on_token: Callable[[str], None] | None = None,
                 on_reasoning: Callable[[str], None] | None = None, poll_seconds: float = 0.2,
                 wait_seconds: float | None = None) -> Completion:
        """The response `response_id`, asked in background mode by a process that is gone:
        retrieved (polled while the server is still making it, up to `wait_seconds`, default
        ten read timeouts), instead of asking, and paying, again. Its text goes to `on_token`
        at once. LLMResponseGone when the server no longer has it, failed or cancelled it, or
        cannot be reached: the caller asks again."""
        model = model or self.model
        watch = _CancelWatch(cancel)
        deadline = time.monotonic() + (wait_seconds if wait_seconds is not None else 10 * self.read_timeout)
        try:
            while True:
                try:
                    response = self._openai.responses.retrieve(response_id, timeout=self._timeout(self.read_timeout))
                except openai.APIStatusError as exc:
                    raise LLMResponseGone(f"The model server at {self.base_url} cannot give back response "
                                          f"{response_id} (HTTP {exc.status_code}: {_server_message(exc)}).",
                                          base_url=self.base_url, status_code=exc.status_code) from None
                except openai.APIConnectionError as exc:
                    raise LLMResponseGone(f"The model server at {self.base_url} could not be asked for response "
                                          f"{response_id} ({_root_cause(exc)}).", base_url=self.base_url) from None
                if response.status not in responses.UNFINISHED:
                    break
                if time.monotonic() >= deadline:
                    raise LLMResponseGone(f"Response {response_id} at {self.base_url} is still {response.status} "
                                          f"after the wait for it.", base_url=self.base_url)
                if watch.wait(poll_seconds):
                    raise LLMCancelled(f"The model call was cancelled ({watch.reason}) while waiting for response "
                                       f"{response_id}.", reason=watch.reason, base_url=self.base_url)
        finally:
            watch.release()
        if response.status not in ("completed", "incomplete"):
            raise LLMResponseGone(f"The model server at {self.base_url} says response {response_id} is "
                                  f"{response.status}.", base_url=self.base_url)
        completion = responses.completion_of(response, model)
        if on_reasoning is not None and completion.reasoning:
            on_reasoning(completion.reasoning)
        if on_token is not None and completion.content:
            on_token(completion.content)
        logger.info("model call re-attached", extra={
            "llm_base_url": self.base_url, "llm_model": model, "llm_response_id": response_id,
            "llm_prompt_tokens": completion.usage.prompt_tokens,
            "llm_completion_tokens": completion.usage.completion_tokens})
        return completion

    def _classify_status(self, exc: openai.APIStatusError, model: str, attempt: int) -> Exception:
        status, detail = exc.status_code, _server_message(exc)
        if status in self.retry.retry_statuses:
            return _Retry(f"HTTP {status}: {detail}", status_code=status,
                          retry_after=retry_after_seconds(exc.response.headers), spent=status not in REFUSED_UNREAD)
        if status in (400, 413) and _is_context_exceeded(exc, detail):
            return LLMContextExceeded(f"The model server at {self.base_url} refused the request: its prompt does "
                                      f"not fit model {model!r}'s context window (HTTP {status}: {detail}).",
                                      base_url=self.base_url, status_code=status, attempts=attempt)
        if status in (401, 403):
            advice = "check LLM_API_KEY"
        elif status == 404:
            advice = (f"check LLM_MODEL (is {model!r} served there? GET {self.base_url}/models lists what is) "
                      f"and LLM_BASE_URL (it usually ends in /v1)")
        else:
            advice = "the request itself is wrong for this server"
        return LLMRequestRejected(f"The model server at {self.base_url} refused the request (HTTP {status}: "
                                  f"{detail}); {advice}.", base_url=self.base_url, status_code=status,
                                  attempts=attempt)

    def _consume(self, stream, request: dict, watch: _CancelWatch, on_token, attempt: int,
                 on_reasoning, assembly) -> Completion:
        watch.arm(lambda: _abort_stream(stream))
        try:
            for chunk in stream:
                if watch.is_set():
                    break
                assembly.add(chunk, on_token, on_reasoning)
        except openai.APIConnectionError as exc:  # includes the read timeout
            if not watch.is_set():
                reason = ("no chunk within the read timeout" if isinstance(exc, openai.APITimeoutError)
                          else f"connection lost: {_root_cause(exc)}")
                if not assembly.received_anything:
                    # Nothing reached the caller yet, so trying again cannot show it twice.
                    raise _Retry(f"stream ended before its first chunk ({reason})") from None
                partial = assembly.completion(stream_cut=True)
                raise LLMStreamCut(f"The model server at {self.base_url} cut the stream of model "
                                   f"{request['model']!r} after {len(partial.content)} characters ({reason}); "
                                   f"the partial answer is kept.", base_url=self.base_url,
                                   attempts=attempt, partial=partial) from None
        except openai.APIError as exc:  # an error event inside the stream
            raise LLMBadResponse(f"The model server at {self.base_url} reported an error mid-stream: {exc.message}",
                                 base_url=self.base_url, attempts=attempt,
                                 partial=assembly.completion(stream_cut=True)) from None
        except ValueError as exc:  # a `data:` line that is not JSON
            raise LLMBadResponse(f"The model server at {self.base_url} sent a chunk that is not JSON ({exc}); "
                                 f"is LLM_BASE_URL a Chat Completions endpoint?", base_url=self.base_url,
                                 attempts=attempt, partial=assembly.completion(stream_cut=True)) from None
        finally:
            watch.disarm()
            _close_quietly(stream.close)
        if watch.is_set():
            partial = assembly.completion(cancelled=True)
            raise LLMCancelled(f"The model call was cancelled ({watch.reason}); the partial answer "
                               f"({len(partial.content)} characters) is kept.", reason=watch.reason,
                               base_url=self.base_url, attempts=attempt, partial=partial)
        if assembly.error:  # a background response the server failed (responses.EventAssembly)
            raise LLMBadResponse(f"The model server at {self.base_url} failed the response: {assembly.error}",
                                 base_url=self.base_url, attempts=attempt,
                                 partial=assembly.completion(stream_cut=True))
        if assembly.finish_reason is None:
            # The body ended cleanly but the message never did: a server or proxy that
            # closes the connection without the terminating chunk.
            if not assembly.received_anything:
                raise _Retry("the stream ended without any chunk")
            partial = assembly.completion(stream_cut=True)
            raise LLMStreamCut(f"The stream of model {request['model']!r} from {self.base_url} ended before the "
                               f"message was finished (no finish_reason); the partial answer is kept.",
                               base_url=self.base_url, attempts=attempt, partial=partial)
        return assembly.completion()


class _Assembly:
    """Accumulates the chunks of one stream into a Completion."""

    def __init__(self, request: dict):
        self.request = request
        self.content_parts: list[str] = []
        self.reasoning_parts: list[str] = []
        # One entry per tool call, in order; fragments find theirs by `index` (and by `id`,
        # for servers that number every parallel call 0).
        self.calls: list[dict] = []
        self._call_at_index: dict[int, dict] = {}
        self.finish_reason: str | None = None
        self.usage: Usage | None = None
        self.model = request["model"]
        self.response_id: str | None = None
        self.received_anything = False
        self.error = ""  # a chat stream's errors raise inside the stream (openai.APIError)

    def add(self, chunk, on_token, on_reasoning=None) -> None:
        self.response_id = self.response_id or getattr(chunk, "id", None)
        self.model = getattr(chunk, "model", None) or self.model
        if getattr(chunk, "usage", None) is not None:
            # A chunk of its own after the finish (OpenAI, vLLM) or inside the finish chunk
            # (llama.cpp): either way the last one seen wins.
            usage = chunk.usage
            details = getattr(usage, "prompt_tokens_details", None)
            self.usage = Usage(usage.prompt_tokens or 0, usage.completion_tokens or 0,
                               usage.total_tokens or (usage.prompt_tokens or 0) + (usage.completion_tokens or 0),
                               cached_tokens=getattr(details, "cached_tokens", None) or 0)
        for choice in chunk.choices or []:
            if choice.index not in (0, None):
                continue  # n > 1 is never asked for
            delta = choice.delta
            if delta is not None:
                reasoning = _reasoning_piece(delta)
                if reasoning:
                    self.received_anything = True
                    self.reasoning_parts.append(reasoning)
                    if on_reasoning is not None:
                        on_reasoning(reasoning)
                if delta.content:
                    self.received_anything = True
                    self.content_parts.append(delta.content)
                    if on_token is not None:
                        on_token(delta.content)
                for fragment in delta.tool_calls or []:
                    self.received_anything = True
                    self._add_fragment(fragment)
            if choice.finish_reason:
                self.finish_reason = choice.finish_reason

    def _add_fragment(self, fragment) -> None:
        index = fragment.index if fragment.index is not None else len(self.calls)
        call = self._call_at_index.get(index)
        if call is None or (fragment.id and call["id"] and fragment.id != call["id"]):
            call = {"id": fragment.id or "", "name": "", "arguments": []}
            self.calls.append(call)
            self._call_at_index[index] = call
        call["id"] = call["id"] or fragment.id or ""
        function = fragment.function
        if function is not None:
            if function.name and not call["name"]:
                call["name"] = function.name
            if function.arguments:
                call["arguments"].append(function.arguments)

    def completion(self, *, stream_cut: bool = False, cancelled: bool = False) -> Completion:
        content = "".join(self.content_parts)
        calls = [ToolCall(id=c["id"] or f"call_{i}", name=c["name"], arguments="".join(c["arguments"]))
                 for i, c in enumerate(self.calls)]
        dropped: list[ToolCall] = []
        if stream_cut or cancelled:
            dropped = [call for call in calls if not call.arguments_are_complete() or not call.name]
            calls = [call for call in calls if call not in dropped]
        reasoning = "".join(self.reasoning_parts)
        usage = self.usage or self._estimate(content + reasoning, calls + dropped)
        return Completion(content=content, tool_calls=calls, finish_reason=self.finish_reason, usage=usage,
                          model=self.model, response_id=self.response_id, stream_cut=stream_cut,
                          cancelled=cancelled, dropped_tool_calls=dropped, reasoning=reasoning)

    def _estimate(self, content: str, calls: list[ToolCall]) -> Usage:
        # `content` includes the reasoning: the server bills reasoning tokens as completion tokens.
        completion_chars = len(content) + sum(len(c.name) + len(c.arguments) for c in calls)
        prompt = estimate_prompt_tokens(self.request["messages"], self.request.get("tools"))
        completion = estimate_tokens(completion_chars)
        return Usage(prompt, completion, prompt + completion, estimated=True)


def _reasoning_piece(delta) -> str:
    """A delta's reasoning text, under either name servers use (extra fields of the package's
    ChoiceDelta); anything but a string (OpenRouter's structured `reasoning_details`) is not it."""
    for name in ("reasoning_content", "reasoning"):
        value = getattr(delta, name, None)
        if isinstance(value, str) and value:
            return value
    return ""


def _names_parameter(exc: openai.APIStatusError, parameter: str) -> bool:
    return exc.param == parameter or parameter in (exc.message or "") or parameter in json.dumps(exc.body or "")


_CONTEXT_EXCEEDED_WORDS = ("context_length_exceeded", "context length", "context window", "maximum context",
                           "too many tokens", "prompt is too long")


def _is_context_exceeded(exc: openai.APIStatusError, detail: str) -> bool:
    """OpenAI sends code `context_length_exceeded`; vLLM, llama.cpp and others say it in words."""
    text = f"{getattr(exc, 'code', '') or ''} {detail}".lower()
    return any(words in text for words in _CONTEXT_EXCEEDED_WORDS)


def _server_message(exc: openai.APIStatusError) -> str:
    # The package hands over the inner `error` object of an OpenAI-style body; other
    # servers send {"message": ...} or {"detail": ...} at the top.
    body = exc.body
    if isinstance(body, dict):
        error = body.get("error")
        message = error.get("message") if isinstance(error, dict) else (body.get("message") or body.get("detail"))
        if message:
            return str(message)[:300]
    return (exc.message or "")[:300]


def _root_cause(exc: BaseException) -> str:
    while exc.__cause__ is not None or exc.__context__ is not None:
        exc = exc.__cause__ or exc.__context__
    return f"{type(exc).__name__}: {exc}"[:300]


# --- the configured default ------------------------------------------------------------

def client_from_settings() -> LLMClient:
    """The process's client for LLM_BASE_URL / LLM_API_KEY / LLM_MODEL (another one when they
    change, e.g. under override_settings)."""
    from django.conf import settings

    return LLMClient.shared(base_url=settings.LLM_BASE_URL, api_key=settings.LLM_API_KEY, model=settings.LLM_MODEL,
                            connect_timeout=settings.LLM_CONNECT_TIMEOUT, read_timeout=settings.LLM_READ_TIMEOUT,
                            retry=RetryPolicy(max_attempts=max(1, settings.LLM_MAX_ATTEMPTS)))


def chat(messages: Sequence[dict], **options) -> Completion:
    """`LLMClient.chat` on the client configured by the settings."""
    return client_from_settings().chat(messages, **options)
