"""The pages that revise a paused task: "Edit params & resume" (form → impact preview →
confirm) and "Roll back to vN" (preview → confirm), and the snapshot history on the task
page. Tasks run in-process (drive_inline) on the real engine and database."""
import html
import json
import re

import pytest
from django.urls import reverse

from orchestrator.engine import services
from orchestrator.engine.worker import drive_inline
from orchestrator.models import AuditEntry, Snapshot, Step, Task
from demo.models import DemoDestination, DemoSource
from tests.support.controls import visible_controls

pytestmark = pytest.mark.django_db(transaction=True)

BATCHES = ["batch-0001", "batch-0002", "batch-0003", "batch-0004", "batch-0005"]


@pytest.fixture
def paused_task():
    """demo.migrate_rows, 5 batches of 100, paused by max_steps=3: prepare-source and
    batch-0001..0002 done (rate 1.0)."""
    task = services.task_create(type="demo.migrate_rows", params={"rows": 500, "batch_size": 100, "rate": 1.0},
                                limits={"max_steps": 3, "max_subtasks": 1})
    drive_inline(task.pk)
    task = Task.objects.get(pk=task.pk)
    assert task.status == "paused" and task.status_reason == "limit: max_steps" and task.steps_done == 3
    return task


def edit_url(task_id: int) -> str:
    return reverse("task_edit", kwargs={"task_id": task_id})


def rollback_url(task_id: int, version: int) -> str:
    return reverse("task_rollback", kwargs={"task_id": task_id, "version": version})


def detail_url(task_id: int) -> str:
    return reverse("task_detail", kwargs={"task_id": task_id})


def form_data(task: Task, **params) -> dict:
    data = {f"params.{k}": str(v) for k, v in {**task.params, **params}.items()}
    return {**data, "preview": "1"}


def hidden(body: str, name: str) -> str:
    match = re.search(rf'<input type="hidden" name="{name}" value="([^"]*)"', body)
    assert match, f"no hidden {name!r} in the page"
    return html.unescape(match.group(1))


def confirm_data(body: str) -> dict:
    return {"confirm": "1", "params": hidden(body, "params"), "limits": hidden(body, "limits"),
            "expected_version": hidden(body, "expected_version")}


# --- edit params & resume -------------------------------------------------------------------

def test_the_task_page_offers_edit_and_rollback_for_a_paused_task_only(client, operator, paused_task):
    client.force_login(operator)
    body = client.get(detail_url(paused_task.pk)).content.decode()
    assert 'data-testid="btn-edit"' in body and f'href="{edit_url(paused_task.pk)}"' in body
    assert 'data-testid="btn-rollback"' in body and f'href="{rollback_url(paused_task.pk, 2)}"' in body
    assert {"edit", "rollback"} <= visible_controls(body)
    services.task_resume(task_id=paused_task.pk, limits={"max_steps": 100})
    body = client.get(detail_url(paused_task.pk)).content.decode()
    assert not {"edit", "rollback"} & visible_controls(body) and 'data-testid="btn-rollback"' not in body


def test_edit_form_is_prefilled_with_the_current_params(client, operator, paused_task):
    client.force_login(operator)
    response = client.get(edit_url(paused_task.pk))
    assert response.status_code == 200
    body = response.content.decode()
    assert re.search(r'name="params\.rows" value="500"', body)
    assert re.search(r'name="params\.batch_size" value="100"', body)
    assert re.search(r'name="params\.rate" value="1\.0"', body)
    # Limits: blank keeps the current value, which shows as the placeholder.
    assert re.search(r'name="limits\.max_steps" value=""[^>]*placeholder="3"', body)
    assert 'data-testid="limit-note"' in body and "max_steps" in body


def test_preview_shows_the_diff_and_the_batches_to_rerun_and_changes_nothing(client, operator, paused_task):
    client.force_login(operator)
    response = client.post(edit_url(paused_task.pk), form_data(paused_task, rate=2))
    assert response.status_code == 200
    body = response.content.decode()
    assert 'data-testid="diff-row" data-key="rate"' in body
    assert re.search(r'diff-old">1\.0<.*diff-new">2\.0<', body, re.S)
    lists = {name: re.findall(r'<li data-testid="step-id">([^<]+)</li>',
                              body.split(f'data-testid="steps-{name}"')[1].split("</ul>")[0])
             for name in ("kept", "rerun", "pending")}
    assert lists["kept"] == ["prepare-source"]
    assert lists["rerun"] == ["batch-0001", "batch-0002"]
    assert lists["pending"] == BATCHES
    assert body.count('data-testid="effect-row"') == 2  # the two batches' upserts, idempotent
    assert 'data-idempotent="yes"' in body
    assert 'data-testid="btn-confirm"' in body
    assert "max_steps is still 3" in body  # the limit that paused it was not raised
    assert json.loads(hidden(body, "params")) == {"rows": 500, "batch_size": 100, "rate": 2.0}
    assert int(hidden(body, "expected_version")) == paused_task.event_seq
    task = Task.objects.get(pk=paused_task.pk)
    assert task.params["rate"] == 1.0 and task.status == "paused" and task.event_seq == paused_task.event_seq


def test_confirm_applies_the_edit_and_the_task_finishes_with_the_new_rate(client, operator, paused_task):
    client.force_login(operator)
    preview = client.post(edit_url(paused_task.pk), {**form_data(paused_task, rate=2), "limits.max_steps": "1000"})
    assert "max_steps is still" not in preview.content.decode()
    response = client.post(edit_url(paused_task.pk), confirm_data(preview.content.decode()), follow=True)
    assert response.redirect_chain[-1][0] == detail_url(paused_task.pk)
    body = response.content.decode()
    assert "parameters edited (rate)" in body and "message-success" in body
    task = Task.objects.get(pk=paused_task.pk)
    assert task.status == "queued" and task.params == {"rows": 500, "batch_size": 100, "rate": 2.0}
    assert task.limits["max_steps"] == 1000 and task.limits["max_subtasks"] == 1
    entry = AuditEntry.objects.filter(task=task, action="task.edit_params", actor=operator).last()
    assert entry is not None and entry.ip == "127.0.0.1"
    assert Step.objects.get(task=task, step_id="batch-0001").generation == 1

    drive_inline(task.pk)
    task = Task.objects.get(pk=task.pk)
    assert task.status == "completed"
    source = sum(DemoSource.objects.filter(id__lte=500).values_list("amount", flat=True))
    assert sum(DemoDestination.objects.filter(id__lte=500).values_list("amount", flat=True)) == 2 * source


def test_an_invalid_value_rerenders_the_form_with_the_error_and_the_input(client, operator, paused_task):
    client.force_login(operator)
    response = client.post(edit_url(paused_task.pk), form_data(paused_task, rate=-3, batch_size=50))
    assert response.status_code == 422
    body = response.content.decode()
    assert re.search(r'data-testid="field-error" data-field="params\.rate">[^<]*greater than or equal to 0', body)
    assert re.search(r'name="params\.rate" value="-3"', body)
    assert re.search(r'name="params\.batch_size" value="50"', body)  # the input is kept
    assert Task.objects.get(pk=paused_task.pk).params["rate"] == 1.0


def test_a_stale_preview_is_refused_with_409_and_a_fresh_preview(client, operator, paused_task):
    client.force_login(operator)
    preview = client.post(edit_url(paused_task.pk), form_data(paused_task, rate=2)).content.decode()
    services.task_resume(task_id=paused_task.pk, limits={"max_steps": 4})  # another operator acts
    drive_inline(paused_task.pk)  # one more batch, then paused by the limit again
    moved = Task.objects.get(pk=paused_task.pk)
    assert moved.status == "paused" and moved.event_seq > paused_task.event_seq
    audit_before = AuditEntry.objects.filter(action="task.edit_params").count()

    response = client.post(edit_url(paused_task.pk), confirm_data(preview))
    assert response.status_code == 409
    body = response.content.decode()
    assert "the task changed since your preview" in body and "message-error" in body
    assert int(hidden(body, "expected_version")) == moved.event_seq  # a fresh preview
    assert "batch-0003" in body.split('data-testid="steps-rerun"')[1].split("</ul>")[0]
    task = Task.objects.get(pk=paused_task.pk)
    assert task.params["rate"] == 1.0 and task.status == "paused" and task.event_seq == moved.event_seq
    assert AuditEntry.objects.filter(action="task.edit_params").count() == audit_before


def test_a_task_that_is_not_paused_cannot_be_edited(client, operator):
    client.force_login(operator)
    task = services.task_create(type="demo.migrate_rows", params={"rows": 100, "batch_size": 100})
    response = client.get(edit_url(task.pk), follow=True)
    assert response.redirect_chain[-1][0] == detail_url(task.pk)
    assert "only a paused task can have its parameters edited" in response.content.decode()
    response = client.post(edit_url(task.pk), form_data(task, rate=3), follow=True)
    assert response.redirect_chain[-1][0] == detail_url(task.pk)
    assert Task.objects.get(pk=task.pk).params["rate"] == 1.0


def test_a_viewer_gets_403_everywhere(client, make_user, paused_task):
    client.force_login(make_user("vera", "viewer"))
    body = client.get(detail_url(paused_task.pk)).content.decode()
    assert 'data-testid="btn-edit"' not in body and 'data-testid="btn-rollback"' not in body
    assert client.get(edit_url(paused_task.pk)).status_code == 403
    assert client.post(edit_url(paused_task.pk), form_data(paused_task, rate=2)).status_code == 403
    assert client.post(edit_url(paused_task.pk), {"confirm": "1", "params": json.dumps({"rate": 2}),
                                                  "expected_version": paused_task.event_seq}).status_code == 403
    assert client.get(rollback_url(paused_task.pk, 2)).status_code == 403
    assert client.post(rollback_url(paused_task.pk, 2), {"expected_version": paused_task.event_seq}).status_code == 403
    assert client.post(reverse("task_clone", kwargs={"task_id": paused_task.pk}),
                       {"params": json.dumps(paused_task.params)}).status_code == 403
    task = Task.objects.get(pk=paused_task.pk)
    assert task.status == "paused" and task.params["rate"] == 1.0 and Task.objects.count() == 1


def test_confirm_without_the_hidden_fields_is_a_bad_request(client, operator, paused_task):
    client.force_login(operator)
    assert client.post(edit_url(paused_task.pk), {"confirm": "1"}).status_code == 400
    assert client.post(edit_url(paused_task.pk), {"confirm": "1", "params": "[1]", "expected_version": "1"}).status_code == 400
    assert client.post(rollback_url(paused_task.pk, 2), {}).status_code == 400


def test_an_edit_that_repeats_an_email_needs_its_checkbox_ticked_or_offers_a_new_task(client, operator, smtp):
    task = services.task_create(type="demo.notify", params={"recipients": ["a@example.org", "b@example.org"],
                                                            "subject": "Hi"}, limits={"max_steps": 1, "max_subtasks": 1})
    drive_inline(task.pk)
    task = Task.objects.get(pk=task.pk)
    assert task.status == "paused" and len(smtp.received) == 1
    key = task.wal_entries.get().idempotency_key
    client.force_login(operator)
    data = {"params.recipients": "a@example.org\nb@example.org", "params.subject": "Hello", "preview": "1"}
    data.update({f"params.{k}": str(v) for k, v in task.params.items() if k not in ("recipients", "subject")})
    body = client.post(edit_url(task.pk), data).content.decode()
    assert 'data-must-confirm="1"' in body and 'data-testid="repeat-warning"' in body
    assert f'name="repeat_effects" value="{key}" form="confirm-form"' in body
    assert "will be sent again to a@example.org" in body
    assert 'data-testid="btn-clone"' in body

    refused = client.post(edit_url(task.pk), confirm_data(body))  # the box left unticked
    assert refused.status_code == 409 and "would perform 1 non-idempotent side effect" in refused.content.decode()
    assert Task.objects.get(pk=task.pk).params["subject"] == "Hi"
    response = client.post(edit_url(task.pk), {**confirm_data(refused.content.decode()), "repeat_effects": key})
    assert response.status_code == 302
    assert Task.objects.get(pk=task.pk).params["subject"] == "Hello"
    assert AuditEntry.objects.get(task=task, action="effect.repeat_confirmed").actor == operator


def test_a_repeating_edit_can_start_a_new_task_instead(client, operator, smtp):
    task = services.task_create(type="demo.notify", params={"recipients": ["a@example.org", "b@example.org"],
                                                            "subject": "Hi"}, limits={"max_steps": 1, "max_subtasks": 1})
    drive_inline(task.pk)
    task = Task.objects.get(pk=task.pk)
    client.force_login(operator)
    data = {"params.recipients": "a@example.org\nb@example.org", "params.subject": "Hello", "preview": "1"}
    data.update({f"params.{k}": str(v) for k, v in task.params.items() if k not in ("recipients", "subject")})
    body = client.post(edit_url(task.pk), data).content.decode()
    response = client.post(reverse("task_clone", kwargs={"task_id": task.pk}),
                           {"params": hidden(body, "params"), "limits": hidden(body, "limits")})
    new = Task.objects.exclude(pk=task.pk).get()
    assert response.status_code == 302 and response["Location"] == detail_url(new.pk)
    assert new.type == "demo.notify" and new.params["subject"] == "Hello" and new.status == "queued"
    assert AuditEntry.objects.filter(task=new, action="task.create", actor=operator).exists()
    assert Task.objects.get(pk=task.pk).params["subject"] == "Hi"  # the original is untouched


# --- snapshots and rollback -------------------------------------------------------------------

def test_the_task_page_lists_kept_versions_newest_first_with_their_changes(client, operator, paused_task):
    client.force_login(operator)
    body = client.get(detail_url(paused_task.pk)).content.decode()
    versions = [int(v) for v in re.findall(r'data-testid="snapshot-row" data-version="(\d+)"', body)]
    assert versions == sorted(versions, reverse=True) and versions[0] == paused_task.checkpoint_version == 4
    rows = body.split('data-testid="snapshot-row"')[1:]
    assert "batch-0002: pending → done" in rows[0]
    assert "batch-0001: pending → done" in rows[1]
    assert "first version: a plan of 6 steps" in rows[-1]
    assert 'data-testid="btn-rollback" data-version="4"' not in body  # the current version
    assert 'data-testid="btn-rollback" data-version="2"' in body


def test_snapshot_changes_name_param_edits_and_reruns(client, operator, paused_task):
    client.force_login(operator)
    preview = client.post(edit_url(paused_task.pk), form_data(paused_task, rate=2)).content.decode()
    client.post(edit_url(paused_task.pk), confirm_data(preview))
    body = client.get(detail_url(paused_task.pk)).content.decode()
    newest = body.split('data-testid="snapshot-row"')[1]
    assert "param rate: 1.0 → 2.0" in newest
    assert "batch-0001: done → pending (re-run, generation 1)" in newest


def test_rollback_preview_lists_the_effects_after_and_confirm_applies(client, operator, paused_task):
    client.force_login(operator)
    response = client.get(rollback_url(paused_task.pk, 2))  # v2: prepare-source done
    assert response.status_code == 200
    body = response.content.decode()
    assert "they are NOT undone" in body
    effects = body.split('data-testid="effects-after"')[1].split("</table>")[0]
    assert re.findall(r'data-testid="effect-row" data-step-id="([^"]+)"', effects) == ["batch-0001", "batch-0002"]
    assert "db.upsert" in effects
    assert re.findall(r'<li data-testid="step-id">([^<]+)</li>',
                      body.split('data-testid="steps-kept"')[1].split("</ul>")[0]) == ["prepare-source"]
    assert int(hidden(body, "expected_version")) == paused_task.event_seq
    assert Task.objects.get(pk=paused_task.pk).status == "paused"  # the preview changed nothing

    response = client.post(rollback_url(paused_task.pk, 2), {"expected_version": hidden(body, "expected_version")},
                           follow=True)
    assert response.redirect_chain[-1][0] == detail_url(paused_task.pk)
    assert "rolled back to v2" in response.content.decode()
    task = Task.objects.get(pk=paused_task.pk)
    assert task.status == "queued" and task.steps_done == 1
    entry = AuditEntry.objects.filter(task=task, action="task.rollback", actor=operator).last()
    assert entry is not None and entry.ip == "127.0.0.1"


def test_rollback_errors_are_shown_as_messages(client, operator, paused_task):
    client.force_login(operator)
    Snapshot.objects.filter(task=paused_task, version=1).delete()  # as if pruned
    response = client.get(rollback_url(paused_task.pk, 1), follow=True)
    assert response.redirect_chain[-1][0] == detail_url(paused_task.pk)
    assert "has no snapshot v1" in response.content.decode()

    stale = client.get(rollback_url(paused_task.pk, 2)).content.decode()
    services.task_resume(task_id=paused_task.pk, limits={"max_steps": 4})
    drive_inline(paused_task.pk)
    response = client.post(rollback_url(paused_task.pk, 2), {"expected_version": hidden(stale, "expected_version")})
    assert response.status_code == 409
    assert "the task changed since your preview" in response.content.decode()
    assert Task.objects.get(pk=paused_task.pk).status == "paused"
    assert not AuditEntry.objects.filter(action="task.rollback").exists()

    services.task_resume(task_id=paused_task.pk, limits={"max_steps": 100})
    response = client.post(rollback_url(paused_task.pk, 2), {"expected_version": "1"}, follow=True)
    assert "only a paused task can be rolled back" in response.content.decode()
    assert Task.objects.get(pk=paused_task.pk).status == "queued"
