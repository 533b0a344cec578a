"""The websocket origin check: a browser page may open the dashboard's websockets only
from this site's own origin — scheme, host *and* port.

channels' AllowedHostsOriginValidator compares the Origin's host with ALLOWED_HOSTS and
ignores its port, so a page served by any other program on the same host (say
http://127.0.0.1:1) could open an operator's websocket with their session cookie. Here the
Origin must equal one of:

- CSRF_TRUSTED_ORIGINS (by default http://<each ALLOWED_HOSTS entry>:<PORT>; set it to
  your public origin, e.g. https://orchestrator.example.com, behind a proxy), where
  ``https://*.example.com`` matches subdomains as in Django's CSRF check; or
- the connection's own origin: its Host header (which must be in ALLOWED_HOSTS) with the
  connection's scheme (ws → http, wss → https).

A websocket without an Origin header is refused.
"""
from urllib.parse import urlsplit

from channels.security.websocket import WebsocketDenier
from django.conf import settings
from django.http.request import split_domain_port, validate_host

DEFAULT_PORTS = {"http": 80, "https": 443}


def normalize(origin: str):
    """(scheme, host, port) of an origin, the port made explicit; None if malformed."""
    try:
        parts = urlsplit(origin.strip())
        scheme, host, port = parts.scheme.lower(), (parts.hostname or "").lower(), parts.port
    except ValueError:  # a bad port ("http://host:x" or out of range)
        return None
    if scheme not in DEFAULT_PORTS or not host or parts.path not in ("", "/") or parts.username or parts.query:
        return None
    return scheme, host, port if port is not None else DEFAULT_PORTS[scheme]


def trusted(origin: tuple, pattern: str) -> bool:
    """Whether `origin` is the trusted origin `pattern` ("https://*.example.com" also
    matches the subdomains of example.com, on the same scheme and port)."""
    scheme, sep, rest = pattern.strip().partition("://")
    wildcard = rest.startswith("*.")
    wanted = normalize(f"{scheme}{sep}{rest[2:] if wildcard else rest}")
    if wanted is None:
        return False
    if wildcard:
        return origin[0] == wanted[0] and origin[2] == wanted[2] and origin[1].endswith("." + wanted[1])
    return origin == wanted


def same_origin(origin: tuple, scope) -> bool:
    headers = dict(scope.get("headers", []))
    try:
        host = headers.get(b"host", b"").decode("latin1").strip().lower()
    except UnicodeDecodeError:
        return False
    if not host:
        return False
    domain, _port = split_domain_port(host)
    if not domain or not validate_host(domain, settings.ALLOWED_HOSTS):
        return False
    scheme = "https" if scope.get("scheme") == "wss" else "http"
    return origin == normalize(f"{scheme}://{host}")


def origin_allowed(origin_header: str | None, scope) -> bool:
    if not origin_header:
        return False
    origin = normalize(origin_header)
    if origin is None:
        return False
    return any(trusted(origin, pattern) for pattern in settings.CSRF_TRUSTED_ORIGINS) or same_origin(origin, scope)


class SameOriginValidator:
    """ASGI middleware: refuse (HTTP 403 at the handshake) a websocket whose Origin is not allowed."""

    def __init__(self, application):
        self.application = application

    async def __call__(self, scope, receive, send):
        if scope["type"] != "websocket":
            raise ValueError("SameOriginValidator is for websocket connections only")
        origin = None
        for name, value in scope.get("headers", []):
            if name == b"origin":
                try:
                    origin = value.decode("latin1")
                except UnicodeDecodeError:
                    origin = None
        if origin_allowed(origin, scope):
            return await self.application(scope, receive, send)
        return await WebsocketDenier()(scope, receive, send)
