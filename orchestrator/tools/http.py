"""HTTP for steps. `http_call` is the helper (it obeys the step's cancellation token: a
slow or streaming response is aborted by closing it from the cancelling thread); the
`http.request` tool wraps it as a side effect: idempotent when the method is (GET, HEAD,
PUT, DELETE, OPTIONS) or when the call sends an Idempotency-Key header
(`"idempotency_key": true` in args), which the server uses to drop repeats.

A failure says whether the request can have reached the server: before the connection
is up (refused, DNS, a connect timeout) it is *not performed*; once the connection is up,
a timeout, a reset or a cancellation before the status arrives is *outcome unknown* (the
server may be acting on it right now). An error status is sorted by what it can mean
(status_failure): a 4xx is a refusal (*not performed*), and so are 429 and a 503 with
Retry-After ("not now, retry later") and 501/505; any other 5xx — 500, 502, 504, a proxy's
timeout — can come after the upstream acted: the tool reports it *outcome unknown*.

The probe (HttpRequest.probe) asks without performing: a call whose args name a
`status_url` (`{key}` in it is replaced by the idempotency key) is looked up with a GET
sent with the same Idempotency-Key header: a 2xx means it happened (its JSON is the
recorded answer), 404 or 410 that it did not, anything else is unknown. Without a
status_url nothing can be asked: a keyed call is then settled by its own replay with the
same key when the task goes on (the server dedupes: replay is its probe), and otherwise,
like a plain POST, goes to a reviewer.

Args with `"egress": "policy"` (the agent's `http_request` always sends it) are policed
(orchestrator/tools/egress.py, docs/egress.md): the destination and every redirect are
checked before connecting, the connection goes to the checked address, redirects are
followed by hand (at most 5), environment proxies are not used, and the request body, the
response body and the total time are capped by ORCH_HTTP_MAX_REQUEST_BYTES,
ORCH_HTTP_MAX_RESPONSE_BYTES and ORCH_HTTP_TIMEOUT_SECONDS. Operator-written steps call
without the flag and reach what they name."""
import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator

from django.conf import settings

from ..primitives.cancellation import CancellationToken, Cancelled
from ..primitives.faults import fault_point_for_key
from . import egress
from .base import PROBE_TIMEOUT_SECONDS, OutcomeUnknown, ProbeResult, Tool, ToolError, register

IDEMPOTENT_METHODS = {"GET", "HEAD", "PUT", "DELETE", "OPTIONS"}
MAX_BODY = 1_000_000
POLICY = "policy"
REDIRECT_STATUSES = {301, 302, 303, 307, 308}
# Headers that must not follow a redirect to another origin (requests drops them too).
CREDENTIAL_HEADERS = {"authorization", "cookie", "proxy-authorization"}
BODY_HEADERS = {"content-type", "content-length", "transfer-encoding"}


def policed(args: dict) -> bool:
    """Whether the call obeys the egress policy; an unknown `egress` value is refused rather
    than taken as "no policy"."""
    value = args.get("egress")
    if value is None:
        return False
    if value != POLICY:
        raise ToolError(f"http.request: unknown egress mode {value!r}; the only one is {POLICY!r}")
    return True


class ErrorStatus(ToolError):
    """The server answered with an error status. `unknown`: the status can come after the
    upstream acted on the request (see status_failure); otherwise it refused it."""

    def __init__(self, message: str, *, status: int, unknown: bool, retry_after: str | None = None,
                 body: str = ""):
        super().__init__(message)
        self.status, self.unknown, self.retry_after, self.body = status, unknown, retry_after, body


# 5xx answers that say the request was not taken: not implemented, or an HTTP version the
# server does not speak. Every other 5xx may come after the work was done (a 500 raised
# after the write, a proxy's 502/504 after the upstream acted on it).
REFUSING_5XX = {501, 505}


def status_failure(method: str, url: str, error: urllib.error.HTTPError) -> ErrorStatus:
    """An error answer sorted into a refusal (not performed) or an outcome unknown."""
    retry_after = error.headers.get("Retry-After") if error.headers is not None else None
    try:
        body = error.read(2000).decode("utf-8", errors="replace")
    except (OSError, ValueError, http.client.HTTPException):
        body = ""
    answered = f"{method} {url} answered {error.code} {error.reason}"
    if error.code == 429 or (error.code == 503 and retry_after is not None):
        return ErrorStatus(f"{answered}: not performed, retry later (Retry-After: {retry_after or 'not given'})",
                           status=error.code, unknown=False, retry_after=retry_after, body=body)
    if error.code >= 500 and error.code not in REFUSING_5XX:
        return ErrorStatus(f"{answered}: a server error that can come after the server (or the upstream behind "
                           f"a proxy) acted on the request", status=error.code, unknown=True, body=body)
    return ErrorStatus(answered, status=error.code, unknown=False, retry_after=retry_after, body=body)


class ResponseBroken(ToolError):
    """The status arrived but the body broke off. For a read it is a failed read (retry);
    for a side effect the server acted and its answer is lost (outcome unknown)."""


class RequestProgress:
    """How far a request got: `connected` once a connection to the server was up (from
    then on bytes of the request may have reached it)."""

    def __init__(self):
        self.connected = False
        self.connection = None
        self.socket = None  # kept after urllib lets go of the connection (the body is read from it)
        self.time_limit: TimeLimit | None = None

    def connection_class(self, base: type[http.client.HTTPConnection]):
        progress = self

        class Tracked(base):
            def connect(self):
                progress.connection = self
                super().connect()
                progress.socket = self.sock
                progress.connected = True

        return Tracked

    def abort(self) -> None:
        """Cut the connection from another thread (a cancellation, the time limit): a request
        blocked on connecting, sending, waiting for the answer or reading it fails at once."""
        sock = getattr(self.connection, "sock", None) or self.socket
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class TimeLimit:
    """The whole of a policed request (redirects and reading the body included) gets
    `seconds`; then the connection is cut from a timer thread, whatever it is doing."""

    def __init__(self, seconds: float, progress: RequestProgress):
        self.seconds = seconds
        self.ends = time.monotonic() + seconds
        self.expired = False
        self._progress = progress
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _expire(self) -> None:
        self.expired = True
        self._progress.abort()

    def remaining(self) -> float:
        return max(0.0, self.ends - time.monotonic())

    def stop(self) -> None:
        self._timer.cancel()

    def describe(self) -> str:
        return f"the time limit of {self.seconds:g} s (ORCH_HTTP_TIMEOUT_SECONDS)"


class _RedirectsReturned(urllib.request.HTTPRedirectHandler):
    """A 3xx comes back to the caller as the response: a policed request follows redirects
    itself, checking each destination first."""

    def _give_back(self, req, fp, code, msg, headers):
        return fp

    http_error_301 = http_error_302 = http_error_303 = http_error_307 = http_error_308 = _give_back


def _opener(progress: RequestProgress, route: "egress.Route | None" = None) -> urllib.request.OpenerDirector:
    """An opener whose connections report to `progress`; with a checked `route`, connections
    go to its addresses only, no proxy is used and redirects are returned, not followed."""

    def connection(base):
        return progress.connection_class(egress.pinned_connection(base, route) if route else base)

    class Handler(urllib.request.HTTPHandler):
        def http_open(self, req):
            return self.do_open(connection(http.client.HTTPConnection), req)

    class SecureHandler(urllib.request.HTTPSHandler):
        def https_open(self, req):
            return self.do_open(connection(http.client.HTTPSConnection), req, context=self._context)

    if route is None:
        return urllib.request.build_opener(Handler, SecureHandler)
    return urllib.request.build_opener(Handler, SecureHandler, urllib.request.ProxyHandler({}), _RedirectsReturned)


def request_body(args: dict) -> tuple[bytes | None, str | None]:
    """The bytes a call sends and their content type."""
    if "json" in args:
        return json.dumps(args["json"]).encode(), "application/json"
    if "body" in args:
        return str(args["body"]).encode(), None
    return None, None


def check_request_size(args: dict) -> None:
    data, _ = request_body(args)
    cap = settings.ORCH_HTTP_MAX_REQUEST_BYTES
    if data is not None and len(data) > cap:
        raise egress.EgressRefused(
            f"http.request refused to send {len(data)} bytes to {args.get('url')}: the body may have at most "
            f"{cap} bytes (ORCH_HTTP_MAX_REQUEST_BYTES)")


def open_request(args: dict, *, token, idempotency_key: str | None = None, progress: RequestProgress | None = None):
    token.raise_if_cancelled()
    progress = progress or RequestProgress()
    headers = dict(args.get("headers") or {})
    data, content_type = request_body(args)
    if content_type:
        headers.setdefault("Content-Type", content_type)
    if idempotency_key:
        headers["Idempotency-Key"] = idempotency_key
    method = args.get("method", "GET").upper()
    if policed(args):
        return _open_policed(args, method=method, data=data, headers=headers, token=token, progress=progress)
    request = urllib.request.Request(args["url"], data=data, headers=headers, method=method)
    return _send(request, _opener(progress), timeout=float(args.get("timeout", 30)), token=token,
                 progress=progress)


def _send(request, opener, *, timeout: float, token, progress: RequestProgress):
    """One request through `opener`, its failures sorted into not performed / unknown."""
    url = request.full_url
    unregister = token.on_cancel(lambda reason: progress.abort())
    try:
        return opener.open(request, timeout=timeout)
    except urllib.error.HTTPError as exc:
        raise status_failure(request.method, url, exc) from exc
    except (OSError, http.client.HTTPException) as exc:
        token.raise_if_cancelled()
        limit = progress.time_limit
        cause = f"{type(exc).__name__}: {exc}"
        if limit is not None and limit.expired:
            cause = f"stopped by {limit.describe()}"
        if progress.connected:
            raise OutcomeUnknown(
                f"{request.method} {url}: the request was sent but no answer came ({cause}); "
                f"the server may have acted on it", evidence=_evidence(request, exc)) from exc
        raise ToolError(f"{request.method} {url} failed before it reached the server: {cause}") from exc
    finally:
        unregister()


def _open_policed(args: dict, *, method: str, data: bytes | None, headers: dict, token,
                  progress: RequestProgress):
    """Check, connect to the checked address, and follow redirects by hand (each checked
    again), within ORCH_HTTP_TIMEOUT_SECONDS in all."""
    check_request_size(args)
    seconds = min(float(args.get("timeout", settings.ORCH_HTTP_TIMEOUT_SECONDS)), settings.ORCH_HTTP_TIMEOUT_SECONDS)
    if progress.time_limit is None:
        progress.time_limit = TimeLimit(seconds, progress)
    limit = progress.time_limit
    url, previous = requote(args["url"]), None
    for hop in range(egress.MAX_REDIRECTS + 1):
        try:
            route = egress.check(url)  # before anything is sent to this destination
        except egress.EgressRefused as exc:
            if previous is None:
                raise
            raise egress.EgressRefused(f"{previous} redirected to {url}, not followed: {exc}") from None
        if hop and not limit.remaining():
            raise ToolError(f"{method} {args['url']}: redirected to {url}, not followed: {limit.describe()} "
                            "was used up")
        # A 3xx was an answer: the request before it is settled, and this one starts afresh.
        progress.connected, progress.connection, progress.socket = False, None, None
        request = urllib.request.Request(url, data=data, headers=headers, method=method)
        response = _send(request, _opener(progress, route), timeout=max(limit.remaining(), 0.001), token=token,
                         progress=progress)
        location = response.headers.get("Location") if response.status in REDIRECT_STATUSES else None
        if not location:
            response.redirects = hop
            return response
        response.close()
        target = requote(urllib.parse.urljoin(url, location.strip()))
        method, data, headers = _redirected(response.status, method, data, headers, url, target)
        url, previous = target, url
    raise ToolError(f"{args.get('method', 'GET').upper()} {args['url']}: more than {egress.MAX_REDIRECTS} "
                    f"redirects (the last to {url}); not followed")


def requote(url: str) -> str:
    """The URL with what may not travel raw (spaces, quotes, control characters, non-ASCII)
    percent-encoded, and what is already encoded left alone: a model writes URLs as text, and
    http.client refuses a space where requests would quote it (the same safe set as requests)."""
    return urllib.parse.quote(url, safe="!#$%&'()*+,/:;=?@[]~")


def _redirected(status: int, method: str, data, headers: dict, source: str, target: str):
    """The request a redirect asks for, as requests (and browsers) make it: 303 turns any
    method but HEAD into GET, 301/302 turn POST into GET, both dropping the body; 307/308
    repeat the method and body. Credentials do not follow to another origin."""
    if (status == 303 and method != "HEAD") or (status in (301, 302) and method == "POST"):
        method, data = "GET", None
        headers = {name: value for name, value in headers.items() if name.lower() not in BODY_HEADERS}
    if _origin(source) != _origin(target):
        headers = {name: value for name, value in headers.items() if name.lower() not in CREDENTIAL_HEADERS}
    return method, data, headers


def _origin(url: str) -> tuple:
    parts = urllib.parse.urlsplit(url)
    return parts.scheme.lower(), (parts.hostname or "").lower(), parts.port


def _evidence(request, error) -> dict:
    return {"phase": "after sending, before the response", "method": request.method, "url": request.full_url,
            "error": f"{type(error).__name__}: {error}"}


def iter_response(response, *, token, url: str, lines: bool = False, max_bytes: int | None = None) -> Iterator[bytes]:
    """Chunks (or lines) of a response until it ends; cancelling the token closes it. With
    `max_bytes`, it reads no more than one byte past that (to tell that there was more)."""
    unregister = token.on_cancel(lambda reason: response.close())
    size = 0
    try:
        while max_bytes is None or size <= max_bytes:
            token.raise_if_cancelled()
            want = 65536 if max_bytes is None else min(65536, max_bytes + 1 - size)
            if lines:
                chunk = response.readline() if max_bytes is None else response.readline(want)
            else:
                chunk = response.read1(want) if hasattr(response, "read1") else response.read(want)
            if not chunk:
                break
            size += len(chunk)
            yield chunk
    except (OSError, ValueError, AttributeError, http.client.HTTPException) as exc:
        token.raise_if_cancelled()
        raise ResponseBroken(f"reading {url} failed: {exc}") from exc
    finally:
        unregister()
        response.close()
    token.raise_if_cancelled()


def http_call(args: dict, *, token, idempotency_key: str | None = None,
              progress: RequestProgress | None = None) -> dict:
    """Perform one request: {method, url, headers?, json?|body?, timeout?, egress?}."""
    if not policed(args):
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
    return _policed_call(args, token=token, idempotency_key=idempotency_key, progress=progress or RequestProgress())


def _policed_call(args: dict, *, token, idempotency_key: str | None, progress: RequestProgress) -> dict:
    cap = settings.ORCH_HTTP_MAX_RESPONSE_BYTES
    stopped_by = None
    try:
        with token.track("http", f"{args.get('method', 'GET').upper()} {args['url']}"):
            response = open_request(args, token=token, idempotency_key=idempotency_key, progress=progress)
            if idempotency_key:
                fault_point_for_key("during_effect", idempotency_key)
            chunks, size = [], 0
            try:
                for chunk in iter_response(response, token=token, url=args["url"], max_bytes=cap):
                    chunks.append(chunk)
                    size += len(chunk)
            except ResponseBroken:
                if not progress.time_limit.expired:
                    raise
            if progress.time_limit.expired:
                stopped_by = progress.time_limit.describe()  # the status came: keep what arrived
            elif size > cap:
                stopped_by = f"the size limit of {cap} bytes (ORCH_HTTP_MAX_RESPONSE_BYTES)"
    finally:
        if progress.time_limit is not None:
            progress.time_limit.stop()
    body = b"".join(chunks)[:cap].decode("utf-8", errors="replace")
    result = {"status": response.status, "body": body[:10_000], "truncated": bool(stopped_by) or len(body) > 10_000}
    if response.redirects:
        result["url"] = response.url  # where the redirects led
    if stopped_by:
        result["stopped_by"] = stopped_by
    return result


@register
class HttpRequest(Tool):
    name = "http.request"
    description = "HTTP request: {method, url, headers?, json?|body?, timeout?, idempotency_key?, status_url?}."

    def is_idempotent(self, args: dict) -> bool:
        return args.get("method", "GET").upper() in IDEMPOTENT_METHODS or bool(args.get("idempotency_key"))

    def validate(self, args: dict) -> None:
        if not str(args.get("url", "")).startswith(("http://", "https://")):
            raise ToolError(f"http.request needs an http(s) url; got {args.get('url')!r}")
        if policed(args):  # what can be judged before an intent is written; the address at perform()
            egress.parse(args["url"])
            check_request_size(args)

    def confirmed_result(self, args: dict, *, key: str) -> dict:
        # perform()'s shape, so a step that reads the answer goes on after a reviewer's "happened"
        # (found by the soak: a step reading answer["status"] failed twice and needed a human).
        # The answer itself was lost: no status, no body.
        return {"status": None, "body": "", "truncated": False, "confirmed_by_reviewer": True}

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
        except ErrorStatus as exc:
            if not exc.unknown:
                raise  # refused: not performed
            raise OutcomeUnknown(str(exc), evidence={"phase": "answered with an error status", "method": method,
                                                     "url": args["url"], "status": exc.status,
                                                     "body": exc.body[:1000]}) from exc

    def probe(self, args: dict, *, key: str) -> ProbeResult:
        template = args.get("status_url")
        if not template:
            return ProbeResult.unknown(f"{args.get('method', 'GET').upper()} {args.get('url')} names no status_url: "
                                       f"nothing to ask the server")
        url = str(template).replace("{key}", urllib.parse.quote(key, safe=""))
        lookup = {"method": "GET", "url": url, "headers": dict(args.get("headers") or {}),
                  "timeout": PROBE_TIMEOUT_SECONDS}
        if policed(args):
            lookup["egress"] = POLICY  # the lookup obeys the same policy as the call
        asked = f"GET {url} (Idempotency-Key: {key})"
        try:
            answer = http_call(lookup, token=CancellationToken(), idempotency_key=key)
        except ErrorStatus as exc:
            if exc.status in (404, 410):
                return ProbeResult.not_done(f"{asked} answered {exc.status}: the server has no such request")
            return ProbeResult.unknown(f"{asked} answered {exc.status}: cannot tell")
        except (ToolError, OutcomeUnknown) as exc:
            return ProbeResult.unknown(f"{asked} failed ({exc}): cannot tell")
        if not 200 <= answer["status"] < 300:
            return ProbeResult.unknown(f"{asked} answered {answer['status']}: cannot tell")
        try:
            recorded = json.loads(answer["body"])
        except ValueError:
            recorded = answer["body"]
        return ProbeResult.done({"status": answer["status"], "body": answer["body"], "truncated": answer["truncated"],
                                 "probed": url, "recorded": recorded},
                                f"{asked} answered {answer['status']}: the server has it")
