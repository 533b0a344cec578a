"""http.request: idempotent when the method is (GET, HEAD, PUT, DELETE, OPTIONS) or when
the call sends an Idempotency-Key header (`"idempotency_key": true` in args), which the
server uses to drop repeats. The request aborts as soon as the step's token is cancelled."""
import json
import urllib.error
import urllib.request

from .base import Tool, ToolError, register

IDEMPOTENT_METHODS = {"GET", "HEAD", "PUT", "DELETE", "OPTIONS"}
MAX_BODY = 1_000_000


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
        token.raise_if_cancelled()
        headers = dict(args.get("headers") or {})
        data = None
        if "json" in args:
            data = json.dumps(args["json"]).encode()
            headers.setdefault("Content-Type", "application/json")
        elif "body" in args:
            data = str(args["body"]).encode()
        if args.get("idempotency_key"):
            headers["Idempotency-Key"] = key
        request = urllib.request.Request(args["url"], data=data, headers=headers,
                                         method=args.get("method", "GET").upper())
        try:
            response = urllib.request.urlopen(request, timeout=float(args.get("timeout", 30)))
        except urllib.error.HTTPError as exc:
            raise ToolError(f"{request.method} {args['url']} answered {exc.code} {exc.reason}") from exc
        except OSError as exc:
            raise ToolError(f"{request.method} {args['url']} failed: {exc}") from exc
        # Closing the response from another thread aborts a blocked read: that is how a
        # cancelled token stops a slow or streaming response.
        unregister = token.on_cancel(lambda reason: response.close())
        try:
            chunks, size = [], 0
            while size < MAX_BODY:
                token.raise_if_cancelled()
                chunk = response.read1(65536) if hasattr(response, "read1") else response.read(65536)
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
        except (OSError, ValueError, AttributeError) as exc:
            token.raise_if_cancelled()
            raise ToolError(f"reading {args['url']} failed: {exc}") from exc
        finally:
            unregister()
            response.close()
        body = b"".join(chunks).decode("utf-8", errors="replace")
        return {"status": response.status, "body": body[:10_000], "truncated": len(body) > 10_000}
