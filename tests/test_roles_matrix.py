"""Who may do what: every API endpoint (taken from the OpenAPI schema) and every page ×
every kind of identity → the expected status, plus the websockets, plus the audit trail
of every allowed write (actor, action, task, IP).

A new endpoint or page without an entry in the matrices below makes this module fail:
decide who may use it, then add it here.
"""
import json

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.test import Client
from django.conf import settings
from django.urls import URLPattern, URLResolver, get_resolver

from orchestrator.engine import services
from orchestrator.models import AuditEntry, Snapshot, Step, Task, WalEntry
from review.models import ReviewItem
from review.services import review_open
from tests.support.helpers import bearer

TEST_CLIENT_IP = "127.0.0.1"  # REMOTE_ADDR of Django's test client
LOGIN_URL = "/accounts/login/"

# --- the policy -------------------------------------------------------------------------------
# kind -> the identities allowed to do it (orchestrator/roles.py: viewer reads; operator also creates and
# controls tasks; reviewer also decides review items; superusers hold every role).
READ, CREATE, CONTROL, REVIEW, SEND = "read", "create", "control", "review", "send"
ALLOWED = {
    READ: {"viewer", "operator", "reviewer", "superuser"},
    CREATE: {"operator", "superuser"},
    CONTROL: {"operator", "superuser"},
    SEND: {"operator", "superuser"},  # an event into a task
    REVIEW: {"reviewer", "superuser"},
}
IDENTITIES = ["anonymous", "norole", "viewer", "operator", "reviewer", "superuser"]
AUTHENTICATED = IDENTITIES[1:]

# (method, OpenAPI path) -> (kind, audited action or None)
API_MATRIX = {
    ("get", "/api/task-types"): (READ, None),
    ("get", "/api/tasks"): (READ, None),
    ("post", "/api/tasks"): (CREATE, "task.create"),
    ("get", "/api/tasks/{task_id}"): (READ, None),
    ("post", "/api/tasks/{task_id}/pause"): (CONTROL, "task.pause"),
    ("post", "/api/tasks/{task_id}/stop"): (CONTROL, "task.stop"),
    ("post", "/api/tasks/{task_id}/terminate"): (CONTROL, "task.terminate"),
    ("post", "/api/tasks/{task_id}/resume"): (CONTROL, "task.resume"),
    ("post", "/api/tasks/{task_id}/rollback"): (CONTROL, "task.rollback"),
    ("post", "/api/tasks/{task_id}/skip-step"): (CONTROL, "task.skip_step"),
    ("get", "/api/tasks/{task_id}/wal"): (READ, None),
    ("get", "/api/tasks/{task_id}/snapshots"): (READ, None),
    ("get", "/api/tasks/{task_id}/events"): (READ, None),
    ("get", "/api/tasks/{task_id}/audit"): (READ, None),
    ("get", "/api/tasks/{task_id}/export"): (READ, None),
    ("get", "/api/tasks/{task_id}/steps/{step_id}/result"): (READ, None),
    ("post", "/api/tasks/{task_id}/events"): (SEND, "task.event"),
    ("get", "/api/tasks/{task_id}/inbox"): (READ, None),
    ("get", "/api/reviews"): (READ, None),
    ("get", "/api/reviews/{review_id}"): (READ, None),
    ("post", "/api/reviews/{review_id}/decide"): (REVIEW, "review.decide"),
}
# Endpoints authenticated by a signature instead of a user's role (tests/api/test_webhooks.py).
SIGNED_NOT_ROLES = {("post", "/api/hooks/{source}/tasks/{task_id}/events")}
# What an allowed call answers, by kind.
API_OK = {READ: {200}, CREATE: {201}, CONTROL: {200, 409}, REVIEW: {200, 409}, SEND: {202}}

# (method, Django route, POST data) -> (kind, audited action or None). Routes are those of
# the URLconf (admin/, accounts/ and api/ are covered elsewhere).
CONTROL_ACTIONS = ("pause", "stop", "terminate", "resume")
PAGE_MATRIX = {
    ("GET", "", None): (READ, None),
    ("GET", "tasks/new/", None): (CREATE, None),  # the create form is for operators
    ("POST", "tasks/new/", "create"): (CREATE, "task.create"),
    ("GET", "tasks/<int:task_id>/", None): (READ, None),
    **{("POST", "tasks/<int:task_id>/control/", action): (CONTROL, f"task.{action}") for action in CONTROL_ACTIONS},
    # Revising a paused task: the edit form and its preview write nothing; confirm applies.
    ("GET", "tasks/<int:task_id>/edit/", None): (CONTROL, None),
    ("POST", "tasks/<int:task_id>/edit/", "preview"): (CONTROL, None),
    ("POST", "tasks/<int:task_id>/edit/", "confirm"): (CONTROL, "task.edit_params"),
    ("POST", "tasks/<int:task_id>/clone/", "clone"): (CREATE, "task.create"),
    ("GET", "tasks/<int:task_id>/rollback/<int:version>/", None): (CONTROL, None),
    ("POST", "tasks/<int:task_id>/rollback/<int:version>/", "rollback"): (CONTROL, "task.rollback"),
    ("POST", "tasks/<int:task_id>/skip-step/", "skip"): (CONTROL, "task.skip_step"),
    ("POST", "tasks/<int:task_id>/send/", "send"): (SEND, "task.event"),
    ("GET", "review/", None): (READ, None),
    ("GET", "review/<int:review_id>/", None): (READ, None),  # reviewers also get the decision form
    ("POST", "review/<int:review_id>/", "decide"): (REVIEW, "review.decide"),
}
REVIEW_DECISION = {"decision": "skip", "note": "roles matrix"}
# Pages and endpoints that act on a paused task only (with snapshot v1 to roll back to).
NEEDS_PAUSED = ("/edit/", "/rollback/", "/clone/")
PAGE_ROUTES_NOT_IN_MATRIX = ("admin/", "accounts/", "api/")
# Not a page for people: no role opens it, only ORCH_METRICS_TOKEN (tests/test_metrics.py checks
# that a viewer's session or API token is refused).
TOKEN_ROUTES = {"metrics"}


def expected_api_statuses(identity: str, kind: str) -> set[int]:
    if identity == "anonymous":
        return {401}
    return API_OK[kind] if identity in ALLOWED[kind] else {403}


# --- fixtures and helpers ---------------------------------------------------------------------

def make_identity(make_user, identity: str):
    if identity == "anonymous":
        return None
    if identity == "superuser":
        return make_user("root", superuser=True)
    if identity == "norole":
        return make_user("nobody")
    return make_user(f"{identity}-user", identity)


def new_task(*, paused: bool = False) -> Task:
    """A real task (queued); paused when the action under test needs that (resume, and the
    revisions: a parameter edit, a rollback — to snapshot v1, made here)."""
    task = services.task_create(type="demo.pipeline", params={})
    if paused:
        task = services.task_pause(task_id=task.pk)
        Task.objects.filter(pk=task.pk).update(checkpoint_version=1)
        Snapshot.objects.create(task=task, version=1, state={"params": task.params, "steps": {}})
    return Task.objects.get(pk=task.pk)


def needing_a_human(task: Task) -> Task:
    """`task` as a step failure leaves it: needs_human, its first step failed."""
    Step.objects.create(task=task, step_id="stage-01", position=0, status="failed", error="ValueError: bad")
    Task.objects.filter(pk=task.pk).update(status="needs_human")
    return Task.objects.get(pk=task.pk)


SKIP_STEP = {"step_id": "stage-01", "reason": "roles matrix"}


def new_review(task: Task) -> ReviewItem:
    """An open review item on `task` (now awaiting_review), as recovery would leave it."""
    Task.objects.filter(pk=task.pk).update(status="awaiting_review")
    entry = WalEntry.objects.create(task=task, step_id="send-001", call_index=0, tool="email.send",
                                    args={"to": "a@example.org", "subject": "s"}, idempotency_key=f"t{task.pk}:send-001:0",
                                    idempotent=False, lease_epoch=1, worker="host:1")
    review_open(entry=entry, reason="roles matrix", dead_worker="host:1")
    task.refresh_from_db()
    return ReviewItem.objects.get(wal_entry=entry)


def review_state(review: ReviewItem | None):
    if review is None:
        return None
    return (ReviewItem.objects.filter(pk=review.pk).values_list("status", "decision", "decided_by").get(),
            WalEntry.objects.get(pk=review.wal_entry_id).status)


def assert_audited(*, user, action: str, task_id: int) -> None:
    entries = AuditEntry.objects.filter(action=action, task_id=task_id, actor=user)
    assert entries.count() == 1, (
        f"expected one {action!r} audit entry by {user.username} for task #{task_id}; have "
        f"{list(AuditEntry.objects.filter(task_id=task_id).values_list('action', 'actor_name', 'ip'))}")
    for entry in entries:
        assert entry.actor_name == user.username
        assert entry.ip == TEST_CLIENT_IP


def assert_nothing_written(*, audit_before: int, tasks_before: int, task: Task, review: ReviewItem | None = None,
                           review_before=None) -> None:
    assert AuditEntry.objects.count() == audit_before, "a refused request wrote an audit entry"
    assert Task.objects.count() == tasks_before, "a refused request created a task"
    status = task.status
    task.refresh_from_db()
    assert task.status == status, "a refused request changed the task"
    assert review_state(review) == review_before, "a refused request changed the review item"


# --- the API ----------------------------------------------------------------------------------

@pytest.mark.django_db
def test_every_api_endpoint_has_a_matrix_entry(client):
    schema = client.get("/api/openapi.json").json()
    operations = {(method.lower(), path) for path, methods in schema["paths"].items() for method in methods
                  if method.lower() in {"get", "post", "put", "patch", "delete"}}
    missing = operations - set(API_MATRIX) - set(SIGNED_NOT_ROLES)
    stale = set(API_MATRIX) - operations
    assert not missing, f"API endpoints without a roles-matrix entry (add them to API_MATRIX): {sorted(missing)}"
    assert not stale, f"API_MATRIX entries for endpoints that no longer exist: {sorted(stale)}"


API_CASES = [pytest.param(method, path, identity, auth, id=f"{method.upper()} {path} {identity} {auth}")
             for (method, path) in API_MATRIX
             for identity in IDENTITIES
             for auth in (("none", "bad-token") if identity == "anonymous" else ("session", "bearer"))]


@pytest.mark.django_db
@pytest.mark.parametrize("method,path,identity,auth", API_CASES)
def test_api_matrix(client, make_user, method, path, identity, auth):
    kind, action = API_MATRIX[(method, path)]
    user = make_identity(make_user, identity)
    task = new_task(paused=action in ("task.resume", "task.rollback"))
    if action == "task.skip_step":
        task = needing_a_human(task)
    review = new_review(task) if "{review_id}" in path else None
    headers = {}
    if auth == "session":
        client.force_login(user)
    elif auth == "bearer":
        headers = bearer(user)
    elif auth == "bad-token":
        headers = {"HTTP_AUTHORIZATION": "Bearer orch_not-a-real-token"}
    if "{step_id}" in path:
        Step.objects.get_or_create(task=task, step_id="matrix-step", defaults={"position": 99, "result": {"ok": 1}})
    url = (path.replace("{task_id}", str(task.pk)).replace("{review_id}", str(review.pk) if review else "")
           .replace("{step_id}", "matrix-step"))
    audit_before, tasks_before = AuditEntry.objects.count(), Task.objects.count()
    review_before = review_state(review)

    if method == "get":
        response = client.get(url, **headers)
    else:
        body = {CREATE: {"type": "demo.pipeline", "params": {}}, REVIEW: REVIEW_DECISION}.get(
            kind, {"reason": "roles matrix"})
        if path.endswith("/rollback"):
            body = {"version": 1}
        elif path.endswith("/skip-step"):
            body = SKIP_STEP
        elif path.endswith("/events"):
            body = {"type": "progress.external", "payload": {"message": "from the roles matrix"}}
        response = client.post(url, body, content_type="application/json", **headers)

    expected = expected_api_statuses(identity, kind)
    assert response.status_code in expected, (
        f"{method.upper()} {url} as {identity} ({auth}): {response.status_code} {response.content[:300]!r}; "
        f"expected {sorted(expected)}")
    if response.status_code in (401, 403):
        assert "detail" in response.json()
        assert_nothing_written(audit_before=audit_before, tasks_before=tasks_before, task=task, review=review,
                               review_before=review_before)
    elif kind == CREATE:
        assert_audited(user=user, action=action, task_id=response.json()["id"])
    elif kind in (CONTROL, REVIEW) and response.status_code == 200 or kind == SEND:
        assert_audited(user=user, action=action, task_id=task.pk)


@pytest.mark.django_db
def test_api_session_writes_need_the_csrf_token_but_bearer_writes_do_not(make_user):
    operator = make_user("csrf-operator", "operator")
    client = Client(enforce_csrf_checks=True)
    client.force_login(operator)
    body = {"type": "demo.pipeline", "params": {}}
    assert client.post("/api/tasks", body, content_type="application/json").status_code == 403
    assert not Task.objects.exists()
    token_client = Client(enforce_csrf_checks=True)
    response = token_client.post("/api/tasks", body, content_type="application/json", **bearer(operator))
    assert response.status_code == 201, response.content


# --- the pages --------------------------------------------------------------------------------

def page_routes() -> set[str]:
    routes = set()

    def walk(patterns, prefix: str) -> None:
        for pattern in patterns:
            route = prefix + str(pattern.pattern)
            if isinstance(pattern, URLResolver):
                if not route.startswith(PAGE_ROUTES_NOT_IN_MATRIX):
                    walk(pattern.url_patterns, route)
            elif isinstance(pattern, URLPattern) and route not in TOKEN_ROUTES:
                routes.add(route)

    walk(get_resolver().url_patterns, "")
    return routes


def test_every_page_has_a_matrix_entry():
    in_matrix = {route for (_method, route, _data) in PAGE_MATRIX}
    missing = page_routes() - in_matrix
    stale = in_matrix - page_routes()
    assert not missing, f"pages without a roles-matrix entry (add them to PAGE_MATRIX): {sorted(missing)}"
    assert not stale, f"PAGE_MATRIX entries for pages that no longer exist: {sorted(stale)}"


PAGE_CASES = [pytest.param(method, route, data, identity, id=f"{method} /{route} {data or ''} {identity}")
              for (method, route, data) in PAGE_MATRIX for identity in IDENTITIES]


@pytest.mark.django_db
@pytest.mark.parametrize("method,route,data,identity", PAGE_CASES)
def test_page_matrix(client, make_user, method, route, data, identity):
    kind, action = PAGE_MATRIX[(method, route, data)]
    user = make_identity(make_user, identity)
    task = new_task(paused=data == "resume" or any(part in "/" + route for part in NEEDS_PAUSED))
    if data == "skip":
        task = needing_a_human(task)
    review = new_review(task) if route.startswith("review/") else None
    if user is not None:
        client.force_login(user)
    url = "/" + route.replace("<int:task_id>", str(task.pk)).replace("<int:review_id>", str(review.pk) if review else "")
    url = url.replace("<int:version>", "1")
    audit_before, tasks_before = AuditEntry.objects.count(), Task.objects.count()
    review_before = review_state(review)
    nothing_written = dict(audit_before=audit_before, tasks_before=tasks_before, task=task, review=review,
                           review_before=review_before)

    if method == "GET":
        response = client.get(url)
    elif data == "create":
        response = client.post(url, {"type": "demo.pipeline", "title": "from the matrix"})
    elif data == "decide":
        response = client.post(url, REVIEW_DECISION)
    elif data == "preview":
        response = client.post(url, {"preview": "1"})
    elif data == "confirm":
        response = client.post(url, {"confirm": "1", "params": json.dumps(task.params), "limits": "{}",
                                     "expected_version": task.event_seq})
    elif data == "clone":
        response = client.post(url, {"params": json.dumps(task.params), "limits": "{}"})
    elif data == "rollback":
        response = client.post(url, {"expected_version": task.event_seq})
    elif data == "skip":
        response = client.post(url, SKIP_STEP)
    elif data == "send":
        response = client.post(url, {"type": "progress.external", "payload": '{"message": "from the matrix"}'})
    else:
        response = client.post(url, {"action": data, "reason": "roles matrix"})

    where = f"{method} {url} {data or ''} as {identity}"
    if identity == "anonymous":
        assert response.status_code == 302, where
        assert response["Location"].startswith(LOGIN_URL + "?next="), (where, response["Location"])
        assert_nothing_written(**nothing_written)
    elif identity not in ALLOWED[kind]:
        assert response.status_code == 403, (where, response.status_code)
        assert_nothing_written(**nothing_written)
    elif method == "GET" or data == "preview":
        assert response.status_code == 200, (where, response.status_code)
        if action is None:
            assert_nothing_written(**nothing_written)
        if route == "review/<int:review_id>/":  # only reviewers get the decision form
            has_form = b'data-testid="decision-form"' in response.content
            assert has_form == (identity in ALLOWED[REVIEW]), (where, has_form)
    elif data == "decide":
        assert response.status_code == 302, (where, response.status_code, response.content[:500])
        assert response["Location"] == "/review/"
        assert_audited(user=user, action=action, task_id=task.pk)
        assert ReviewItem.objects.get(pk=review.pk).decided_by == user
    elif data in ("create", "clone"):
        assert response.status_code == 302, (where, response.status_code, response.content[:500])
        created = Task.objects.exclude(pk=task.pk).get()
        assert response["Location"] == f"/tasks/{created.pk}/"
        assert_audited(user=user, action=action, task_id=created.pk)
    else:
        assert response.status_code == 302, (where, response.status_code)
        assert response["Location"].split("#")[0] == f"/tasks/{task.pk}/"
        assert_audited(user=user, action=action, task_id=task.pk)


# --- the websockets ---------------------------------------------------------------------------

# A page of this site: the origin the browser sends, port included (see orchestrator/origins.py).
ORIGIN = [(b"origin", f"http://localhost:{settings.PORT}".encode())]


def session_headers(user) -> list:
    if user is None:
        return list(ORIGIN)
    client = Client()
    client.force_login(user)
    return ORIGIN + [(b"cookie", f"sessionid={client.cookies['sessionid'].value}".encode())]


@pytest.fixture
def ws_setup(make_user, request):
    identity = request.param
    user = make_identity(make_user, identity)
    task = services.task_create(type="demo.pipeline", params={})
    return identity, session_headers(user), task


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("path", ["/ws/tasks/", "/ws/tasks/{task_id}/"])
@pytest.mark.parametrize("ws_setup", IDENTITIES, indirect=True)
async def test_websocket_matrix(ws_setup, path):
    from orchestrator.asgi import application

    identity, headers, task = ws_setup
    communicator = WebsocketCommunicator(application, path.format(task_id=task.pk), headers=headers)
    connected, code = await communicator.connect(timeout=5)
    try:
        if identity in ALLOWED[READ]:
            assert connected, (identity, code)
            first = await communicator.receive_json_from(timeout=5)
            assert first["type"] == "state"
        else:
            assert not connected, identity
    finally:
        if connected:
            await communicator.disconnect()


@pytest.mark.django_db(transaction=True)
async def test_websocket_without_origin_is_refused_even_for_a_viewer(make_user):
    from orchestrator.asgi import application

    user = await database_sync_to_async(make_user)("ws-viewer", "viewer")
    headers = [h for h in await database_sync_to_async(session_headers)(user) if h[0] != b"origin"]
    communicator = WebsocketCommunicator(application, "/ws/tasks/", headers=headers)
    connected, _ = await communicator.connect(timeout=5)
    assert not connected
