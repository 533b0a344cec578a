"""The HTTP API through Django's test client: auth, validation, roles, control."""
import pytest
from django.core.management import call_command

from orchestrator.engine import services
from orchestrator.models import AuditEntry, Task
from tests.support.helpers import bearer

pytestmark = pytest.mark.django_db


@pytest.fixture
def operator(make_user):
    return make_user("olga", "operator")


def test_anonymous_requests_get_401(client):
    assert client.get("/api/tasks").status_code == 401
    assert client.post("/api/tasks", {"type": "demo.migrate_rows"}, content_type="application/json").status_code == 401
    assert client.get("/api/tasks", HTTP_AUTHORIZATION="Bearer not-a-token").status_code == 401


def test_openapi_schema_is_public_and_lists_the_endpoints(client):
    schema = client.get("/api/openapi.json").json()
    assert {"/api/tasks", "/api/tasks/{task_id}", "/api/task-types", "/api/tasks/{task_id}/wal"} <= set(schema["paths"])


def test_task_types_include_params_json_schema(client, operator):
    types = {t["name"]: t for t in client.get("/api/task-types", **bearer(operator)).json()}
    assert set(types) == {"demo.migrate_rows", "demo.contracts", "demo.notify", "demo.pipeline", "agent.plan_execute"}
    schema = types["demo.migrate_rows"]["params_schema"]
    assert schema["properties"]["batch_size"]["default"] == 500


def test_create_list_and_show_a_task_with_a_bearer_token(client, operator):
    headers = bearer(operator)
    response = client.post("/api/tasks", {"type": "demo.migrate_rows", "params": {"rows": 5000, "batch_size": 500,
                                                                                   "rate": 2.0}},
                           content_type="application/json", **headers)
    assert response.status_code == 201, response.content
    created = response.json()
    assert created["status"] == "queued"
    assert created["params"] == {"rows": 5000, "batch_size": 500, "rate": 2.0}
    assert created["limits"]["max_subtasks"] >= 1
    detail = client.get(f"/api/tasks/{created['id']}", **headers).json()
    assert {"status", "params", "limits", "counters", "checkpoint_version", "heartbeat_at", "worker", "steps"} <= set(detail)
    listed = client.get("/api/tasks?status=queued&type=demo.migrate_rows", **headers).json()
    assert [t["id"] for t in listed["items"]] == [created["id"]]
    assert client.get("/api/tasks?status=completed", **headers).json()["items"] == []
    audit = AuditEntry.objects.get(action="task.create")
    assert audit.actor == operator and audit.task_id == created["id"]


def test_the_answer_to_a_create_is_the_task_as_a_get_shows_it_before_a_worker_takes_it(client, operator):
    """POST /api/tasks answers without reading steps, model calls or reviews (a new task has none):
    the answer must be what GET shows for the same task, field for field."""
    from orchestrator.engine import llm_ledger

    headers = bearer(operator)
    ahead = client.post("/api/tasks", {"type": "demo.migrate_rows", "params": {"rows": 100}},
                        content_type="application/json", **headers)
    assert ahead.status_code == 201, ahead.content  # the new one is 2nd of 2
    created = client.post("/api/tasks", {"type": "demo.migrate_rows", "params": {"rows": 100}},
                          content_type="application/json", **headers).json()
    shown = client.get(f"/api/tasks/{created['id']}", **headers).json()
    assert created == shown
    assert created["waiting_on"]["kind"] == "queue" and "2nd of 2 in the queue" in created["waiting_on"]["text"]
    assert llm_ledger.totals(created["id"]) == llm_ledger.NO_CALLS == created["counters"]["model_usage"]


def test_bad_params_get_422_naming_the_field_and_nothing_is_created(client, operator):
    response = client.post("/api/tasks", {"type": "demo.migrate_rows", "params": {"rows": 0, "batch_size": "many"}},
                           content_type="application/json", **bearer(operator))
    assert response.status_code == 422
    fields = {e["field"] for e in response.json()["errors"]}
    assert fields == {"params.rows", "params.batch_size"}
    assert not Task.objects.exists()


def test_unknown_type_and_unknown_param_are_refused(client, operator):
    r = client.post("/api/tasks", {"type": "nope"}, content_type="application/json", **bearer(operator))
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "type"
    r = client.post("/api/tasks", {"type": "demo.pipeline", "params": {"stagez": 3}}, content_type="application/json",
                    **bearer(operator))
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "params.stagez"
    r = client.post("/api/tasks", {"type": "demo.pipeline", "limits": {"max_steps": -1}},
                    content_type="application/json", **bearer(operator))
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "limits.max_steps"


def test_viewer_reads_but_cannot_create_or_control(client, make_user):
    viewer = make_user("vic", "viewer")
    task = services.task_create(type="demo.pipeline", params={})
    headers = bearer(viewer)
    assert client.get(f"/api/tasks/{task.pk}", **headers).status_code == 200
    assert client.post("/api/tasks", {"type": "demo.pipeline"}, content_type="application/json", **headers).status_code == 403
    assert client.post(f"/api/tasks/{task.pk}/pause", content_type="application/json", **headers).status_code == 403
    nobody = make_user("nob")
    assert client.get("/api/tasks", **bearer(nobody)).status_code == 403


def test_pause_of_a_finished_task_is_refused_with_409(client, operator):
    task = services.task_create(type="demo.pipeline", params={})
    Task.objects.filter(pk=task.pk).update(status="completed")
    response = client.post(f"/api/tasks/{task.pk}/pause", content_type="application/json", **bearer(operator))
    assert response.status_code == 409
    assert "completed" in response.json()["detail"]
    assert client.post("/api/tasks/999999/pause", content_type="application/json", **bearer(operator)).status_code == 404


def test_pause_then_resume_of_a_queued_task(client, operator):
    task = services.task_create(type="demo.pipeline", params={})
    headers = bearer(operator)
    assert client.post(f"/api/tasks/{task.pk}/pause", content_type="application/json", **headers).json()["status"] == "paused"
    assert client.post(f"/api/tasks/{task.pk}/pause", content_type="application/json", **headers).json()["status"] == "paused"  # idempotent
    resumed = client.post(f"/api/tasks/{task.pk}/resume", content_type="application/json", **headers).json()
    assert resumed["applied"] and resumed["task"]["status"] == "queued"


def test_history_endpoints(client, operator):
    task = services.task_create(type="demo.pipeline", params={})
    headers = bearer(operator)
    events = client.get(f"/api/tasks/{task.pk}/events", **headers).json()
    assert [e["seq"] for e in events] == [1] and events[0]["kind"] == "created"
    assert client.get(f"/api/tasks/{task.pk}/events?after=1", **headers).json() == []
    assert client.get(f"/api/tasks/{task.pk}/wal", **headers).json() == []
    assert client.get(f"/api/tasks/{task.pk}/snapshots", **headers).json() == []
    assert client.get(f"/api/tasks/{task.pk}/audit", **headers).json()[0]["action"] == "task.create"


def test_apitoken_command_prints_a_working_token_last(client, operator, capsys):
    call_command("apitoken", "olga")
    token = capsys.readouterr().out.strip().splitlines()[-1]
    assert client.get("/api/tasks", HTTP_AUTHORIZATION=f"Bearer {token}").status_code == 200
    from orchestrator.models import ApiToken

    assert token not in {t.token_hash for t in ApiToken.objects.all()}


@pytest.mark.django_db(transaction=True)
def test_resume_params_are_merged_over_the_current_ones(client, operator):
    from orchestrator.engine.worker import drive_inline

    task = services.task_create(type="demo.migrate_rows", params={"rows": 600, "batch_size": 100, "rate": 1.0},
                                limits={"max_steps": 2, "max_subtasks": 1})
    drive_inline(task.pk)
    assert Task.objects.get(pk=task.pk).status == "paused"
    response = client.post(f"/api/tasks/{task.pk}/resume", {"params": {"rate": 2.0}, "dry_run": True},
                           content_type="application/json", **bearer(operator))
    assert response.status_code == 200, response.content
    assert response.json()["preview"]["param_diff"] == {"rate": [1.0, 2.0]}  # rows and batch_size kept
