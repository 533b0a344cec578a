"""Bad input against the API and the admin: oversized bodies, out-of-range integers,
unreadable JSON, bad or expired bearer tokens, session POSTs without CSRF."""
import json
from datetime import timedelta

import pytest
from django.conf import settings
from django.contrib import admin
from django.core.management import call_command
from django.test import Client
from django.utils import timezone

from orchestrator.auth import hash_token, token_issue
from orchestrator.engine import services
from orchestrator.models import ApiToken, Task
from tests.support.helpers import bearer

pytestmark = pytest.mark.django_db

BIG = "99999999999999999999"  # > 2**64


@pytest.fixture
def operator(make_user):
    return make_user("olga", "operator", "viewer", "reviewer")


# --- 1. request size ------------------------------------------------------------------------

def test_a_body_over_the_limit_gets_413_with_a_json_message_saying_the_limit(client, operator):
    client.raise_request_exception = False
    body = json.dumps({"type": "demo.migrate_rows", "params": {"pad": "x" * (settings.ORCH_MAX_REQUEST_BYTES + 10)}})
    response = client.post("/api/tasks", body, content_type="application/json", **bearer(operator))
    assert response.status_code == 413, response.content[:300]
    detail = response.json()["detail"]
    assert str(settings.ORCH_MAX_REQUEST_BYTES) in detail and "ORCH_MAX_REQUEST_BYTES" in detail
    assert not Task.objects.exists()


def test_the_request_limit_setting_drives_django_s_upload_limit():
    assert settings.DATA_UPLOAD_MAX_MEMORY_SIZE == settings.ORCH_MAX_REQUEST_BYTES == 2_621_440


def test_unreadable_json_gets_400_saying_so(client, operator):
    response = client.post("/api/tasks", "{not json", content_type="application/json", **bearer(operator))
    assert response.status_code == 400
    assert "valid JSON" in response.json()["detail"]


# --- 2. out-of-range integers -------------------------------------------------------------------

@pytest.mark.parametrize("path", [
    f"/api/reviews?task={BIG}",
    f"/api/tasks?before={BIG}",
    f"/api/tasks/{BIG}",
    f"/api/tasks/{BIG}/wal",
    f"/api/tasks/1/events?after={BIG}",
    f"/api/reviews/{BIG}",
    "/api/reviews?task=0",
    "/api/reviews?status=bogus",
])
def test_out_of_range_integers_in_queries_and_paths_get_422(client, operator, path):
    client.raise_request_exception = False
    response = client.get(path, **bearer(operator))
    assert response.status_code == 422, (path, response.status_code, response.content[:300])
    assert response.json()["detail"].startswith("Invalid input")


def test_an_out_of_range_id_in_a_post_path_gets_422(client, operator):
    client.raise_request_exception = False
    response = client.post(f"/api/tasks/{BIG}/pause", {}, content_type="application/json", **bearer(operator))
    assert response.status_code == 422


def task_filtered_admin_lists():
    """Every admin changelist that takes `?task__id__exact=` (the links from a task)."""
    from orchestrator.admin import TaskFilter

    return sorted(f"/admin/{m._meta.app_label}/{m._meta.model_name}/" for m, ma in admin.site._registry.items()
                  if TaskFilter in ma.list_filter)


def test_the_task_filter_is_on_the_task_record_lists():
    assert {"/admin/orchestrator/step/", "/admin/orchestrator/walentry/", "/admin/review/reviewitem/",
            "/admin/orchestrator/auditentry/"} <= set(task_filtered_admin_lists())


@pytest.mark.parametrize("query", [f"task__id__exact={BIG}", f"created_at__year={BIG}", f"at__year={BIG}",
                                   f"detected_at__year={BIG}", f"started_at__year={BIG}"])
def test_admin_lists_answer_out_of_range_filters_without_a_500(client, make_user, query):
    """SQLite raises OverflowError, PostgreSQL DataError: both become the admin's `?e=1`."""
    client.force_login(make_user("root", superuser=True))
    client.raise_request_exception = False
    services.task_create(type="demo.pipeline", params={})
    for base in task_filtered_admin_lists() + ["/admin/orchestrator/task/", "/admin/orchestrator/apitoken/"]:
        response = client.get(base + "?" + query)
        assert response.status_code in (200, 302), (base, query, response.status_code)
        if response.status_code == 302:
            assert response["Location"].endswith("?e=1")
    # The session and the database connection still work afterwards.
    assert client.get("/admin/orchestrator/step/").status_code == 200


# --- 6. authentication errors ---------------------------------------------------------------------

def test_a_wrong_bearer_token_on_a_post_gets_401_not_a_csrf_403(operator):
    client = Client(enforce_csrf_checks=True)
    response = client.post("/api/tasks", {"type": "demo.pipeline"}, content_type="application/json",
                           HTTP_AUTHORIZATION="Bearer orch_wrong")
    assert response.status_code == 401
    assert "Invalid bearer token" in response.json()["detail"]
    assert response["WWW-Authenticate"].startswith("Bearer")


def test_no_credentials_on_a_post_gets_401_saying_how_to_authenticate():
    client = Client(enforce_csrf_checks=True)
    response = client.post("/api/tasks", {"type": "demo.pipeline"}, content_type="application/json")
    assert response.status_code == 401
    assert "Authorization: Bearer" in response.json()["detail"]


def test_a_good_bearer_token_needs_no_csrf(operator):
    client = Client(enforce_csrf_checks=True)
    response = client.post("/api/tasks", {"type": "demo.pipeline"}, content_type="application/json",
                           **bearer(operator))
    assert response.status_code == 201


def test_session_posts_still_need_the_csrf_token(operator):
    client = Client(enforce_csrf_checks=True)
    client.force_login(operator)
    response = client.post("/api/tasks", {"type": "demo.pipeline"}, content_type="application/json")
    assert response.status_code == 403
    assert "CSRF" in response.json()["detail"]
    assert not Task.objects.exists()
    client.get("/")  # sets the csrftoken cookie
    token = client.cookies["csrftoken"].value
    response = client.post("/api/tasks", {"type": "demo.pipeline"}, content_type="application/json",
                           HTTP_X_CSRFTOKEN=token)
    assert response.status_code == 201
    assert client.get("/api/tasks").status_code == 200  # session GETs need no token


# --- 10. token expiry -----------------------------------------------------------------------------

def test_an_expired_token_gets_401_token_expired(client, operator):
    raw = token_issue(user=operator, expires_in_days=1)
    headers = {"HTTP_AUTHORIZATION": f"Bearer {raw}"}
    assert client.get("/api/tasks", **headers).status_code == 200
    ApiToken.objects.filter(token_hash=hash_token(raw)).update(expires_at=timezone.now() - timedelta(seconds=1))
    response = client.get("/api/tasks", **headers)
    assert response.status_code == 401
    assert "token expired" in response.json()["detail"].lower()


def test_a_token_without_expiry_keeps_working(client, operator):
    raw = token_issue(user=operator)
    assert ApiToken.objects.get(token_hash=hash_token(raw)).expires_at is None
    assert client.get("/api/tasks", HTTP_AUTHORIZATION=f"Bearer {raw}").status_code == 200


def test_apitoken_command_takes_expires_in_days(operator, capsys):
    call_command("apitoken", operator.username, "--expires-in-days", "7")
    raw = capsys.readouterr().out.strip().splitlines()[-1]
    token = ApiToken.objects.get(token_hash=hash_token(raw))
    assert timedelta(days=6, hours=23) < token.expires_at - timezone.now() <= timedelta(days=7)


def test_apitoken_command_refuses_a_non_positive_expiry(operator):
    from django.core.management.base import CommandError

    with pytest.raises(CommandError, match="positive"):
        call_command("apitoken", operator.username, "--expires-in-days", "0")


def test_the_admin_shows_token_expiry(client, make_user, operator):
    client.force_login(make_user("root", superuser=True))
    token_issue(user=operator, expires_in_days=3)
    body = client.get("/admin/orchestrator/apitoken/").content.decode()
    assert "expires" in body.lower()
    token = ApiToken.objects.get()
    assert "Expires at" in client.get(f"/admin/orchestrator/apitoken/{token.pk}/change/").content.decode()


def test_a_token_s_last_use_is_kept_to_the_minute_without_a_write_per_request(operator, django_assert_num_queries):
    """Every request writing last_used_at made the token's row a lock all concurrent clients of
    one token queued on; it is written when a minute has passed since the last write."""
    from orchestrator.auth import token_authenticate

    raw = token_issue(user=operator)
    assert token_authenticate(raw) == operator
    first = ApiToken.objects.get(token_hash=hash_token(raw)).last_used_at
    assert first is not None
    with django_assert_num_queries(1):  # the lookup only
        token_authenticate(raw)
    assert ApiToken.objects.get(token_hash=hash_token(raw)).last_used_at == first
    ApiToken.objects.filter(token_hash=hash_token(raw)).update(last_used_at=first - timedelta(minutes=2))
    token_authenticate(raw)
    assert ApiToken.objects.get(token_hash=hash_token(raw)).last_used_at > first


def test_a_review_filter_with_a_nul_character_is_not_a_server_error(client, operator):
    """Found by the schema fuzzer on PostgreSQL (which cannot compare a string holding NUL): the
    `tool` filter of GET /api/reviews answered 500, and the review page's too. The character is
    dropped, as the task list's filters do."""
    response = client.get("/api/reviews", {"tool": "db\x00.upsert", "status": "all"}, **bearer(operator))
    assert response.status_code == 200, response.content
    client.force_login(operator)
    assert client.get("/review/", {"tool": "db\x00.upsert"}).status_code == 200


# --- NUL characters: PostgreSQL stores and compares none ------------------------------------

NUL_BODIES = [  # (path of the request, body, where the message says the NUL is); each a 500 on PostgreSQL before
    ("/api/tasks", {"type": "demo.migrate_rows", "title": "a\x00b", "params": {"rows": 10}}, "in title"),
    ("/api/tasks", {"type": "demo.migrate_rows", "params": {"rows": 10, "x\x00": 1}}, "in the key 'params.x'"),
    ("/api/tasks/{task}/pause", {"reason": "lunch\x00"}, "in reason"),
    ("/api/tasks/{task}/stop", {"reason": "done\x00"}, "in reason"),
    ("/api/tasks/{task}/events", {"type": "upstream.ready", "payload": {"resource": "orders\x00.csv"}},
     "in payload.resource"),
    ("/api/tasks/{task}/events", {"type": "upstream.ready", "payload": {"resource": "orders.csv", "x": ["a\x00"]}},
     "in payload.x[0]"),
]


@pytest.mark.parametrize("path, body, where", NUL_BODIES, ids=[f"{p} {w}" for p, _, w in NUL_BODIES])
def test_a_json_body_holding_a_nul_character_is_refused_with_400_saying_where(client, operator, path, body, where):
    client.raise_request_exception = False
    task = services.task_create(type="demo.pipeline", params={})
    tasks_before = Task.objects.count()
    response = client.post(path.format(task=task.pk), json.dumps(body), content_type="application/json",
                           **bearer(operator))
    assert response.status_code == 400, response.content[:300]
    detail = response.json()["detail"]
    assert "NUL character" in detail and where in detail, detail
    task.refresh_from_db()  # nothing was done: no task, no verb, no event
    assert (Task.objects.count(), task.status, task.control) == (tasks_before, "queued", "")
    assert not task.inbox.exists()


def test_a_path_with_a_nul_character_is_refused_with_400(client):
    """A webhook's source name with NUL in it was looked up and answered 500 on PostgreSQL."""
    client.raise_request_exception = False
    response = client.post("/api/hooks/ware%00house/tasks/1/events", "{}", content_type="application/json")
    assert response.status_code == 400
    assert "NUL character" in response.json()["detail"]


@pytest.mark.parametrize("path", ["/api/reviews", "/api/tasks"])
def test_a_query_parameter_given_more_than_once_is_refused_with_422_naming_it(client, operator, path):
    # Found by tests/api/test_schemathesis.py: ?limit=false&limit=-3&limit=6207605281318786.0 was
    # a 200 (the last value taken, the others never read).
    answer = client.get(f"{path}?limit=false&limit=-3&limit=5", **bearer(operator))
    assert answer.status_code == 422, answer.content
    assert answer.json()["errors"] == [{"field": "limit", "message": "given 3 times; give it once"}]
    assert client.get(f"{path}?limit=5", **bearer(operator)).status_code == 200
