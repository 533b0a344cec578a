"""The server-rendered pages: access by role, the generated create form, the controls,
and the admin."""
import pytest
from django.contrib.auth.models import Group, User
from django.urls import reverse

from orchestrator.engine import services
from orchestrator.models import ApiToken, AuditEntry, IdempotencyRecord, Snapshot, Step, Task, TaskEvent, WalEntry
from demo.models import DemoContractExtraction, DemoDestination, DemoSource
from tests.support.controls import visible_controls

ALL_MODELS = [Task, Step, WalEntry, Snapshot, TaskEvent, IdempotencyRecord, AuditEntry, ApiToken, DemoSource,
              DemoDestination, DemoContractExtraction]


def make_user(username: str, *groups: str, **extra) -> User:
    user = User.objects.create_user(username=username, password="pw", **extra)
    for name in groups:
        user.groups.add(Group.objects.get(name=name))
    return user


@pytest.fixture
def superuser(db):
    return User.objects.create_superuser(username="root", password="pw", email="root@localhost")


@pytest.fixture
def task(db):
    return services.task_create(type="demo.migrate_rows", params={"rows": 30, "batch_size": 10})


def control_url(task_id: int) -> str:
    return reverse("task_control", kwargs={"task_id": task_id})


def detail_url(task_id: int) -> str:
    return reverse("task_detail", kwargs={"task_id": task_id})


# --- access -------------------------------------------------------------------------------

@pytest.mark.django_db
@pytest.mark.parametrize("url", ["/", "/tasks/new/", "/tasks/1/"])
def test_anonymous_is_redirected_to_login(client, url):
    response = client.get(url)
    assert response.status_code == 302
    assert response["Location"].startswith("/accounts/login/?next=")


@pytest.mark.django_db
def test_login_page_renders(client):
    response = client.get("/accounts/login/")
    assert response.status_code == 200
    assert b'name="username"' in response.content


@pytest.mark.django_db
def test_user_without_a_role_is_forbidden(client):
    client.force_login(make_user("nobody"))
    response = client.get("/")
    assert response.status_code == 403
    assert b"viewer" in response.content


@pytest.mark.django_db
def test_viewer_sees_list_and_detail_without_controls(client, viewer, task):
    client.force_login(viewer)
    response = client.get("/")
    assert response.status_code == 200
    body = response.content.decode()
    assert f'href="{detail_url(task.pk)}"' in body
    assert 'data-testid="task-status"' in body and 'data-testid="progress"' in body
    assert "btn-new-task" not in body

    response = client.get(detail_url(task.pk))
    assert response.status_code == 200
    body = response.content.decode()
    assert 'data-testid="task-status"' in body and ">queued<" in body
    for button in ("btn-stop", "btn-pause", "btn-resume", "btn-terminate"):
        assert button not in body


@pytest.mark.django_db
def test_viewer_cannot_create_or_control(client, viewer, task):
    client.force_login(viewer)
    assert client.get("/tasks/new/").status_code == 403
    assert client.post("/tasks/new/", {"type": "demo.migrate_rows"}).status_code == 403
    assert client.post(control_url(task.pk), {"action": "pause"}).status_code == 403
    task.refresh_from_db()
    assert task.status == "queued"


@pytest.mark.django_db
def test_missing_task_is_404(client, viewer):
    client.force_login(viewer)
    assert client.get(detail_url(999999)).status_code == 404


# --- the list -----------------------------------------------------------------------------

@pytest.mark.django_db
def test_list_filters_and_keyset_pages(client, viewer):
    created = [services.task_create(type="demo.migrate_rows", params={"rows": 5}, title=f"job {i}")
               for i in range(55)]
    client.force_login(viewer)
    response = client.get("/")
    rows = response.context["tasks"]
    assert [t.pk for t in rows] == [t.pk for t in reversed(created)][:50]
    next_before = response.context["next_before"]
    assert next_before == rows[-1].pk
    assert f"before={next_before}".encode() in response.content

    older = client.get("/", {"before": next_before}).context["tasks"]
    assert [t.pk for t in older] == [t.pk for t in reversed(created)][50:]

    assert [t.title for t in client.get("/", {"q": "job 7"}).context["tasks"]] == ["job 7"]
    assert client.get("/", {"status": "paused"}).context["tasks"] == []
    assert len(client.get("/", {"type": "demo.migrate_rows", "status": "queued"}).context["tasks"]) == 50


@pytest.mark.django_db
def test_operator_sees_new_task_button(client, operator):
    client.force_login(operator)
    assert b'data-testid="btn-new-task"' in client.get("/").content


# --- the create form ----------------------------------------------------------------------

@pytest.mark.django_db
def test_new_task_form_is_generated_from_the_schema(client, operator):
    client.force_login(operator)
    response = client.get("/tasks/new/")
    assert response.status_code == 200
    assert b"demo.migrate_rows" in response.content

    body = client.get("/tasks/new/", {"type": "demo.migrate_rows"}).content.decode()
    assert 'name="params.rows"' in body and 'value="20000"' in body and 'min="1"' in body
    assert 'name="params.rate"' in body and 'step="any"' in body
    assert "How many source rows to migrate" in body
    assert 'name="limits.max_steps"' in body

    body = client.get("/tasks/new/", {"type": "demo.notify"}).content.decode()
    assert '<textarea id="id_params.recipients" name="params.recipients"' in body
    assert '<input type="text" id="id_params.subject" name="params.subject"' in body
    assert '<textarea id="id_params.body" name="params.body"' in body


@pytest.mark.django_db
def test_operator_creates_a_task_through_the_form(client, operator):
    client.force_login(operator)
    response = client.post("/tasks/new/", {
        "type": "demo.migrate_rows", "params.rows": "120", "params.batch_size": "40", "params.rate": "1.5",
        "limits.max_steps": "", "limits.max_seconds": "600", "title": "Form run",
    }, REMOTE_ADDR="10.1.2.3")
    task = Task.objects.get()
    assert response.status_code == 302
    assert response["Location"] == detail_url(task.pk)
    assert task.type == "demo.migrate_rows"
    assert task.params == {"rows": 120, "batch_size": 40, "rate": 1.5}
    assert task.limits["max_seconds"] == 600
    assert task.title == "Form run"
    assert task.created_by == operator
    entry = AuditEntry.objects.get(task=task, action="task.create")
    assert entry.actor == operator and entry.ip == "10.1.2.3"

    page = client.get(response["Location"])
    assert page.status_code == 200
    assert b'data-testid="btn-stop"' in page.content


@pytest.mark.django_db
def test_invalid_params_rerender_the_form_with_errors(client, operator):
    client.force_login(operator)
    response = client.post("/tasks/new/", {
        "type": "demo.migrate_rows", "params.rows": "0", "params.batch_size": "77", "params.rate": "1",
        "limits.max_subtasks": "999",
    })
    assert response.status_code == 422
    body = response.content.decode()
    assert 'data-field="params.rows">Input should be greater than or equal to 1' in body
    assert 'data-field="limits.max_subtasks">Input should be less than or equal to 64' in body
    assert 'name="params.rows" value="0"' in body
    assert 'name="params.batch_size" value="77"' in body
    assert 'name="limits.max_subtasks" value="999"' in body
    assert not Task.objects.exists()


@pytest.mark.django_db
def test_notify_form_lines_become_a_list(client, operator):
    client.force_login(operator)
    response = client.post("/tasks/new/", {
        "type": "demo.notify", "params.recipients": "a@example.com\n\n b@example.com \n",
        "params.subject": "Hi", "params.body": "Hello",
    })
    assert response.status_code == 302
    assert Task.objects.get().params["recipients"] == ["a@example.com", "b@example.com"]

    response = client.post("/tasks/new/", {"type": "demo.notify", "params.recipients": "nope",
                                           "params.subject": ""})
    assert response.status_code == 422
    body = response.content.decode()
    assert 'data-field="params.recipients">' in body and "not an email address: nope" in body
    assert 'data-field="params.subject">Field required' in body


@pytest.mark.django_db
def test_unknown_type_is_refused(client, operator):
    client.force_login(operator)
    response = client.post("/tasks/new/", {"type": "no.such.type"})
    assert response.status_code == 422
    assert b"Unknown task type" in response.content


# --- controls -----------------------------------------------------------------------------

@pytest.mark.django_db
def test_operator_pauses_and_resumes_a_queued_task(client, operator, task):
    client.force_login(operator)
    response = client.post(control_url(task.pk), {"action": "pause"}, follow=True)
    assert response.redirect_chain[-1][0] == detail_url(task.pk)
    task.refresh_from_db()
    assert task.status == "paused"
    body = response.content.decode()
    assert f"Task #{task.pk} paused." in body
    assert {"resume", "stop", "terminate", "edit"} <= visible_controls(body) and "pause" not in visible_controls(body)
    assert AuditEntry.objects.filter(task=task, action="task.pause", actor=operator).exists()

    client.post(control_url(task.pk), {"action": "resume"})
    task.refresh_from_db()
    assert task.status == "queued"


@pytest.mark.django_db
def test_pausing_a_completed_task_is_refused_with_a_message(client, operator, task):
    Task.objects.filter(pk=task.pk).update(status="completed")
    client.force_login(operator)
    response = client.post(control_url(task.pk), {"action": "pause"}, follow=True)
    assert response.status_code == 200
    body = response.content.decode()
    assert "message-error" in body
    assert f"Task #{task.pk} is completed; a finished task cannot be paused." in body
    task.refresh_from_db()
    assert task.status == "completed"
    assert 'data-testid="btn-stop"' not in body


@pytest.mark.django_db
def test_force_terminate_needs_a_reason(client, operator, task):
    client.force_login(operator)
    body = client.post(control_url(task.pk), {"action": "terminate"}, follow=True).content.decode()
    assert "needs a reason" in body
    task.refresh_from_db()
    assert task.status == "queued"

    client.post(control_url(task.pk), {"action": "terminate", "reason": "runaway"})
    task.refresh_from_db()
    assert task.status == "terminated"
    assert AuditEntry.objects.get(task=task, action="task.terminate").reason == "runaway"


@pytest.mark.django_db
def test_control_rejects_get_and_unknown_actions(client, operator, task):
    client.force_login(operator)
    assert client.get(control_url(task.pk)).status_code == 405
    assert client.post(control_url(task.pk), {"action": "explode"}).status_code == 400
    assert client.post(control_url(999999), {"action": "pause"}).status_code == 404


@pytest.mark.django_db
def test_detail_shows_steps_wal_snapshots_events_and_audit(client, viewer, task):
    Step.objects.create(task=task, step_id="prepare-source", position=0, title="Ensure rows", status="done",
                        depends_on=[], reads=["rows"], error="")
    Step.objects.create(task=task, step_id="batch-0001", position=1, status="failed", depends_on=["prepare-source"],
                        error="Traceback: boom")
    WalEntry.objects.create(task=task, step_id="batch-0001", call_index=0, tool="db.upsert",
                            idempotency_key="k-1", idempotent=True, lease_epoch=1)
    Snapshot.objects.create(task=task, version=1, step_id="prepare-source", state={})
    client.force_login(viewer)
    body = client.get(detail_url(task.pk)).content.decode()
    assert body.count('data-testid="step-row"') == 2
    assert "Traceback: boom" in body and "<details>" in body
    assert "k-1" in body and 'data-testid="snapshot-row"' in body
    assert 'data-testid="event-row"' in body  # the "created" event
    assert "task.create" in body


@pytest.mark.django_db
def test_detail_draws_a_timeline_bar_per_started_step(client, viewer, task):
    from datetime import timedelta

    from django.utils import timezone

    t0 = timezone.now() - timedelta(minutes=5)
    Step.objects.create(task=task, step_id="prepare", position=0, status="done", attempts=1,
                        started_at=t0, finished_at=t0 + timedelta(seconds=10))
    Step.objects.create(task=task, step_id="copy-1", position=1, status="done", attempts=2,
                        started_at=t0 + timedelta(seconds=10), finished_at=t0 + timedelta(seconds=30))
    Step.objects.create(task=task, step_id="copy-2", position=2, status="pending",
                        started_at=t0 + timedelta(seconds=12))  # started, not finished: running
    Step.objects.create(task=task, step_id="summary", position=3, status="pending")  # not started: no bar
    client.force_login(viewer)
    body = client.get(detail_url(task.pk)).content.decode()
    timeline = body.split('id="task-timeline"', 1)[1].split("</section>", 1)[0]
    assert timeline.count('data-testid="timeline-bar"') == 3
    assert 'data-step-id="summary"' not in timeline
    assert 'data-step-id="copy-2" data-status="running" data-lane="1"' in timeline  # beside copy-1
    assert 'data-step-id="copy-1" data-status="done" data-lane="0" data-attempts="2" data-retried="yes"' in timeline
    assert 'x="0.000%"' in timeline  # geometry as SVG attributes, not inline style


@pytest.mark.django_db
def test_a_step_the_runner_reports_running_shows_running(client, viewer, task):
    import time

    Task.objects.filter(pk=task.pk).update(status="running", activities=[
        {"kind": "step", "label": "copy-1", "since": time.time() - 3, "token": "task/copy-1"}])
    Step.objects.create(task=task, step_id="copy-1", position=0, status="pending")
    Step.objects.create(task=task, step_id="copy-2", position=1, status="pending")
    client.force_login(viewer)
    body = client.get(detail_url(task.pk)).content.decode()
    assert 'data-step-id="copy-1" data-status="running"' in body
    assert 'data-step-id="copy-2" data-status="pending"' in body
    timeline = body.split('id="task-timeline"', 1)[1].split("</section>", 1)[0]
    assert timeline.count('data-testid="timeline-bar"') == 1 and 'data-step-id="copy-1" data-status="running"' in timeline


@pytest.mark.django_db
def test_a_step_added_at_run_time_says_who_added_it(client, viewer, task):
    Step.objects.create(task=task, step_id="discover", position=0, status="done")
    Step.objects.create(task=task, step_id="item-0", position=1, added_by="discover", result_stored_apart=True,
                        result_bytes=200_000, status="done")
    client.force_login(viewer)
    body = client.get(detail_url(task.pk)).content.decode()
    row = body.split('data-step-id="item-0"', 1)[1].split("</tr>", 1)[0]
    assert "added by discover" in row and f"/api/tasks/{task.pk}/steps/item-0/result" in row


@pytest.mark.django_db
def test_a_task_that_has_not_started_says_so_instead_of_a_timeline(client, viewer, task):
    client.force_login(viewer)
    body = client.get(detail_url(task.pk)).content.decode()
    assert 'data-testid="timeline-empty"' in body and 'data-testid="timeline-bar"' not in body


# --- the admin ----------------------------------------------------------------------------

@pytest.mark.django_db
def test_admin_changelists_render(client, superuser, task):
    Step.objects.create(task=task, step_id="s1", position=0)
    WalEntry.objects.create(task=task, step_id="s1", call_index=0, tool="db.upsert", idempotency_key="k",
                            idempotent=True, lease_epoch=1)
    Snapshot.objects.create(task=task, version=1, state={})
    IdempotencyRecord.objects.create(key="k", tool="db.upsert", result={})
    ApiToken.objects.create(user=superuser, token_hash="f" * 64, prefix="abcd1234")
    DemoSource.objects.create(id=1, amount="1.5")
    DemoDestination.objects.create(id=1, amount="1.5")
    DemoContractExtraction.objects.create(contract="c1", task=task)
    client.force_login(superuser)
    for model in ALL_MODELS:
        opts = model._meta
        url = reverse(f"admin:{opts.app_label}_{opts.model_name}_changelist")
        assert client.get(url).status_code == 200, url
        assert client.get(url, {"q": "abc"}).status_code == 200, url
    page = client.get(reverse("admin:orchestrator_task_change", args=[task.pk]))
    assert page.status_code == 200 and b"s1" in page.content
    tokens = client.get(reverse("admin:orchestrator_apitoken_changelist")).content
    assert b"abcd1234" in tokens and b"f" * 64 not in tokens
    assert client.get(reverse("admin:orchestrator_walentry_changelist"),
                      {"task__id__exact": task.pk}).status_code == 200


@pytest.mark.django_db
def test_admin_forbids_changing_audit_entries_and_wal(client, superuser, task):
    entry = AuditEntry.objects.filter(task=task).first()
    client.force_login(superuser)
    change = reverse("admin:orchestrator_auditentry_change", args=[entry.pk])
    assert client.get(change).status_code == 200  # viewing is allowed
    assert client.post(change, {"action": "tampered", "reason": "x"}).status_code == 403
    assert client.get(reverse("admin:orchestrator_auditentry_add")).status_code == 403
    assert client.post(reverse("admin:orchestrator_auditentry_delete", args=[entry.pk]),
                       {"post": "yes"}).status_code == 403
    entry.refresh_from_db()
    assert entry.action == "task.create"

    wal = WalEntry.objects.create(task=task, step_id="s1", call_index=0, tool="db.upsert", idempotency_key="k",
                                  idempotent=True, lease_epoch=1)
    assert client.post(reverse("admin:orchestrator_walentry_change", args=[wal.pk]),
                       {"status": "done"}).status_code == 403
    assert client.get(reverse("admin:orchestrator_walentry_add")).status_code == 403


def test_form_fields_cover_the_schema_types():
    from typing import Literal

    from pydantic import BaseModel, Field

    from orchestrator.web.forms import param_fields

    class Params(BaseModel):
        dry_run: bool = Field(True, description="Only pretend")
        limit: int | None = Field(None, ge=0, le=9)
        mode: Literal["fast", "safe"] = "safe"
        weights: list[int] = [1, 2]
        note: str = Field("", max_length=5000)

    fields = {f["key"]: f for f in param_fields(Params.model_json_schema())}
    assert fields["dry_run"]["widget"] == "checkbox" and fields["dry_run"]["value"] is True
    assert fields["dry_run"]["help"] == "Only pretend"
    assert (fields["limit"]["widget"], fields["limit"]["min"], fields["limit"]["max"]) == ("number", 0, 9)
    assert fields["mode"]["widget"] == "select" and fields["mode"]["choices"] == ["fast", "safe"]
    assert fields["weights"]["widget"] == "json"
    assert fields["note"]["widget"] == "textarea"


@pytest.mark.django_db
def test_the_task_page_lists_the_inbox_with_outcomes(client, operator, task):
    from orchestrator.engine import services as engine_services

    engine_services.task_pause(task_id=task.pk, actor=operator)
    client.force_login(operator)
    body = client.get(detail_url(task.pk)).content.decode()
    table = body.split('data-testid="inbox-table"', 1)[1].split("</table>", 1)[0]
    assert 'data-testid="inbox-row" data-seq="1" data-state="consumed"' in table
    assert "pause" in table and "applied at once" in table


@pytest.mark.django_db
def test_an_operator_sends_a_message_from_the_task_page_and_a_double_click_is_one_event(client, operator,
                                                                                       settings):
    from orchestrator.engine import services as engine_services
    from orchestrator.models import InboundEvent

    settings.ORCH_EXTRA_TASK_TYPES = ["tests.support.testtypes"]
    task = engine_services.task_create(type="test.growing", params={})
    client.force_login(operator)
    page = client.get(detail_url(task.pk)).content.decode()
    form = page.split('data-testid="send-event-form"', 1)[1].split("</form>", 1)[0]
    assert '<option value="user.message">' in form and '<option value="pause">' not in form
    event_id = form.split('name="source_event_id" value="', 1)[1].split('"', 1)[0]
    body = {"type": "user.message", "text": "please hurry", "source_event_id": event_id}
    first = client.post(f"/tasks/{task.pk}/send/", body, follow=True)
    assert "sent: the task applies it at its next resume point" in first.content.decode()
    again = client.post(f"/tasks/{task.pk}/send/", body, follow=True)
    assert "was sent already" in again.content.decode()
    assert list(InboundEvent.objects.filter(task=task).values_list("type", "payload")) == [
        ("user.message", {"text": "please hurry"})]
    bad = client.post(f"/tasks/{task.pk}/send/", {"type": "instruction", "payload": "{nope"}, follow=True)
    assert "Not sent: the payload is not JSON" in bad.content.decode()


@pytest.mark.django_db
def test_a_search_with_a_nul_character_is_answered_not_a_server_error(client, viewer):
    # PostgreSQL refuses NUL in text (found by schemathesis: GET /api/tasks?q=%00...).
    client.force_login(viewer)
    assert client.get("/", {"q": "abc\x00def"}).status_code == 200
    assert client.get("/api/tasks", {"q": "\x00"}).status_code == 200


@pytest.mark.django_db
def test_a_search_for_a_digit_that_is_not_ascii_is_answered_not_a_server_error(client, viewer):
    # "³".isdigit() is true and int("³") raises (found by schemathesis: GET /api/tasks?q=%C2%B3).
    client.force_login(viewer)
    for text in ("³", "#①", "٣"):
        assert client.get("/", {"q": text}).status_code == 200
        assert client.get("/api/tasks", {"q": text}).status_code == 200


@pytest.mark.django_db(transaction=True)
def test_a_waiting_task_shows_what_it_waits_for_and_until_when(client, operator, settings):
    from orchestrator.engine import services as engine_services
    from orchestrator.engine.worker import drive_inline

    settings.ORCH_EXTRA_TASK_TYPES = ["tests.support.testtypes"]
    task = engine_services.task_create(type="test.approval", params={"timeout": 600})
    assert drive_inline(task.pk) == "waiting"
    client.force_login(operator)
    body = client.get(detail_url(task.pk)).content.decode()
    card = body.split('data-testid="waiting-card"', 1)[1].split("</div>\n  </div>", 1)[0]
    assert "Waiting (no worker held)" in card and "instruction" in card and "until 20" in card


# --- the task page's sections (issue 24, item 6) ------------------------------------------

def tabs_of(body: str) -> list[str]:
    tablist = body.split('id="task-tabs"', 1)[1].split("</div>", 1)[0]
    return [part.split('"', 1)[0] for part in tablist.split('data-tab="')[1:]]


@pytest.mark.django_db
def test_the_task_page_groups_its_panels_into_tabs_and_leaves_out_what_does_not_apply(client, viewer, task):
    """A non-agent task has no Conversation tab (nor an Inbox one when its type takes no events
    and nothing was sent); a finished task has no heartbeat or lease panel. Every panel is in
    the page, each with its regions, for the live updates; the header is outside the panels."""
    from django.utils import timezone

    Task.objects.filter(pk=task.pk).update(status="running", heartbeat_at=timezone.now(), lease_owner="w:1")
    client.force_login(viewer)
    body = client.get(detail_url(task.pk)).content.decode()
    assert tabs_of(body) == ["overview", "steps", "effects", "history"]
    assert 'role="tablist"' in body and 'aria-controls="panel-steps"' in body
    for panel in ("overview", "conversation", "steps", "effects", "inbox", "history"):
        assert f'id="panel-{panel}"' in body and 'role="tabpanel"' in body
    panels = body.split('id="panel-overview"', 1)[1]
    for region in ("task-cards", "task-timeline", "task-steps", "task-reviews", "task-wal", "task-inbox",
                   "task-history", "event-rows"):
        assert f'id="{region}"' in panels, region
    assert 'id="task-summary"' not in panels and 'id="task-controls"' not in panels
    assert 'data-testid="worker-card"' in body and 'data-testid="heartbeat-age"' in body

    Task.objects.filter(pk=task.pk).update(status="completed", lease_owner="")
    body = client.get(detail_url(task.pk)).content.decode()
    assert 'data-testid="worker-card"' not in body and 'data-testid="heartbeat-age"' not in body
    assert "Heartbeat" not in body and "Lease" not in body

    agent = services.task_create(type="agent.plan_execute", params={"goal": "say hello", "tools": []})
    body = client.get(detail_url(agent.pk)).content.decode()
    # An agent takes messages: its inbox has a tab before anything was sent.
    assert tabs_of(body) == ["overview", "conversation", "steps", "effects", "inbox", "history"]


@pytest.mark.django_db
def test_the_tabs_count_open_reviews_and_pending_inbox_events(client, operator, task):
    from orchestrator.engine import approvals

    agent = services.task_create(type="agent.plan_execute", params={"goal": "say hello", "tools": []})
    approval_id = approvals.request(task_id=agent.pk, step_id="tool-006-1", tool="email_send", call_id="c1",
                                    arguments={"to": "ops@example.org"})
    Task.objects.filter(pk=agent.pk).update(inbox_pending=2)
    client.force_login(operator)
    body = client.get(detail_url(agent.pk)).content.decode()
    tablist = body.split('id="task-tabs"', 1)[1].split("</div>", 1)[0]
    effects = tablist.split('data-tab="effects"', 1)[1].split("</button>", 1)[0]
    assert 'class="count count-alert"' in effects and ">1</span>" in effects
    inbox_tab = tablist.split('data-tab="inbox"', 1)[1].split("</button>", 1)[0]
    assert ">2</span>" in inbox_tab
    reviews = body.split('id="task-reviews"', 1)[1].split("</section>", 1)[0]
    assert f'href="/review/{approval_id}/"' in reviews and 'data-status="open"' in reviews


@pytest.mark.django_db
def test_a_form_field_with_a_nul_character_is_refused_with_400_and_creates_nothing(client, operator):
    # The task form's title was written as it came: a 500 on PostgreSQL, which stores no NUL.
    client.force_login(operator)
    client.raise_request_exception = False
    response = client.post("/tasks/new/", {"type": "demo.migrate_rows", "params.rows": "120", "title": "Form\x00 run"})
    assert response.status_code == 400
    assert "NUL character" in response.content.decode() and "'title'" in response.content.decode()
    assert not Task.objects.exists()


@pytest.mark.django_db
def test_a_query_string_with_a_nul_character_is_read_without_it(client, viewer):
    client.force_login(viewer)
    services.task_create(type="demo.migrate_rows", params={"rows": 10}, title="abcdef")
    assert "abcdef" in client.get("/", {"q": "abc\x00def"}).content.decode()
    assert client.get("/review/", {"status": "op\x00en", "tool": "db\x00.upsert"}).status_code == 200
