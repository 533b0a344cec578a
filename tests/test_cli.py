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
