"""HTTP for steps. `http_call` is the helper (it obeys the step's cancellation token: a
slow or streaming response is aborted by closing it from the cancelling thread); the
`http.request` tool wraps it as a side effect: idempotent when the method is (GET, HEAD,
PUT, DELETE, OPTIONS) or when the call sends an Idempotency-Key header
(`"idempotency_key": true` in args), which the server uses to drop repeats.

A failure says whether the request can have reached the server: before the connection
is up (refused, DNS, a connect timeout) it is *not performed*, and so is any answer with
a status; once the connection is up, a timeout, a reset or a cancellation before the
status arrives is *outcome unknown* (the server may be acting on it right now)."""
import http.client
import json
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator

from ..primitives.cancellation import Cancelled
from ..primitives.faults import fault_point_for_key
from .base import OutcomeUnknown, Tool, ToolError, register

IDEMPOTENT_METHODS = {"GET", "HEAD", "PUT", "DELETE", "OPTIONS"}
MAX_BODY = 1_000_000


class ResponseBroken(ToolError):
    """The status arrived but the body broke off. For a read it is a failed read (retry);
    for a side effect the server acted and its answer is lost (outcome unknown)."""


class RequestProgress:
    """How far a request got: `connected` once a connection to the server was up (from
    then on bytes of the request may have reached it)."""

    def __init__(self):
        self.connected = False
        self.connection = None

    def connection_class(self, base: type[http.client.HTTPConnection]):
        progress = self

        class Tracked(base):
            def connect(self):
                progress.connection = self
                super().connect()
                progress.connected = True

        return Tracked

    def abort(self) -> None:
        """Cut the connection from another thread (a cancellation): a request blocked on
        sending or on waiting for the answer fails at once."""
        sock = getattr(self.connection, "sock", None)
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _opener(progress: RequestProgress) -> urllib.request.OpenerDirector:
    class Handler(urllib.request.HTTPHandler):
        def http_open(self, req):
            return self.do_open(progress.connection_class(http.client.HTTPConnection), req)

    class SecureHandler(urllib.request.HTTPSHandler):
        def https_open(self, req):
            return self.do_open(progress.connection_class(http.client.HTTPSConnection), req, context=self._context)

    return urllib.request.build_opener(Handler, SecureHandler)


def open_request(args: dict, *, token, idempotency_key: str | None = None, progress: RequestProgress | None = None):
    token.raise_if_cancelled()
    progress = progress or RequestProgress()
    headers = dict(args.get("headers") or {})
    data = None
    if "json" in args:
        data = json.dumps(args["json"]).encode()
        headers.setdefault("Content-Type", "application/json")
    elif "body" in args:
        data = str(args["body"]).encode()
    if idempotency_key:
        headers["Idempotency-Key"] = idempotency_key
    request = urllib.request.Request(args["url"], data=data, headers=headers,
                                     method=args.get("method", "GET").upper())
    unregister = token.on_cancel(lambda reason: progress.abort())
    try:
        return _opener(progress).open(request, timeout=float(args.get("timeout", 30)))
    except urllib.error.HTTPError as exc:
        raise ToolError(f"{request.method} {args['url']} answered {exc.code} {exc.reason}") from exc
    except OSError as exc:
        token.raise_if_cancelled()
        if progress.connected:
            raise OutcomeUnknown(
                f"{request.method} {args['url']}: the request was sent but no answer came ({type(exc).__name__}: "
                f"{exc}); the server may have acted on it", evidence=_evidence(request, exc)) from exc
        raise ToolError(f"{request.method} {args['url']} failed before it reached the server: {exc}") from exc
    finally:
        unregister()


def _evidence(request, error) -> dict:
    return {"phase": "after sending, before the response", "method": request.method, "url": request.full_url,
            "error": f"{type(error).__name__}: {error}"}


def iter_response(response, *, token, url: str, lines: bool = False) -> Iterator[bytes]:
    """Chunks (or lines) of a response until it ends; cancelling the token closes it."""
    unregister = token.on_cancel(lambda reason: response.close())
    try:
        while True:
            token.raise_if_cancelled()
            chunk = response.readline() if lines else (response.read1(65536) if hasattr(response, "read1")
                                                        else response.read(65536))
            if not chunk:
                break
            yield chunk
    except (OSError, ValueError, AttributeError) as exc:
        token.raise_if_cancelled()
        raise ResponseBroken(f"reading {url} failed: {exc}") from exc
    finally:
        unregister()
        response.close()
    token.raise_if_cancelled()


def http_call(args: dict, *, token, idempotency_key: str | None = None,
              progress: RequestProgress | None = None) -> dict:
    """Perform one request: {method, url, headers?, json?|body?, timeout?}."""
    with token.track("http", f"{args.get('method', 'GET').upper()} {args['url']}"):
        response = open_request(args, token=token, idempotency_key=idempotency_key, progress=progress)
        if idempotency_key:
            fault_point_for_key("during_effect", idempotency_key)  # crash tests: sent, answer unread
        chunks, size = [], 0
        for chunk in iter_response(response, token=token, url=args["url"]):
            chunks.append(chunk)
            size += len(chunk)
            if size >= MAX_BODY:
                break
    body = b"".join(chunks).decode("utf-8", errors="replace")
    return {"status": response.status, "body": body[:10_000], "truncated": len(body) > 10_000}


@register
class HttpRequest(Tool):
    name = "http.request"
    description = "HTTP request: {method, url, headers?, json?|body?, timeout?, idempotency_key?}."

    def is_idempotent(self, args: dict) -> bool:
        return args.get("method", "GET").upper() in IDEMPOTENT_METHODS or bool(args.get("idempotency_key"))

    def validate(self, args: dict) -> None:
        if not str(args.get("url", "")).startswith(("http://", "https://")):
            raise ToolError(f"http.request needs an http(s) url; got {args.get('url')!r}")

    def repeat_consequence(self, args: dict, *, idempotent: bool) -> str:
        request = f"{args.get('method', 'GET').upper()} {args.get('url')}"
        if idempotent:
            return f"{request} replays harmlessly (idempotent)"
        return f"{request} will be requested again"

    def perform(self, args: dict, *, key: str, token) -> dict:
        progress = RequestProgress()
        method = args.get("method", "GET").upper()
        try:
            return http_call(args, token=token, idempotency_key=key if args.get("idempotency_key") else None,
                             progress=progress)
        except Cancelled as exc:
            if not progress.connected:
                raise  # cancelled before anything left: not performed
            raise OutcomeUnknown(f"{method} {args['url']} was cancelled ({exc}) after the request was sent",
                                 evidence={"phase": "cancelled in flight", "method": method, "url": args["url"],
                                           "cancelled": str(exc)}) from exc
        except ResponseBroken as exc:
            raise OutcomeUnknown(f"{method} {args['url']}: {exc}", evidence={
                "phase": "reading the response", "method": method, "url": args["url"], "error": str(exc)}) from exc
