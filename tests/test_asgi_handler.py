"""The web server's HTTP handler (orchestrator/asgi.py, OneHopASGIHandler): every view and
middleware here is synchronous, so a request crosses from daphne's event loop into a thread once
for its whole middleware chain and view, not once per sync hook (Django's async chain wraps each
sync hook of a MiddlewareMixin, the exception wrapper and the view in a sync_to_async of its own:
6 crossings for a POST /api/tasks here, each a thread handoff of daphne's CPU). The middleware
still all runs."""
import json

import pytest
from asgiref import sync
from channels.testing import HttpCommunicator

from orchestrator.auth import token_issue

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def crossings(monkeypatch):
    """How many times a thread was entered from the event loop (sync_to_async calls)."""
    counted = []
    original = sync.SyncToAsync.__call__

    async def counting(self, *args, **kwargs):
        counted.append(getattr(self.func, "__qualname__", repr(self.func)))
        return await original(self, *args, **kwargs)

    monkeypatch.setattr(sync.SyncToAsync, "__call__", counting)
    return counted


async def request(method: str, path: str, body: bytes = b"", headers=()) -> dict:
    from orchestrator.asgi import application

    communicator = HttpCommunicator(application, method, path, body=body,
                                    headers=[(b"host", b"localhost"), *headers])
    return await communicator.get_response(timeout=10)


async def test_a_post_crosses_into_a_thread_once_for_its_middleware_and_view(crossings, admin_user):
    from channels.db import database_sync_to_async

    token = await database_sync_to_async(token_issue)(user=admin_user, expires_in_days=1)
    crossings.clear()
    response = await request("POST", "/api/tasks", json.dumps({"type": "demo.pipeline", "params": {"stages": 1}}).encode(),
                             [(b"authorization", f"Bearer {token}".encode()), (b"content-type", b"application/json")])
    assert response["status"] == 201, response["body"][:300]
    chain = [name for name in crossings if name.endswith("get_response")]
    assert len(chain) == 1, crossings
    # The chain and the request_started signal's sync receivers: nothing per middleware (6 before).
    assert len(crossings) <= 2, crossings


async def test_every_middleware_still_runs_on_a_page(crossings):
    response = await request("GET", "/accounts/login/")
    assert response["status"] == 200
    headers = {name.decode().lower(): value.decode() for name, value in response["headers"]}
    assert headers["x-frame-options"] == "DENY"  # XFrameOptionsMiddleware
    assert "content-security-policy" in headers  # CSPMiddleware
    assert headers.get("x-content-type-options") == "nosniff"  # SecurityMiddleware
    assert "csrftoken" in headers.get("set-cookie", "")  # CsrfViewMiddleware (the login form's token)
