"""The admin, for auditors: every model is there with filters, search and dates; the
records of a task link to each other; the WAL and the audit log cannot be changed or
deleted (not even by a superuser, not through a cascade); staff without permissions see
nothing."""
from datetime import timedelta

import pytest
from django.apps import apps
from django.contrib import admin
from django.contrib.auth.models import Permission, User
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from orchestrator.admin_tables import LargeTableAdmin
from orchestrator.engine import inbox, services
from orchestrator.models import (
    AgentMemory, AgentMessage, ApiToken, ModelCallAttempt, McpServer, ModelProfile, AuditEntry, IdempotencyRecord, InboundEvent,
    NotificationDelivery, NotificationSubscription, RetentionRun, Snapshot, Step, StepResult, Task, TaskEvent,
    WalEntry, WebhookRejection, WebhookSource,
)
from demo.models import DemoContractExtraction, DemoDestination, DemoSource
from review.models import ApprovalVote, ReviewItem
from review.services import review_decide, review_open

pytestmark = pytest.mark.django_db

PROJECT_APPS = ("orchestrator", "review")
HARNESS_MODELS = [Task, Step, WalEntry, Snapshot, StepResult, TaskEvent, InboundEvent, IdempotencyRecord, AuditEntry,
                  ReviewItem]
TASK_RECORD_MODELS = [Step, WalEntry, Snapshot, TaskEvent, AuditEntry]
APPEND_ONLY = [AuditEntry, WalEntry]
READ_ONLY = [ReviewItem]  # decisions go through the review page or the API, which audit them
REGISTERED = sorted(admin.site._registry, key=lambda m: m._meta.label)


def url(model, view: str, *args) -> str:
    opts = model._meta
    return reverse(f"admin:{opts.app_label}_{opts.model_name}_{view}", args=args)


@pytest.fixture
def superuser(db):
    return User.objects.create_superuser("root", "root@example.org", "pw")


@pytest.fixture
def records(superuser):
    """A real task (created and paused through the services, so it has events and audit
    entries) plus one row of every other model of the project."""
    task = services.task_create(type="demo.pipeline", params={}, title="alpha migration", actor=superuser,
                                ip="10.0.0.7")
    services.task_pause(task_id=task.pk, actor=superuser, ip="10.0.0.7", reason="checking the books")
    step = Step.objects.create(task=task, step_id="stage-1", position=0, title="Stage 1")
    wal = WalEntry.objects.create(task=task, step_id="stage-1", call_index=0, tool="db.upsert",
                                  idempotency_key="key-1", idempotent=True, lease_epoch=1, args={"rows": 3})
    IdempotencyRecord.objects.create(key="key-1", tool="db.upsert", result={"ok": True})
    Snapshot.objects.create(task=task, version=1, step_id="stage-1", state={"plan": []})
    StepResult.objects.create(task=task, step_id="stage-1", data={"rows": list(range(10))})
    WebhookSource.objects.create(name="crm", secrets=["whsec_x"], allowed_types=["upstream.ready"])
    WebhookRejection.objects.create(source="crm", asked_for="crm", reason="bad signature or timestamp", ip="10.0.0.7",
                                    last_at=task.created_at, last_task_id=task.pk)
    inbox.send(task_id=task.pk, type="progress.external", payload={"message": "alpha from outside"}, source="system")
    ApiToken.objects.create(user=superuser, token_hash="f" * 64, prefix="orch_abcdefg")
    DemoSource.objects.create(id=1, amount="1.5")
    DemoDestination.objects.create(id=1, amount="1.5")
    DemoContractExtraction.objects.create(contract="c1", task=task)
    AgentMessage.objects.create(task=task, key="goal:g0", turn=0, order=1, role="user", content="alpha goal")
    AgentMemory.objects.create(key="alpha fact", value="the books balance", task=task)
    ModelCallAttempt.objects.create(task=task, step_id="turn-001", profile="alpha-gpu", model="m", outcome="completed",
                                    prompt_tokens=120, completion_tokens=30, cost="0.000480")
    RetentionRun.objects.create(started_at=task.created_at, tasks=1, events_deleted=3)
    McpServer.objects.create(name="alpha-git", command=["mcp-server-git"], env={"GIT_TOKEN": "alpha-env-secret"})
    ModelProfile.objects.create(name="alpha-gpu", base_url="http://gpu-1:8000/v1", model="m", api_key="sk-alpha-key-123")
    hook = NotificationSubscription.objects.create(name="alpha-hook", url="http://127.0.0.1:9/hook",
                                                   secret="whsec_" + "A" * 43 + "=")
    NotificationDelivery.objects.create(subscription=hook, message_id="msg_alpha", event="task.needs_human",
                                        payload={"type": "task.needs_human"})
    other = services.task_create(type="demo.contracts", params={}, title="beta contracts")
    send = WalEntry.objects.create(task=task, step_id="send-001", call_index=0, tool="email.send",
                                   idempotency_key="alpha-send-key", idempotent=False, lease_epoch=1,
                                   args={"to": "a@example.org", "subject": "s"}, worker="host:1")
    review = review_open(entry=send, reason="worker host:1 died mid-send", dead_worker="host:1")
    # (A vote belongs to an approval; any item will do for the admin's pages, and another item
    # would change what the review tests below count.)
    ApprovalVote.objects.create(item=review, reviewer=superuser, reviewer_name="root", decision="approve",
                                arguments={"to": ["a@example.org"]}, arguments_sha256="a" * 64, note="alpha vote")
    return {"task": Task.objects.get(pk=task.pk), "other": other, "step": step, "wal": wal, "send": send,
            "review": review}


def result_ids(response) -> set:
    assert response.status_code == 200, response.status_code
    return {obj.pk for obj in response.context["cl"].result_list}


# --- everything is there ----------------------------------------------------------------------

def test_every_project_model_is_in_the_admin():
    missing = [m._meta.label for app in PROJECT_APPS for m in apps.get_app_config(app).get_models()
               if m not in admin.site._registry]
    assert not missing, f"models missing from the admin: {missing}"


@pytest.mark.parametrize("model", REGISTERED, ids=lambda m: m._meta.label)
def test_superuser_sees_the_changelist_and_a_change_page(client, superuser, records, model):
    client.force_login(superuser)
    changelist = client.get(url(model, "changelist"))
    assert changelist.status_code == 200
    if admin.site._registry[model].search_fields:
        assert client.get(url(model, "changelist"), {"q": "alpha"}).status_code == 200
    row = model._default_manager.first()
    if row is None:
        assert model._meta.app_label not in PROJECT_APPS, f"add a {model._meta.label} row to the `records` fixture"
        return
    page = client.get(url(model, "change", row.pk))
    assert page.status_code == 200


@pytest.mark.parametrize("model", HARNESS_MODELS, ids=lambda m: m._meta.label)
def test_harness_models_have_filters_search_and_dates(model):
    model_admin = admin.site._registry[model]
    assert model_admin.list_filter, model
    assert model_admin.search_fields, model
    if isinstance(model_admin, LargeTableAdmin):
        # A year of rows: dates are filters (one indexed range), not a drill-down that scans.
        date_fields = {f.name for f in model._meta.fields if f.get_internal_type() == "DateTimeField"}
        assert date_fields & {f if isinstance(f, str) else f[0] for f in model_admin.list_filter if not isinstance(f, type)}, model
    else:
        assert model_admin.date_hierarchy, model


def test_date_filters_narrow_a_large_table_and_the_drill_down_stays_on_small_ones(client, superuser, records):
    client.force_login(superuser)
    now = timezone.now()
    week = {"created_at__gte": (now - timedelta(days=7)).isoformat(), "created_at__lt": (now + timedelta(days=1)).isoformat()}
    assert records["task"].pk in result_ids(client.get(url(Task, "changelist"), week))
    long_ago = {"created_at__gte": (now - timedelta(days=900)).isoformat(),
                "created_at__lt": (now - timedelta(days=800)).isoformat()}
    assert result_ids(client.get(url(Task, "changelist"), long_ago)) == set()
    year = records["review"].detected_at.year
    assert records["review"].pk in result_ids(client.get(url(ReviewItem, "changelist"), {"detected_at__year": year}))


LARGE = [m for m, a in admin.site._registry.items() if isinstance(a, LargeTableAdmin)]


@pytest.mark.parametrize("model", LARGE, ids=lambda m: m._meta.label)
def test_a_large_table_s_changelist_never_reads_the_whole_table(client, superuser, records, model, monkeypatch):
    """No full COUNT, no DISTINCT over every row, no date drill-down scan: each is seconds at
    50,000,000 rows (bench/list.py measures the pages at that size)."""
    from orchestrator import admin_tables

    monkeypatch.setattr(admin_tables, "RECENT_ROWS", 1)  # the fixture's rows count as a long table
    client.force_login(superuser)
    with CaptureQueriesContext(connection) as queries:
        assert client.get(url(model, "changelist")).status_code == 200
    table = model._meta.db_table
    for query in (q["sql"] for q in queries.captured_queries if table in q["sql"]):
        upper = query.upper()
        if "COUNT(" in upper:
            assert "LIMIT" in upper, f"an unbounded count: {query}"
        if "DISTINCT" in upper and model.objects.count() >= admin_tables.RECENT_ROWS:
            assert "WHERE" in upper, f"a DISTINCT over the whole table: {query}"
        # A date drill-down reads every row; sums per day over a bounded range (the ledger's) do not.
        assert "TRUNC" not in upper or "WHERE" in upper, f"a date drill-down scan: {query}"


def test_a_long_list_shows_an_estimated_count_and_pages_through_its_head(client, superuser, records, monkeypatch):
    from orchestrator import admin_tables

    monkeypatch.setattr(admin_tables, "EXACT_COUNT_UP_TO", 3)
    client.force_login(superuser)
    task = records["task"]
    for _ in range(6):
        inbox_free_event(task)
    page = client.get(url(TaskEvent, "changelist")).content.decode()
    total = TaskEvent.objects.count()
    if connection.vendor == "postgresql":
        assert "about " in page and "filter by task or date to go further" in page
    else:  # SQLite counts exactly
        assert f"{total} task events" in page and "about " not in page
    narrowed = client.get(url(TaskEvent, "changelist"), {"task__id__exact": records["other"].pk}).content.decode()
    assert "about " not in narrowed  # a short list is counted exactly


def inbox_free_event(task):
    from orchestrator.engine.events import append_event

    with transaction.atomic():
        append_event(Task.objects.select_for_update().get(pk=task.pk), "progress", {"message": "tick"})


def test_large_tables_search_by_task_id_and_key_prefix_only(client, superuser, records):
    client.force_login(superuser)
    task, send = records["task"], records["send"]
    events = url(TaskEvent, "changelist")
    assert result_ids(client.get(events, {"q": str(task.pk)})) == set(TaskEvent.objects.filter(task=task).values_list("pk", flat=True))
    assert result_ids(client.get(events, {"q": "status"})) == set()  # a word: no index answers it, no scan
    wal = url(WalEntry, "changelist")
    assert result_ids(client.get(wal, {"q": "alpha-send"})) == {send.pk}
    assert result_ids(client.get(wal, {"q": "send-key"})) == set()  # the start of a key, not any part
    assert "the start of an idempotency key" in client.get(wal).content.decode()


# --- search and filters -----------------------------------------------------------------------

def test_task_search_and_filters(client, superuser, records):
    client.force_login(superuser)
    task, other = records["task"], records["other"]
    changelist = url(Task, "changelist")
    assert result_ids(client.get(changelist)) == {task.pk, other.pk}
    assert result_ids(client.get(changelist, {"q": "alpha"})) == {task.pk}
    assert result_ids(client.get(changelist, {"q": "demo.contracts"})) == {other.pk}
    assert result_ids(client.get(changelist, {"q": str(other.pk)})) == {other.pk}
    assert result_ids(client.get(changelist, {"status__exact": "paused"})) == {task.pk}
    assert result_ids(client.get(changelist, {"status__exact": "queued"})) == {other.pk}
    assert result_ids(client.get(changelist, {"type__exact": "demo.contracts"})) == {other.pk}
    assert result_ids(client.get(changelist, {"created_by__id__exact": superuser.pk})) == {task.pk}
    assert result_ids(client.get(changelist, {"status__exact": "paused", "q": "beta"})) == set()


def test_audit_search_and_filters(client, superuser, records):
    client.force_login(superuser)
    task, other = records["task"], records["other"]
    changelist = url(AuditEntry, "changelist")
    pause = AuditEntry.objects.get(task=task, action="task.pause")
    created = AuditEntry.objects.get(task=task, action="task.create")
    anonymous_create = AuditEntry.objects.get(task=other, action="task.create")
    sent = AuditEntry.objects.get(task=task, action="task.event")  # the fixture's event from outside
    assert result_ids(client.get(changelist)) == {pause.pk, created.pk, anonymous_create.pk, sent.pk}
    assert result_ids(client.get(changelist, {"action__exact": "task.pause"})) == {pause.pk}
    assert result_ids(client.get(changelist, {"action__exact": "task.create"})) == {created.pk, anonymous_create.pk}
    assert result_ids(client.get(changelist, {"q": "checking the books"})) == {pause.pk}
    assert result_ids(client.get(changelist, {"q": "root"})) == {pause.pk, created.pk}
    assert result_ids(client.get(changelist, {"q": "10.0.0.7"})) == {pause.pk, created.pk}
    assert result_ids(client.get(changelist, {"actor__id__exact": superuser.pk})) == {pause.pk, created.pk}
    assert result_ids(client.get(changelist, {"task__id__exact": other.pk})) == {anonymous_create.pk}
    listed = client.get(changelist).content.decode()
    assert "10.0.0.7" in listed and "checking the books" in listed


# --- links between a task and its records -----------------------------------------------------

def test_task_page_links_to_every_kind_of_record(client, superuser, records):
    client.force_login(superuser)
    task = records["task"]
    page = client.get(url(Task, "change", task.pk)).content.decode()
    for model in TASK_RECORD_MODELS:
        link = f"{url(model, 'changelist')}?task__id__exact={task.pk}"
        assert link in page, (model, link)
    assert reverse("task_detail", args=[task.pk]) in page
    assert "stage-1" in page  # the steps inline


@pytest.mark.parametrize("model", TASK_RECORD_MODELS, ids=lambda m: m._meta.label)
def test_a_task_filtered_changelist_shows_that_task_only_and_says_so(client, superuser, records, model):
    client.force_login(superuser)
    task, other = records["task"], records["other"]
    response = client.get(url(model, "changelist"), {"task__id__exact": task.pk})
    expected = set(model.objects.filter(task=task).values_list("pk", flat=True))
    assert expected and result_ids(response) == expected
    assert str(task) in response.content.decode()  # the task filter names the task
    assert not (set(model.objects.filter(task=other).values_list("pk", flat=True)) & result_ids(response))
    invalid = client.get(url(model, "changelist"), {"task__id__exact": "nope"})
    assert invalid.status_code == 302 and "e=1" in invalid["Location"]


@pytest.mark.parametrize("model", TASK_RECORD_MODELS, ids=lambda m: m._meta.label)
def test_each_record_links_to_its_task_and_the_task_s_other_records(client, superuser, records, model):
    client.force_login(superuser)
    task = records["task"]
    row = model.objects.filter(task=task).first()
    page = client.get(url(model, "change", row.pk)).content.decode()
    assert url(Task, "change", task.pk) in page
    for sibling in TASK_RECORD_MODELS:
        assert f"{url(sibling, 'changelist')}?task__id__exact={task.pk}" in page, sibling


def test_step_wal_and_idempotency_record_link_to_each_other(client, superuser, records):
    client.force_login(superuser)
    task, step, wal = records["task"], records["step"], records["wal"]
    step_page = client.get(url(Step, "change", step.pk)).content.decode()
    assert f"{url(WalEntry, 'changelist')}?task__id__exact={task.pk}&amp;step_id=stage-1" in step_page
    wal_page = client.get(url(WalEntry, "change", wal.pk)).content.decode()
    assert url(Step, "change", step.pk) in wal_page
    record = IdempotencyRecord.objects.get(key="key-1")
    assert url(IdempotencyRecord, "change", record.pk) in wal_page
    record_page = client.get(url(IdempotencyRecord, "change", record.pk)).content.decode()
    assert url(WalEntry, "change", wal.pk) in record_page
    by_step = client.get(url(WalEntry, "changelist"), {"task__id__exact": task.pk, "step_id": "stage-1"})
    assert result_ids(by_step) == {wal.pk}


# --- the WAL and the audit log are append-only ------------------------------------------------

def _snapshot(obj) -> dict:
    return {f.attname: getattr(obj, f.attname) for f in obj._meta.concrete_fields}


@pytest.mark.parametrize("model", APPEND_ONLY, ids=lambda m: m._meta.label)
def test_append_only_records_cannot_be_added_changed_or_deleted(client, superuser, records, model):
    client.force_login(superuser)
    row = model.objects.filter(task=records["task"]).first()
    before, count = _snapshot(row), model.objects.count()
    tampered = {"action": "tampered", "reason": "x", "status": "done", "step_id": "x", "tool": "x",
                "idempotency_key": "x", "call_index": 0, "lease_epoch": 1, "args": "{}", "idempotent": "on"}

    assert client.get(url(model, "add")).status_code == 403
    assert client.post(url(model, "add"), tampered).status_code == 403
    assert client.get(url(model, "change", row.pk)).status_code == 200  # viewing is fine
    assert client.post(url(model, "change", row.pk), tampered).status_code == 403
    assert client.get(url(model, "delete", row.pk)).status_code == 403
    assert client.post(url(model, "delete", row.pk), {"post": "yes"}).status_code == 403
    # No bulk delete either: the action is not offered, and forcing it does nothing.
    changelist = client.get(url(model, "changelist"))
    assert "delete_selected" not in changelist.content.decode()
    client.post(url(model, "changelist"), {"action": "delete_selected", "_selected_action": [row.pk], "post": "yes"})

    row.refresh_from_db()
    assert _snapshot(row) == before
    assert model.objects.count() == count


def test_a_task_cannot_be_deleted_as_that_would_take_its_wal_and_audit_with_it(client, superuser, records):
    client.force_login(superuser)
    task = records["task"]
    audit = set(AuditEntry.objects.filter(task=task).values_list("pk", flat=True))
    assert client.post(url(Task, "delete", task.pk), {"post": "yes"}).status_code == 403
    client.post(url(Task, "changelist"), {"action": "delete_selected", "_selected_action": [task.pk], "post": "yes"})
    assert Task.objects.filter(pk=task.pk).exists()
    assert WalEntry.objects.filter(task=task).exists()
    assert set(AuditEntry.objects.filter(task=task).values_list("pk", flat=True)) == audit


# --- the review queue is read-only here ----------------------------------------------------

def test_review_items_cannot_be_added_changed_or_deleted(client, superuser, records):
    client.force_login(superuser)
    item = records["review"]
    before = _snapshot(item)
    tampered = {"status": "decided", "decision": "happened", "note": "tampered"}
    assert client.get(url(ReviewItem, "add")).status_code == 403
    assert client.post(url(ReviewItem, "add"), tampered).status_code == 403
    page = client.get(url(ReviewItem, "change", item.pk))
    assert page.status_code == 200
    assert client.post(url(ReviewItem, "change", item.pk), tampered).status_code == 403
    assert client.post(url(ReviewItem, "delete", item.pk), {"post": "yes"}).status_code == 403
    assert "delete_selected" not in client.get(url(ReviewItem, "changelist")).content.decode()
    client.post(url(ReviewItem, "changelist"), {"action": "delete_selected", "_selected_action": [item.pk],
                                                "post": "yes"})
    item.refresh_from_db()
    assert _snapshot(item) == before


def test_review_item_links_to_its_task_wal_entry_and_review_page(client, superuser, records):
    client.force_login(superuser)
    item, task = records["review"], records["task"]
    page = client.get(url(ReviewItem, "change", item.pk)).content.decode()
    assert url(Task, "change", task.pk) in page
    assert url(WalEntry, "change", records["send"].pk) in page
    assert reverse("review:detail", args=[item.pk]) in page
    listed = client.get(url(ReviewItem, "changelist")).content.decode()
    assert url(Task, "change", task.pk) in listed and "alpha-send-key" in listed


def test_review_search_filters_and_dates(client, superuser, records):
    client.force_login(superuser)
    item, task, other = records["review"], records["task"], records["other"]
    send2 = WalEntry.objects.create(task=other, step_id="post-001", call_index=0, tool="http.post",
                                    idempotency_key="beta-post-key", idempotent=False, lease_epoch=1)
    second = review_open(entry=send2, reason="worker host:2 died", dead_worker="host:2")
    review_decide(item_id=second.pk, decision="skip", note="checked the partner's ledger", actor=superuser)
    changelist = url(ReviewItem, "changelist")
    assert result_ids(client.get(changelist)) == {item.pk, second.pk}
    assert result_ids(client.get(changelist, {"status__exact": "open"})) == {item.pk}
    assert result_ids(client.get(changelist, {"decision__exact": "skip"})) == {second.pk}
    assert result_ids(client.get(changelist, {"tool": "email.send"})) == {item.pk}
    assert result_ids(client.get(changelist, {"q": "alpha-send-key"})) == {item.pk}
    assert result_ids(client.get(changelist, {"q": str(other.pk)})) == {second.pk}
    assert result_ids(client.get(changelist, {"q": "partner's ledger"})) == {second.pk}
    assert result_ids(client.get(changelist, {"task__id__exact": task.pk})) == {item.pk}
    year = item.detected_at.year
    assert result_ids(client.get(changelist, {"detected_at__year": year})) == {item.pk, second.pk}
    assert result_ids(client.get(changelist, {"detected_at__year": year - 5})) == set()


# --- staff without permissions ----------------------------------------------------------------

def test_staff_without_model_permissions_sees_nothing(client, records):
    staff = User.objects.create_user("clerk", "clerk@example.org", "pw", is_staff=True)
    client.force_login(staff)
    index = client.get(reverse("admin:index"))
    assert index.status_code == 200
    assert not index.context["available_apps"]
    for model in REGISTERED:
        assert client.get(url(model, "changelist")).status_code == 403, model
        row = model._default_manager.first()
        if row is not None:
            assert client.get(url(model, "change", row.pk)).status_code == 403, model


def test_a_view_only_auditor_reads_the_audit_log_but_cannot_touch_it(client, records):
    auditor = User.objects.create_user("audrey", "audrey@example.org", "pw", is_staff=True)
    # Even holding Django's add/change/delete permissions does not unlock the audit log.
    auditor.user_permissions.set(Permission.objects.filter(content_type__app_label="orchestrator",
                                                           content_type__model="auditentry"))
    client.force_login(auditor)
    entry = AuditEntry.objects.filter(task=records["task"]).first()
    assert client.get(url(AuditEntry, "changelist")).status_code == 200
    assert client.get(url(AuditEntry, "change", entry.pk)).status_code == 200
    assert client.post(url(AuditEntry, "change", entry.pk), {"action": "tampered"}).status_code == 403
    assert client.post(url(AuditEntry, "delete", entry.pk), {"post": "yes"}).status_code == 403
    assert client.get(url(AuditEntry, "add")).status_code == 403
    assert client.get(url(WalEntry, "changelist")).status_code == 403  # no permission on the WAL
    entry.refresh_from_db()
    assert entry.action != "tampered"
