import pytest
from django.core.management import CommandError, call_command

from orchestrator.models import Task

pytestmark = pytest.mark.django_db


def test_tasks_create_list_show_and_control(capsys):
    call_command("tasks", "create", "demo.migrate_rows", "--param", "rows=300", "--param", "rate=2.5",
                 "--limit", "max_subtasks=2")
    task_id = int(capsys.readouterr().out.strip().splitlines()[-1])
    task = Task.objects.get(pk=task_id)
    assert task.params == {"rows": 300, "batch_size": 500, "rate": 2.5}
    assert task.limits["max_subtasks"] == 2
    call_command("tasks", "list")
    assert f"{task_id}  demo.migrate_rows" in capsys.readouterr().out
    call_command("tasks", "show", str(task_id))
    assert "status=queued" in capsys.readouterr().out
    call_command("tasks", "pause", str(task_id))
    assert "paused" in capsys.readouterr().out
    call_command("tasks", "resume", str(task_id))
    assert Task.objects.get(pk=task_id).status == "queued"


def test_tasks_create_reports_bad_params_by_field():
    with pytest.raises(CommandError, match="params.rows"):
        call_command("tasks", "create", "demo.migrate_rows", "--param", "rows=-5")
    with pytest.raises(CommandError, match="key=value"):
        call_command("tasks", "create", "demo.migrate_rows", "--param", "rows")
    assert not Task.objects.exists()


def test_control_of_a_missing_or_finished_task_is_explained():
    with pytest.raises(CommandError, match="no task #4242"):
        call_command("tasks", "stop", "4242")


# --- revising a paused task: resume with edited params, rollback -------------------------------

def paused_migration(capsys) -> int:
    """demo.migrate_rows run in-process until max_steps=3 pauses it (prepare + 2 batches)."""
    from orchestrator.engine.worker import drive_inline

    call_command("tasks", "create", "demo.migrate_rows", "--param", "rows=500", "--param", "batch_size=100",
                 "--limit", "max_steps=3", "--limit", "max_subtasks=1")
    task_id = int(capsys.readouterr().out.strip().splitlines()[-1])
    drive_inline(task_id)
    assert Task.objects.get(pk=task_id).status == "paused"
    return task_id


@pytest.mark.django_db(transaction=True)
def test_resume_with_params_dry_run_prints_the_preview_and_changes_nothing(capsys):
    task_id = paused_migration(capsys)
    seq = Task.objects.get(pk=task_id).event_seq
    call_command("tasks", "resume", str(task_id), "--param", "rate=2", "--limit", "max_steps=1000", "--dry-run")
    out = capsys.readouterr().out
    assert f"task #{task_id} demo.migrate_rows: edit preview (at event {seq})" in out
    assert "rate: 1.0 -> 2.0" in out and "limit max_steps: 3 -> 1000" in out
    assert "kept (1): prepare-source" in out
    assert "re-run (2): batch-0001, batch-0002" in out
    assert "still to run (5): batch-0001, batch-0002, batch-0003, batch-0004, batch-0005" in out
    assert "side effects performed again (2):" in out and "db.upsert" in out and "replays harmlessly" in out
    assert "must confirm: nothing" in out and "dry run: nothing changed" in out
    task = Task.objects.get(pk=task_id)
    assert task.status == "paused" and task.params["rate"] == 1.0 and task.event_seq == seq


@pytest.mark.django_db(transaction=True)
def test_resume_with_params_applies_the_edit_and_the_task_completes(capsys):
    from decimal import Decimal

    from orchestrator.engine.worker import drive_inline
    from orchestrator.models import AuditEntry
    from demo.models import DemoDestination, DemoSource

    task_id = paused_migration(capsys)
    call_command("tasks", "resume", str(task_id), "--param", "rate=2", "--limit", "max_steps=1000")
    assert f"task #{task_id}: params edited (rate); 2 step(s) to re-run; queued" in capsys.readouterr().out
    task = Task.objects.get(pk=task_id)
    assert task.params["rate"] == 2.0 and task.limits["max_steps"] == 1000
    assert AuditEntry.objects.filter(task=task, action="task.edit_params").exists()
    drive_inline(task_id)
    assert Task.objects.get(pk=task_id).status == "completed"
    source = sum(DemoSource.objects.filter(id__lte=500).values_list("amount", flat=True), Decimal(0))
    assert sum(DemoDestination.objects.filter(id__lte=500).values_list("amount", flat=True)) == 2 * source


@pytest.mark.django_db(transaction=True)
def test_resume_with_bad_params_or_an_unconfirmed_repeat_exits_with_an_error(capsys, smtp):
    from orchestrator.engine.worker import drive_inline

    task_id = paused_migration(capsys)
    with pytest.raises(CommandError, match="params.rate"):
        call_command("tasks", "resume", str(task_id), "--param", "rate=-1")
    assert Task.objects.get(pk=task_id).params["rate"] == 1.0

    call_command("tasks", "create", "demo.notify", "--param", 'recipients=["a@example.org","b@example.org"]',
                 "--param", "subject=Hi", "--limit", "max_steps=1", "--limit", "max_subtasks=1")
    notify_id = int(capsys.readouterr().out.strip().splitlines()[-1])
    drive_inline(notify_id)
    assert Task.objects.get(pk=notify_id).status == "paused" and len(smtp.received) == 1
    with pytest.raises(CommandError, match="would perform 1 non-idempotent side effect"):
        call_command("tasks", "resume", str(notify_id), "--param", "subject=Hello")
    out = capsys.readouterr().out
    assert "will be sent again to a@example.org" in out and "confirm with --repeat-effect KEY" in out
    task = Task.objects.get(pk=notify_id)
    assert task.status == "paused" and task.params["subject"] == "Hi" and len(smtp.received) == 1
    key = task.wal_entries.get().idempotency_key
    call_command("tasks", "resume", str(notify_id), "--param", "subject=Hello", "--repeat-effect", key)
    assert Task.objects.get(pk=notify_id).status == "queued"


@pytest.mark.django_db(transaction=True)
def test_rollback_dry_run_then_apply(capsys):
    from orchestrator.models import AuditEntry

    task_id = paused_migration(capsys)
    call_command("tasks", "rollback", str(task_id), "--version", "2", "--dry-run")
    out = capsys.readouterr().out
    assert "rollback preview to v2" in out and "kept (1): prepare-source" in out
    assert "re-run (2): batch-0001, batch-0002" in out
    assert "side effects after v2 (NOT undone) (2):" in out
    assert Task.objects.get(pk=task_id).status == "paused"

    call_command("tasks", "rollback", str(task_id), "--version", "2")
    out = capsys.readouterr().out
    assert f"task #{task_id}: rolled back to v2; 2 step(s) to re-run; 2 side effect(s) after v2 not undone; queued" in out
    task = Task.objects.get(pk=task_id)
    assert task.status == "queued" and task.steps_done == 1
    assert AuditEntry.objects.filter(task=task, action="task.rollback").exists()

    with pytest.raises(CommandError, match="only a paused task|pause it"):
        call_command("tasks", "rollback", str(task_id), "--version", "2")
    with pytest.raises(CommandError, match="no task #4242"):
        call_command("tasks", "rollback", "4242", "--version", "1")


@pytest.mark.django_db
def test_send_puts_an_event_in_the_inbox_and_explains_a_refusal(settings):
    from io import StringIO

    from django.core.management import CommandError, call_command

    from orchestrator.engine import services
    from orchestrator.models import InboundEvent

    settings.ORCH_EXTRA_TASK_TYPES = ["tests.support.testtypes"]
    task = services.task_create(type="test.growing", params={})
    out = StringIO()
    call_command("tasks", "send", str(task.pk), "user.message", "--payload", '{"text": "hi"}', "--source-event-id",
                 "cli-1", stdout=out)
    assert f"task #{task.pk}: event #1 user.message P1 pending" in out.getvalue()
    call_command("tasks", "send", str(task.pk), "user.message", "--payload", '{"text": "hi"}', "--source-event-id",
                 "cli-1", stdout=out)
    assert "a repeat" in out.getvalue() and InboundEvent.objects.count() == 1
    with pytest.raises(CommandError, match="refused \\(422\\).*payload.text"):
        call_command("tasks", "send", str(task.pk), "user.message", "--payload", "{}")
    with pytest.raises(CommandError, match="not JSON"):
        call_command("tasks", "send", str(task.pk), "user.message", "--payload", "{nope")
