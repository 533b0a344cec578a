"""Failing steps: transient failures retry with backoff, the same failure twice needs a
human (who is told), recovery checks the task's external resources first."""
from datetime import timedelta

import pytest
from django.db.models import F

from orchestrator.engine import recovery, services
from orchestrator.engine.lease import claim
from orchestrator.engine.worker import drive_inline
from orchestrator.models import AuditEntry, Step, Task, TaskEvent

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.task_types("tests.support.testtypes")]


def run(params: dict) -> Task:
    task = services.task_create(type="test.flaky", params=params)
    drive_inline(task.pk)
    return Task.objects.get(pk=task.pk)


def test_a_transient_failure_is_retried_and_the_task_completes(tmp_path):
    task = run({"mode": "transient", "marker": str(tmp_path / "up")})
    assert task.status == "completed"
    step = Step.objects.get(task=task)
    assert step.attempts == 2 and step.result == "ok"


def test_the_same_failure_twice_needs_a_human_and_the_operators_are_emailed(make_user, mailoutbox):
    operator = make_user("otto", "operator")
    operator.email = "otto@example.org"
    operator.save()
    task = run({"mode": "same"})  # numbers and addresses differ; the fingerprint does not
    assert task.status == "needs_human"
    assert "failed twice the same way" in task.status_reason and "ValueError" in task.status_reason
    assert Step.objects.get(task=task).attempts == 2  # not retried a third time
    assert [m.to for m in mailoutbox] == [["otto@example.org"]]
    assert f"/api/tasks/{task.pk}/export" in mailoutbox[0].body


def test_different_failures_use_up_the_attempts_then_need_a_human_by_default(tmp_path):
    task = run({"mode": "changing", "marker": str(tmp_path / "count")})
    assert task.status == "needs_human"  # resumable once the cause is fixed
    assert "failed after 3 attempts" in task.status_reason and "RuntimeError" in task.status_reason
    assert "Fix the cause and resume, or skip the step" in task.status_reason
    assert Step.objects.get(task=task).attempts == 3


def test_a_step_whose_policy_is_fail_fails_the_task(tmp_path):
    task = run({"mode": "changing", "marker": str(tmp_path / "count"), "on_failure": "fail"})
    assert task.status == "failed" and "failed after 3 attempts" in task.status_reason


def test_a_step_whose_policy_is_skip_is_skipped_with_its_dependants_and_the_summary_sees_it():
    task = run({"mode": "same", "on_failure": "skip", "with_dependants": True})
    assert task.status == "completed", task.status_reason
    steps = {s.step_id: s for s in Step.objects.filter(task=task)}
    assert steps["work"].status == "skipped" and "failed twice the same way" in steps["work"].error
    assert steps["after"].status == "skipped" and steps["after"].error == "skipped: depends on work, which was skipped"
    assert steps["summary"].status == "done"
    assert set(steps["summary"].result["skipped"]) == {"work", "after"}
    assert steps["summary"].result["deps"] == {"work": None, "after": None}
    event = TaskEvent.objects.get(task=task, kind="step_skipped")
    assert event.payload["step"] == "work" and event.payload["dependants"] == ["after"] and event.payload["by"] == "policy"


def test_an_operator_skips_the_failed_step_of_a_task_that_needs_a_human(operator):
    task = run({"mode": "same", "with_dependants": True})
    assert task.status == "needs_human"
    with pytest.raises(services.InvalidInput, match="a reason is required"):
        services.task_skip_step(task_id=task.pk, step_id="work", reason=" ", actor=operator)
    with pytest.raises(services.InvalidInput, match="no step 'nope'"):
        services.task_skip_step(task_id=task.pk, step_id="nope", reason="r", actor=operator)
    skipped = services.task_skip_step(task_id=task.pk, step_id="work", reason="the upstream row is garbage",
                                      actor=operator)
    assert skipped == ["work", "after"]
    audit = AuditEntry.objects.get(task=task, action="task.skip_step")
    assert audit.actor == operator and audit.reason == "the upstream row is garbage"
    assert drive_inline(task.pk) == "completed"
    work = Step.objects.get(task=task, step_id="work")
    assert work.status == "skipped" and "skipped by otto: the upstream row is garbage" in work.error
    assert "ValueError" in work.error  # the last error stays visible
    with pytest.raises(services.states.InvalidTransition, match="a finished task cannot have a step skipped"):
        services.task_skip_step(task_id=task.pk, step_id="summary", reason="r", actor=operator)


def test_a_needs_human_task_can_be_resumed_by_an_operator():
    task = run({"mode": "same"})
    services.task_resume(task_id=task.pk)
    assert Task.objects.get(pk=task.pk).status == "queued"


def test_recovery_checks_external_resources_before_continuing(tmp_path, settings):
    settings.ORCH_STALE_AFTER_SECONDS = 0.1
    resource = tmp_path / "input.csv"
    task = services.task_create(type="test.flaky", params={"mode": "transient", "marker": str(tmp_path / "m"),
                                                           "resource": str(resource)})
    assert claim(task.pk) is not None  # a worker took it, then died without a heartbeat
    Task.objects.filter(pk=task.pk).update(status="running", heartbeat_at=F("heartbeat_at") - timedelta(seconds=5))
    assert recovery.sweep() == [task.pk]
    task = Task.objects.get(pk=task.pk)
    assert task.status == "needs_human" and "input file" in task.status_reason


def test_skip_step_from_the_page_the_api_and_the_cli(client, operator):
    from django.core.management import call_command
    from django.urls import reverse

    from orchestrator.auth import token_issue

    pages = run({"mode": "same"})
    client.force_login(operator)
    page = client.get(reverse("task_detail", kwargs={"task_id": pages.pk})).content.decode()
    assert 'data-testid="skip-step-form"' in page and '<option value="work">work (failed)</option>' in page
    response = client.post(reverse("task_skip_step", kwargs={"task_id": pages.pk}), {"step_id": "work", "reason": ""})
    assert response.status_code == 302 and Task.objects.get(pk=pages.pk).status == "needs_human"  # reason required
    client.post(reverse("task_skip_step", kwargs={"task_id": pages.pk}), {"step_id": "work", "reason": "bad row"})
    assert Task.objects.get(pk=pages.pk).status == "queued"

    api = run({"mode": "same"})
    client.logout()
    answer = client.post(f"/api/tasks/{api.pk}/skip-step", {"step_id": "work", "reason": "bad row"},
                         content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {token_issue(user=operator)}")
    assert answer.status_code == 200 and answer.json()["status"] == "queued"

    cli = run({"mode": "same"})
    call_command("tasks", "skip-step", str(cli.pk), "--step", "work", "--reason", "bad row")
    assert Task.objects.get(pk=cli.pk).status == "queued"
