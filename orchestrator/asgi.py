import os

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "orchestrator.settings")

from django.apps import apps  # noqa: E402
from django.conf import settings  # noqa: E402

if not apps.ready and settings.WEB_DATABASE is not None:
    # This process starts as the web server (daphne imports this module before Django is set
    # up): its connections come from a pool (settings.WEB_DATABASE says why). A process that
    # was set up before importing this (the tests, runserver) keeps the connections it has.
    settings.DATABASES["default"] = settings.WEB_DATABASE
# Initialise Django before anything imports models (the consumers do).
django.setup(set_prefix=False)

from asgiref.sync import sync_to_async  # noqa: E402
from django.core.handlers.asgi import ASGIHandler  # noqa: E402


class OneHopASGIHandler(ASGIHandler):
    """Django's ASGI handler with its middleware chain and view run as one synchronous call in
    the request's thread. Every view here is synchronous and every middleware is a MiddlewareMixin,
    whose sync hooks Django's async chain enters one sync_to_async each: a POST /api/tasks crossed
    from the event loop into a thread 6 times, now 2 (tests/test_asgi_handler.py), ~0.7 ms less of
    daphne's CPU per POST (docs/benchmarks.md). An async view would still work (Django runs it
    with async_to_sync), without gaining from it."""

    def load_middleware(self, is_async=False):
        super().load_middleware(is_async=False)

    async def get_response_async(self, request):
        return await sync_to_async(self.get_response, thread_sensitive=True)(request)


django_asgi_app = OneHopASGIHandler()

from . import extensions  # noqa: E402

# daphne runs no system checks: a module of ORCH_EXTENSIONS that cannot be imported stops it here, named.
extensions.require()

from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.core.signals import request_finished  # noqa: E402
from django.db import connections  # noqa: E402

from .origins import SameOriginValidator  # noqa: E402
from .routing import websocket_urlpatterns  # noqa: E402



def close_request_connections(**kwargs) -> None:
    """Under ASGI each HTTP request runs its sync code in a thread of its own (asgiref's
    ThreadSensitiveContext), so a persistent connection (CONN_MAX_AGE, kept for the workers)
    is never reused: it stays open after its thread is gone, until garbage collection. A
    flood of 600 API requests from 8 clients left ~90 idle and PostgreSQL refused the next
    ones ("too many clients", 500s). request_finished runs in the request's thread, so this
    closes exactly that request's connections; the live pollers' shared thread keeps its own."""
    connections.close_all()


# Only for requests served over ASGI: the test client's requests (ClientHandler) run in the
# test's own thread, whose connection the test still needs.
request_finished.connect(close_request_connections, sender=OneHopASGIHandler,
                         dispatch_uid="orchestrator.asgi.close_request_connections")

application = ProtocolTypeRouter({
    "http": django_asgi_app,
    # The Origin must be this site's (scheme, host and port; see origins.py); a websocket
    # without an Origin is refused.
    "websocket": SameOriginValidator(AuthMiddlewareStack(URLRouter(websocket_urlpatterns))),
})
