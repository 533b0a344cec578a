"""The compatibility gate of a resume after a deploy (issue 24, item 7; engine/compat.py): a task
paused, its type's code changed by the test (a tool's argument schema, the plan function, the
declared version), then resumed — refused under `pin`, migrated under `migrate`, shown and
confirmed under `ask`; an unchanged task resumes without a word. On the real engine and database."""
import dataclasses
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from pydantic import BaseModel

from orchestrator.agent import tooldef, toolbox
from orchestrator.engine import compat, revisions, services
from orchestrator.engine.worker import drive_inline
from orchestrator.models import AuditEntry, InboundEvent, Step, Task, TaskEvent
from tests.support import compat_types
from tests.support.helpers import CONTRACTS_GOAL, CONTRACTS_TOOLS, bearer

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.task_types("tests.support.compat_types")]

MORE = {"max_steps": 100}


def paused(type_name: str, **params) -> Task:
    """A task of `type_name` that ran one step and paused (its max_steps ran out)."""
    task = services.task_create(type=type_name, params=params, limits={"max_steps": 1, "max_subtasks": 1})
    assert drive_inline(task.pk) == "paused"
    task = Task.objects.get(pk=task.pk)
    assert task.compat["type"] == type_name and "tool:compat_lookup" in task.compat  # recorded by the run
    return task


class LookupArgsV2(BaseModel):
    query: str
    exact: bool = False  # the deploy added an argument


def change_tool_schema(monkeypatch) -> None:
    """The deploy: compat_lookup's argument model is another one."""
    definition = tooldef._DEFINED["compat_lookup"]
    monkeypatch.setitem(tooldef._DEFINED, "compat_lookup", dataclasses.replace(definition, Args=LookupArgsV2))


def resume(task_id: int, **options) -> Task:
    return services.task_resume(task_id=task_id, limits=MORE, **options)


def finish(task_id: int) -> Task:
    assert drive_inline(task_id) == "completed"
    return Task.objects.get(pk=task_id)


def test_an_unchanged_task_resumes_without_a_prompt():
    task = paused("test.compat_pin")
    gate = compat.check(task)
    assert gate.recorded and gate.compatible and gate.differences == []
    resume(task.pk)
    finish(task.pk)
    assert not AuditEntry.objects.filter(task=task, action__in=("task.accept_changes", "task.migrate")).exists()


def test_pin_refuses_with_the_differences_and_the_task_stays_paused(monkeypatch):
    task = paused("test.compat_pin")
    change_tool_schema(monkeypatch)
    with pytest.raises(compat.IncompatibleResume) as refused:
        resume(task.pk)
    message = str(refused.value)
    assert "tool compat_lookup: its argument schema changed" in message and "pin" in message
    assert refused.value.policy == "pin" and [d["key"] for d in refused.value.differences] == ["tool:compat_lookup"]
    task = Task.objects.get(pk=task.pk)
    assert task.status == "paused" and task.limits["max_steps"] == 1  # nothing of the resume was written
    assert not InboundEvent.objects.filter(task=task, type="resume").exists()
    # Accepting does not help under pin; the preview says it is refused.
    with pytest.raises(compat.IncompatibleResume):
        resume(task.pk, accept_changes=True)
    preview = revisions.preview_edit(task, task.params)[0]
    assert preview.compatibility["refused"] and preview.compatibility["policy"] == "pin"


def test_migrate_is_called_with_the_differences_and_the_task_completes_with_the_migrated_params(monkeypatch):
    compat_types.MIGRATIONS.clear()
    task = paused("test.compat_migrate")
    done_before = Step.objects.get(task=task, step_id="step-1").result
    assert done_before == {"label": "original", "found": "STEP-1"}
    change_tool_schema(monkeypatch)
    preview = revisions.preview_edit(task, task.params)[0]  # the resume preview: what the migration gives
    assert preview.compatibility["migrated_params"]["label"] == "migrated"
    compat_types.MIGRATIONS.clear()
    resume(task.pk)
    [(params, differences)] = compat_types.MIGRATIONS
    assert params["label"] == "original" and [d["key"] for d in differences] == ["tool:compat_lookup"]
    assert differences[0]["before"] == task.compat["tool:compat_lookup"] != differences[0]["after"]
    task = finish(task.pk)
    assert task.params["label"] == "migrated"
    results = dict(Step.objects.filter(task=task).values_list("step_id", "result"))
    assert results["step-1"] == done_before  # finished steps are kept: a migration is not an edit
    assert results["step-2"]["label"] == results["step-3"]["label"] == "migrated"
    entry = AuditEntry.objects.get(task=task, action="task.migrate")
    assert entry.before["params"]["label"] == "original" and entry.after["params"]["label"] == "migrated"
    assert TaskEvent.objects.filter(task=task, kind="params_migrated").exists()
    assert task.compat["tool:compat_lookup"] == differences[0]["after"]  # it ran on the new code


def test_a_migrate_that_raises_refuses_the_resume(monkeypatch):
    task = paused("test.compat_migrate", label="refuse")
    change_tool_schema(monkeypatch)
    with pytest.raises(compat.IncompatibleResume, match="a label of 'refuse' cannot be carried over"):
        resume(task.pk)
    assert Task.objects.get(pk=task.pk).status == "paused"


def test_ask_refuses_without_confirmation_shows_the_changes_and_resumes_once_accepted(monkeypatch, operator):
    task = paused("test.compat_ask")
    change_tool_schema(monkeypatch)
    with pytest.raises(compat.IncompatibleResume, match="accept_changes") as refused:
        resume(task.pk)
    assert "tool compat_lookup: its argument schema changed" in str(refused.value)
    assert Task.objects.get(pk=task.pk).status == "paused"
    preview = revisions.preview_edit(task, task.params)[0]
    assert preview.compatibility["needs_acceptance"] and not preview.compatibility["refused"]
    assert [d["key"] for d in preview.compatibility["differences"]] == ["tool:compat_lookup"]
    resume(task.pk, accept_changes=True, actor=operator)
    finish(task.pk)
    entry = AuditEntry.objects.get(task=task, action="task.accept_changes")
    assert entry.actor == operator and "compat_lookup" in entry.reason
    assert entry.after["differences"][0]["key"] == "tool:compat_lookup"


def test_a_changed_plan_function_and_a_raised_version_are_differences(monkeypatch):
    task = paused("test.compat_ask")

    def plan(self, params):  # the deploy changed how the plan is made
        return [StepSpec(f"step-{i}", depends_on=(f"step-{i - 1}",) if i > 1 else ()) for i in range(1, 4)]

    from orchestrator.sdk import StepSpec

    monkeypatch.setattr(compat_types.CompatAsk, "plan", plan)
    monkeypatch.setattr(compat_types.CompatAsk, "version", "2")
    differences = {d["key"]: d["text"] for d in compat.check(task).differences}
    assert set(differences) == {"version", "plan"}
    assert differences["version"] == "the task type's version changed: 1 → 2"
    assert differences["plan"].startswith("the type's plan function changed")


def test_edit_and_rollback_pass_the_same_gate(monkeypatch):
    task = paused("test.compat_ask")
    change_tool_schema(monkeypatch)
    new_params = revisions.edited_params(task, {"label": "edited"})
    with pytest.raises(compat.IncompatibleResume):
        revisions.apply_edit(task_id=task.pk, new_params=new_params, expected_version=task.event_seq, limits=MORE)
    version = Task.objects.get(pk=task.pk).checkpoint_version
    with pytest.raises(compat.IncompatibleResume):
        revisions.apply_rollback(task_id=task.pk, version=version, expected_version=task.event_seq)
    revisions.apply_edit(task_id=task.pk, new_params=new_params, expected_version=task.event_seq, limits=MORE,
                         accept_changes=True)
    task = finish(task.pk)
    assert task.params["label"] == "edited"
    assert AuditEntry.objects.filter(task=task, action="task.accept_changes").count() == 1


def test_api_cli_and_pages_refuse_show_and_confirm(monkeypatch, client, operator):
    task = paused("test.compat_ask")
    # As if an operator had paused it (Resume is offered; a task paused by a limit needs it raised).
    Task.objects.filter(pk=task.pk).update(paused_by_limit="", limits={**task.limits, **MORE})
    change_tool_schema(monkeypatch)
    headers = bearer(operator)
    # API: 409 with each difference; the dry run is the resume preview; accept_changes resumes.
    refused = client.post(f"/api/tasks/{task.pk}/resume", {}, content_type="application/json", **headers)
    assert refused.status_code == 409
    assert refused.json()["errors"] == [{"field": "compatibility.tool:compat_lookup",
                                         "message": refused.json()["errors"][0]["message"]}]
    assert "its argument schema changed" in refused.json()["errors"][0]["message"]
    dry = client.post(f"/api/tasks/{task.pk}/resume", {"dry_run": True}, content_type="application/json", **headers)
    assert dry.status_code == 200 and dry.json()["preview"]["compatibility"]["needs_acceptance"]
    # The inbox's resume event is refused the same way.
    sent = client.post(f"/api/tasks/{task.pk}/events", {"type": "resume"}, content_type="application/json", **headers)
    assert sent.status_code == 409
    # CLI: refused, then confirmed.
    with pytest.raises(CommandError, match="accept_changes"):
        call_command("tasks", "resume", str(task.pk))
    out = StringIO()
    call_command("tasks", "resume", str(task.pk), "--dry-run", stdout=out)
    assert "code changed since the task paused (policy ask)" in out.getvalue()
    assert "tool compat_lookup: its argument schema changed" in out.getvalue()
    # Pages: the task page lists the change beside Resume; Resume without the box goes to the preview.
    client.force_login(operator)
    page = client.get(f"/tasks/{task.pk}/").content.decode()
    assert 'data-testid="compat-changes"' in page and "tool compat_lookup: its argument schema changed" in page
    assert 'data-testid="accept-changes"' in page
    response = client.post(f"/tasks/{task.pk}/control/", {"action": "resume"})
    assert response.status_code == 302 and response.url.endswith("?resume=1")
    preview = client.get(response.url)
    assert preview.status_code == 200 and 'data-testid="compat-changes"' in preview.content.decode()
    assert Task.objects.get(pk=task.pk).status == "paused"
    confirm = client.post(f"/tasks/{task.pk}/edit/", {"confirm": "1", "params": "{}", "limits": '{"max_steps": 100}',
                                                      "expected_version": str(Task.objects.get(pk=task.pk).event_seq),
                                                      "accept_changes": "1"})
    assert confirm.status_code == 302, confirm.content.decode()[:2000]
    assert Task.objects.get(pk=task.pk).status == "queued"
    assert AuditEntry.objects.get(task=task, action="task.accept_changes").actor == operator
    finish(task.pk)


# --- an agent whose granted tool's schema changes ------------------------------------------------

GOAL, EMAILS = CONTRACTS_GOAL, CONTRACTS_TOOLS  # tests/support/helpers.py; `model`: tests/conftest.py


class MemorySearchV2(BaseModel):
    query: str
    limit: int = 20


def test_an_agent_whose_granted_tools_schema_changed_is_caught(model, smtp, monkeypatch):
    task = services.task_create(type="agent.plan_execute", params={"goal": GOAL, **EMAILS},
                                limits={"max_steps": 1})
    assert drive_inline(task.pk) == "paused"
    task = Task.objects.get(pk=task.pk)
    assert {"prompt:system", "prompt:summary", "model", "tool:memory_search", "tool:email_send"} <= set(task.compat)
    assert task.compat["model"] == "(default): standin-planner"
    assert compat.check(task).compatible
    monkeypatch.setitem(toolbox.TOOLS, "memory_search",
                        dataclasses.replace(toolbox.TOOLS["memory_search"], Args=MemorySearchV2))
    with pytest.raises(compat.IncompatibleResume, match="tool memory_search: its argument schema changed"):
        services.task_resume(task_id=task.pk, limits={"max_steps": 1000})
    assert Task.objects.get(pk=task.pk).status == "paused"
    services.task_resume(task_id=task.pk, limits={"max_steps": 1000}, accept_changes=True)
    assert drive_inline(task.pk) == "completed"
    assert len(smtp.received) == 1


def test_a_task_whose_type_this_deploy_no_longer_has_is_refused_with_why_not_an_error(monkeypatch):
    from orchestrator import tasktypes

    task = paused("test.compat_ask")
    monkeypatch.delitem(tasktypes._registry, "test.compat_ask")  # the deploy dropped the type's module
    with pytest.raises(compat.IncompatibleResume) as refused:
        resume(task.pk, accept_changes=True)  # no acceptance makes a type that is not here run
    assert "the task type test.compat_ask is not installed here" in str(refused.value)
    assert Task.objects.get(pk=task.pk).status == "paused"


def test_a_viewer_cannot_accept_the_changes_and_nothing_is_audited(monkeypatch, client, viewer):
    task = paused("test.compat_ask")
    Task.objects.filter(pk=task.pk).update(paused_by_limit="", limits={**task.limits, **MORE})
    change_tool_schema(monkeypatch)
    response = client.post(f"/api/tasks/{task.pk}/resume", {"accept_changes": True}, content_type="application/json",
                           **bearer(viewer))
    assert response.status_code == 403
    assert Task.objects.get(pk=task.pk).status == "paused"
    assert not AuditEntry.objects.filter(task=task, action="task.accept_changes").exists()
