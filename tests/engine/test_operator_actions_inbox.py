"""Edits, rollbacks and Skip step are inbox events like the other operator actions (issue 20,
item 11): each leaves one consumed inbox row (P1, source operator) with its outcome, written
in the same transaction as the action (a refused action leaves none), and its audit entry."""
import pytest

from orchestrator.engine import inbox, revisions, services
from orchestrator.engine.worker import drive_inline
from orchestrator.models import AuditEntry, InboundEvent, Task

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.task_types("tests.support.testtypes")]


def the_row(task: Task, type_name: str) -> InboundEvent:
    rows = list(InboundEvent.objects.filter(task=task, type=type_name))
    assert len(rows) == 1, [(r.type, r.state, r.outcome) for r in InboundEvent.objects.filter(task=task)]
    row = rows[0]
    assert (row.state, row.priority, row.source) == ("consumed", 1, "operator")
    assert row.consumed_at is not None and row.consumed_in_version == Task.objects.get(pk=task.pk).checkpoint_version
    return row


def paused_migration(max_steps: int) -> Task:
    task = services.task_create(type="demo.migrate_rows", params={"rows": 500, "batch_size": 100, "rate": 1.0},
                                limits={"max_steps": max_steps, "max_subtasks": 1})
    drive_inline(task.pk)
    task = Task.objects.get(pk=task.pk)
    assert task.status == "paused"
    return task


def test_an_edit_is_an_inbox_row_with_its_outcome_and_its_audit_entry(operator):
    task = paused_migration(4)
    new = services.validate_params(task.type, {**task.params, "rate": 2.0})
    revisions.apply_edit(task_id=task.pk, new_params=new, expected_version=task.event_seq, actor=operator)
    row = the_row(task, "edit")
    assert row.actor == operator and row.actor_name == operator.username
    assert row.payload["diff"] == {"rate": [1.0, 2.0]} and sorted(row.payload["rerun"]) == [
        "batch-0001", "batch-0002", "batch-0003"]
    assert row.outcome.startswith("applied: parameters edited (rate); 3 finished step(s) run again"), row.outcome
    assert AuditEntry.objects.filter(task=task, action="task.edit_params", actor=operator).count() == 1
    assert Task.objects.get(pk=task.pk).inbox_pending == 0


def test_a_rollback_is_an_inbox_row_with_its_outcome_and_its_audit_entry(operator):
    task = paused_migration(4)
    dry = revisions.preview_rollback(task, 3)
    revisions.apply_rollback(task_id=task.pk, version=3, expected_version=dry.version, actor=operator)
    row = the_row(task, "rollback")
    assert row.payload["to_version"] == 3 and sorted(row.payload["rerun"]) == ["batch-0002", "batch-0003"]
    assert row.outcome.startswith("applied: rolled back to v3; 2 finished step(s) run again"), row.outcome
    assert AuditEntry.objects.filter(task=task, action="task.rollback", actor=operator).count() == 1
    assert Task.objects.get(pk=task.pk).inbox_pending == 0


def test_a_skip_step_is_an_inbox_row_with_its_outcome_and_its_audit_entry(operator):
    task = services.task_create(type="test.flaky", params={"mode": "same", "with_dependants": True})
    drive_inline(task.pk)
    assert Task.objects.get(pk=task.pk).status == "needs_human"
    services.task_skip_step(task_id=task.pk, step_id="work", reason="the upstream row is garbage", actor=operator)
    row = the_row(task, "skip_step")
    assert row.payload == {"step": "work", "reason": "the upstream row is garbage", "skipped": ["work", "after"]}
    assert row.outcome == "applied: skipped work and 1 dependant (after); the task continues", row.outcome
    assert AuditEntry.objects.filter(task=task, action="task.skip_step", actor=operator).count() == 1
    assert drive_inline(task.pk) == "completed"
    assert InboundEvent.objects.filter(task=task, type="skip_step").count() == 1  # the run did not touch it


def test_a_refused_action_leaves_no_inbox_row(operator, viewer):
    task = paused_migration(4)
    new = services.validate_params(task.type, {**task.params, "rate": 2.0})
    with pytest.raises(Exception):
        revisions.apply_edit(task_id=task.pk, new_params=new, expected_version=task.event_seq - 1, actor=operator)
    with pytest.raises(Exception):
        revisions.apply_rollback(task_id=task.pk, version=3, expected_version=task.event_seq, actor=viewer)
    with pytest.raises(Exception):
        services.task_skip_step(task_id=task.pk, step_id="batch-0004", reason="r", actor=operator)  # not needs_human
    assert not InboundEvent.objects.filter(task=task, type__in=("edit", "rollback", "skip_step")).exists()


def test_the_row_and_the_action_commit_together(operator, monkeypatch):
    """A failure once the row is written undoes the action too, and the reverse: one transaction."""
    task = paused_migration(4)
    new = services.validate_params(task.type, {**task.params, "rate": 2.0})

    def fail(*args, **kwargs):
        raise RuntimeError("the database went away")

    monkeypatch.setattr(inbox, "settle_control", fail)
    with pytest.raises(RuntimeError):
        revisions.apply_edit(task_id=task.pk, new_params=new, expected_version=task.event_seq, actor=operator)
    after = Task.objects.get(pk=task.pk)
    assert after.params["rate"] == 1.0 and after.status == "paused" and after.inbox_seq == task.inbox_seq
    assert not InboundEvent.objects.filter(task=task).exclude(pk__in=InboundEvent.objects.filter(
        task=task, seq__lte=task.inbox_seq).values("pk")).exists()
    assert not AuditEntry.objects.filter(task=task, action="task.edit_params").exists()


@pytest.mark.parametrize("type_name", ["edit", "rollback", "skip_step"])
def test_the_recorded_actions_cannot_be_sent_as_events(type_name):
    task = services.task_create(type="demo.pipeline", params={})
    with pytest.raises(inbox.InboxRefused, match="operator"):
        inbox.send(task_id=task.pk, type=type_name, payload={}, source="operator")


def test_the_inbox_api_lists_them(client, operator):
    task = paused_migration(4)
    new = services.validate_params(task.type, {**task.params, "rate": 2.0})
    revisions.apply_edit(task_id=task.pk, new_params=new, expected_version=task.event_seq, actor=operator)
    client.force_login(operator)
    listed = client.get(f"/api/tasks/{task.pk}/inbox").json()
    [edit] = [row for row in listed if row["type"] == "edit"]
    assert edit["state"] == "consumed" and edit["outcome"].startswith("applied: parameters edited")


def test_the_task_page_inbox_shows_a_skip_step_with_its_outcome(client, operator):
    from django.urls import reverse

    task = services.task_create(type="test.flaky", params={"mode": "same"})
    drive_inline(task.pk)
    services.task_skip_step(task_id=task.pk, step_id="work", reason="garbage row", actor=operator)
    client.force_login(operator)
    page = client.get(reverse("task_detail", kwargs={"task_id": task.pk})).content.decode()
    assert "skip_step" in page and "applied: skipped work; the task continues" in page
