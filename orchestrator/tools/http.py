"""HTTP for steps. `http_call` is the helper (it obeys the step's cancellation token: a
slow or streaming response is aborted by closing it from the cancelling thread); the
`http.request` tool wraps it as a side effect: idempotent when the method is (GET, HEAD,
PUT, DELETE, OPTIONS) or when the call sends an Idempotency-Key header
(`"idempotency_key": true` in args), which the server uses to drop repeats."""
import json
import urllib.error
import urllib.request
from collections.abc import Iterator

from ..engine.faults import fault_point_for_key
from .base import Tool, ToolError, register

IDEMPOTENT_METHODS = {"GET", "HEAD", "PUT", "DELETE", "OPTIONS"}
MAX_BODY = 1_000_000


def open_request(args: dict, *, token, idempotency_key: str | None = None):
    token.raise_if_cancelled()
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
    try:
        return urllib.request.urlopen(request, timeout=float(args.get("timeout", 30)))
    except urllib.error.HTTPError as exc:
        raise ToolError(f"{request.method} {args['url']} answered {exc.code} {exc.reason}") from exc
    except OSError as exc:
        token.raise_if_cancelled()
        raise ToolError(f"{request.method} {args['url']} failed: {exc}") from exc


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
        raise ToolError(f"reading {url} failed: {exc}") from exc
    finally:
        unregister()
        response.close()
    token.raise_if_cancelled()


def http_call(args: dict, *, token, idempotency_key: str | None = None) -> dict:
    """Perform one request: {method, url, headers?, json?|body?, timeout?}."""
    with token.track("http", f"{args.get('method', 'GET').upper()} {args['url']}"):
        response = open_request(args, token=token, idempotency_key=idempotency_key)
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

    def perform(self, args: dict, *, key: str, token) -> dict:
        return http_call(args, token=token, idempotency_key=key if args.get("idempotency_key") else None)
