"""The task page's controls in a real Chromium against daphne + real workers: Stop, Pause
and Resume, Force-terminate, Resume on a task that needs a human, and a viewer's page.

The controls are rendered by the server from orchestrator/engine/actions.py, for the first
page and for every live update (a fragment of the same template, swapped in by live.js);
the controls box's `data-allowed-actions` says what the last render allowed. Once the browser runs, database calls
go through `in_thread` (see test_dashboard.py).
"""
import re

import pytest
from playwright.sync_api import expect

from orchestrator.engine import services
from orchestrator.engine.worker import drive_inline
from orchestrator.models import AuditEntry, Step, Task, TaskEvent
from tests.browser.conftest import header_badge, in_thread
from tests.conftest import wait_for
from tests.support.helpers import stage_processes
from tests.support.controls import controls

pytestmark = [pytest.mark.browser, pytest.mark.workers, pytest.mark.django_db(transaction=True)]

LIVE = 60_000  # ms: worker start-up plus the run
TEST_TYPES = {"ORCH_EXTRA_TASK_TYPES": "tests.support.testtypes"}
BUTTONS = ("btn-stop", "btn-pause", "btn-resume", "btn-terminate", "btn-edit", "btn-skip-step", "btn-rollback")


def visible_controls(page) -> set[str]:
    """The control names the page shows now ([data-action] elements that are visible)."""
    return set(page.locator("[data-action]").evaluate_all(
        "nodes => nodes.filter(n => !n.hidden && n.style.display !== 'none').map(n => n.dataset.action)"))


def allowed_actions(page):
    """The controls box, whose data-allowed-actions lists what its last render allowed."""
    return page.get_by_test_id("controls")


def audit(task_id: int, action: str) -> list[AuditEntry]:
    return list(AuditEntry.objects.filter(task_id=task_id, action=action).select_related("actor"))


def test_operator_stops_a_running_pipeline_and_no_stage_process_is_left(stack, new_page, make_user):
    make_user("olga", "operator")
    task = services.task_create(type="demo.pipeline", params={"stages": 3, "seconds_per_stage": 120})
    page = new_page("olga")
    page.goto(f"/tasks/{task.pk}/")
    expect(header_badge(page)).to_have_text("queued")
    expect(page.get_by_test_id("live-indicator")).to_have_text("live")

    stack.start_workers(1)
    expect(header_badge(page)).to_have_text("running", timeout=LIVE)
    in_thread(wait_for, lambda: stage_processes(task.pk), timeout=30, message="the stage subprocess")
    expect(allowed_actions(page)).to_have_attribute("data-allowed-actions", "stop pause terminate")
    page.get_by_test_id("btn-stop").click()

    expect(page.get_by_test_id("message")).to_have_text(
        re.compile(rf"^(Stop requested for task #{task.pk}|Task #{task.pk} stopped)\.$"))
    expect(header_badge(page)).to_have_text("stopped", timeout=30_000)
    for button in BUTTONS:
        expect(page.get_by_test_id(button)).to_be_hidden()
    expect(page.locator('[data-live="controls-note"]')).to_have_text("This task has finished; it cannot be controlled.")
    task = in_thread(Task.objects.get, pk=task.pk)
    assert task.status == "stopped" and task.activities == []
    assert stage_processes(task.pk) == [], "a stage process outlived the Stop"
    assert [(a.actor.username, a.before["status"]) for a in in_thread(audit, task.pk, "task.stop") if a.actor] == [
        ("olga", "running")]
    assert in_thread(lambda: Step.objects.get(task_id=task.pk, step_id="stage-01").status) != "done"


def test_operator_pauses_then_resumes_a_running_migration_and_it_completes(stack, new_page, make_user):
    make_user("olga", "operator")
    task = services.task_create(type="demo.migrate_rows", params={"rows": 30000, "batch_size": 100, "rate": 2},
                                limits={"max_subtasks": 1})
    page = new_page("olga")
    page.goto(f"/tasks/{task.pk}/")
    expect(header_badge(page)).to_have_text("queued")
    expect(page.get_by_test_id("live-indicator")).to_have_text("live")

    stack.start_workers(1)
    expect(header_badge(page)).to_have_text("running", timeout=LIVE)
    expect(allowed_actions(page)).to_have_attribute("data-allowed-actions", "stop pause terminate")
    page.get_by_test_id("btn-pause").click()

    expect(header_badge(page)).to_have_text("paused", timeout=30_000)
    expect(page.get_by_test_id("btn-resume")).to_be_visible()
    expect(page.get_by_test_id("btn-pause")).to_be_hidden()
    expect(page.get_by_test_id("btn-edit")).to_be_visible()
    paused = in_thread(Task.objects.get, pk=task.pk)
    assert paused.status == "paused" and 0 < paused.steps_done < paused.steps_total
    assert paused.status_reason == "paused by an operator" and paused.paused_by_limit == ""

    page.get_by_test_id("btn-resume").click()
    expect(page.get_by_test_id("message")).to_have_text(f"Task #{task.pk} resumed.")
    expect(header_badge(page)).to_have_text("completed", timeout=LIVE)
    expect(page.locator('[data-live="steps"]')).to_have_text("301 / 301")
    for button in BUTTONS:
        expect(page.get_by_test_id(button)).to_be_hidden()
    assert [a.actor.username for a in in_thread(audit, task.pk, "task.pause")] == ["olga"]
    assert [a.actor.username for a in in_thread(audit, task.pk, "task.resume")] == ["olga"]
    assert in_thread(lambda: Task.objects.get(pk=task.pk).status) == "completed"


def test_operator_force_terminates_a_running_task_with_a_reason(stack, new_page, make_user):
    make_user("olga", "operator")
    task = services.task_create(type="demo.pipeline", params={"stages": 2, "seconds_per_stage": 120})
    page = new_page("olga")
    page.goto(f"/tasks/{task.pk}/")
    expect(page.get_by_test_id("live-indicator")).to_have_text("live")
    stack.start_workers(1)
    expect(header_badge(page)).to_have_text("running", timeout=LIVE)
    in_thread(wait_for, lambda: stage_processes(task.pk), timeout=30, message="the stage subprocess")

    dialogs = []

    def accept(dialog):
        dialogs.append(dialog.message)
        dialog.accept()

    page.on("dialog", accept)
    page.get_by_test_id("terminate-reason").fill("runaway stage eating the CPU")
    page.get_by_test_id("btn-terminate").click()

    expect(header_badge(page)).to_have_text("terminated", timeout=30_000)
    assert dialogs == [f"Force-terminate task #{task.pk}? Running work is killed without waiting for a safe point."]
    for button in BUTTONS:
        expect(page.get_by_test_id(button)).to_be_hidden()
    entries = in_thread(audit, task.pk, "task.terminate")  # the request, and the kill (by the system)
    assert [(a.actor.username, a.reason) for a in entries if a.actor] == [("olga", "runaway stage eating the CPU")]
    assert in_thread(Task.objects.get, pk=task.pk).status == "terminated"
    assert stage_processes(task.pk) == [], "a stage process outlived the Force-terminate"


def test_a_typed_reason_survives_a_live_update_and_the_swapped_in_form_posts(stack, new_page, make_user):
    """The controls are re-rendered when the task changes; what the operator was typing stays,
    and the new form (its CSRF token rendered for the websocket) is accepted."""
    make_user("olga", "operator")
    task = services.task_create(type="demo.pipeline", params={"stages": 2, "seconds_per_stage": 120})
    page = new_page("olga")
    page.goto(f"/tasks/{task.pk}/")
    expect(page.get_by_test_id("live-indicator")).to_have_text("live")
    stack.start_workers(1)
    expect(header_badge(page)).to_have_text("running", timeout=LIVE)
    in_thread(wait_for, lambda: stage_processes(task.pk), timeout=30, message="the stage subprocess")
    expect(allowed_actions(page)).to_have_attribute("data-allowed-actions", "stop pause terminate")
    page.get_by_test_id("terminate-reason").fill("stuck on a stage")
    rendered_with_the_page = page.get_by_test_id("controls").element_handle()

    in_thread(services.task_pause, task_id=task.pk)  # another operator, elsewhere
    expect(header_badge(page)).to_have_text("pausing")
    expect(page.get_by_test_id("btn-pause")).to_be_hidden()
    assert rendered_with_the_page.evaluate("node => node.isConnected") is False, "the controls were not re-rendered"
    expect(page.get_by_test_id("terminate-reason")).to_have_value("stuck on a stage")

    page.on("dialog", lambda dialog: dialog.accept())
    page.get_by_test_id("btn-terminate").click()
    expect(header_badge(page)).to_have_text("terminated", timeout=30_000)
    entries = in_thread(audit, task.pk, "task.terminate")
    assert [(a.actor.username, a.reason) for a in entries if a.actor] == [("olga", "stuck on a stage")]
    assert stage_processes(task.pk) == [], "a stage process outlived the Force-terminate"


def test_resume_stays_visible_on_a_task_that_needs_a_human_after_live_updates(stack, new_page, make_user, settings):
    """The known bug: the server rendered Resume on a needs_human task, and the first live
    `state` hid it. Now live updates are renders of the same template, from engine/actions.py."""
    settings.ORCH_EXTRA_TASK_TYPES = ["tests.support.testtypes"]
    make_user("olga", "operator")
    task = services.task_create(type="test.flaky", params={"mode": "same"})  # fails the same way twice
    page = new_page("olga")
    page.goto(f"/tasks/{task.pk}/")
    expect(page.get_by_test_id("live-indicator")).to_have_text("live")
    expect(page.get_by_test_id("btn-resume")).to_be_hidden()

    stack.start_workers(1, **TEST_TYPES)
    expect(header_badge(page)).to_have_text("needs_human", timeout=LIVE)
    # Live: Resume appears, and Skip step with its list of steps (rendered by the server).
    expect(allowed_actions(page)).to_have_attribute("data-allowed-actions", "stop resume skip_step terminate")
    expect(page.get_by_test_id("btn-resume")).to_be_visible()
    expect(page.get_by_test_id("btn-skip-step")).to_be_visible()
    expect(page.get_by_test_id("skip-step-id").locator("option")).not_to_have_count(0)
    expect(page.locator('[data-live="controls-note"]')).to_be_hidden()

    # A fresh page: rendered with Resume, and the first `state` keeps it.
    rendered = controls(page.goto(f"/tasks/{task.pk}/").text())[1]
    assert rendered == {"stop", "resume", "skip_step", "terminate"}
    expect(allowed_actions(page)).to_have_attribute("data-allowed-actions", "stop resume skip_step terminate")
    expect(page.get_by_test_id("btn-resume")).to_be_visible()
    expect(page.get_by_test_id("btn-skip-step")).to_be_visible()
    assert visible_controls(page) == rendered
    expect(page.locator('[data-live="controls-note"]')).to_be_hidden()

    page.get_by_test_id("btn-resume").click()
    expect(page.get_by_test_id("message")).to_have_text(f"Task #{task.pk} resumed.")
    assert [a.actor.username for a in in_thread(audit, task.pk, "task.resume")] == ["olga"]
    # It runs again, fails the same way again, and needs a human again: Resume is back, live.
    in_thread(wait_for, lambda: TaskEvent.objects.filter(task_id=task.pk, kind="status",
                                                         payload__to="needs_human").count() == 2,
              timeout=60, message="the second failure")
    expect(header_badge(page)).to_have_text("needs_human")
    expect(allowed_actions(page)).to_have_attribute("data-allowed-actions", "stop resume skip_step terminate")
    expect(page.get_by_test_id("btn-resume")).to_be_visible()


def test_a_viewer_sees_no_controls_even_as_live_updates_arrive(stack, new_page, make_user):
    make_user("vera", "viewer")

    def paused_task() -> Task:
        task = services.task_create(type="demo.migrate_rows", params={"rows": 300, "batch_size": 100},
                                    limits={"max_steps": 2, "max_subtasks": 1})
        drive_inline(task.pk)
        return Task.objects.get(pk=task.pk)

    task = in_thread(paused_task)
    assert task.status == "paused" and task.paused_by_limit == "max_steps"
    page = new_page("vera")
    page.goto(f"/tasks/{task.pk}/")
    expect(header_badge(page)).to_have_text("paused")
    expect(page.get_by_test_id("live-indicator")).to_have_text("live")
    expect(page.get_by_test_id("controls")).to_have_count(0)
    expect(page.locator("[data-action]")).to_have_count(0)

    in_thread(services.task_resume, task_id=task.pk, limits={"max_steps": 100})  # an operator, elsewhere
    expect(header_badge(page)).to_have_text("queued")
    stack.start_workers(1)
    expect(header_badge(page)).to_have_text("completed", timeout=LIVE)
    expect(page.get_by_test_id("controls")).to_have_count(0)
    expect(page.locator("[data-action]")).to_have_count(0)
    for button in BUTTONS:
        expect(page.get_by_test_id(button)).to_have_count(0)


def test_operator_preempts_a_contracts_batch_from_the_task_page_and_it_continues_after_the_subtask(
        stack, new_page, make_user):
    """The send form's `preempt`: the stack card shows the frame while contract 5 is
    re-parsed; the batch then continues and completes, every contract once."""
    make_user("olga", "operator")
    task = services.task_create(type="demo.contracts", params={"count": 20, "pace_seconds": 1.0},
                                limits={"max_subtasks": 1})
    page = new_page("olga")
    page.goto(f"/tasks/{task.pk}/")
    stack.start_workers(1)
    expect(page.locator('[data-live="steps"]')).to_have_text("8 / 21", timeout=LIVE)
    page.get_by_test_id("tab-inbox").click()  # the send form is the Inbox tab's
    page.get_by_test_id("send-type").select_option("preempt")
    page.locator('form[data-testid="send-event-form"] input[name="payload"]').fill(
        '{"subtask": "reparse", "args": {"contract": 5, "extractor": "strict"}, "reason": "strict re-parse first"}')
    page.get_by_test_id("btn-send-event").click()
    expect(page.get_by_test_id("message")).to_contain_text("(preempt, P0) sent")
    page.get_by_test_id("tab-overview").click()  # the stack card is the Overview's
    frame = page.get_by_test_id("stack-frame")
    expect(frame).to_be_visible(timeout=30_000)
    expect(frame).to_contain_text("reparse: strict re-parse first")
    expect(frame).to_contain_text("Runs now")
    expect(header_badge(page)).to_have_text("completed", timeout=LIVE)
    expect(page.get_by_test_id("task-stack")).to_have_count(0)
    expect(page.locator('[data-live="steps"]')).to_have_text("22 / 22")
    rows = page.get_by_test_id("inbox-table")
    expect(rows.locator('tr[data-state="consumed"]', has_text="pushed frame 1")).to_have_count(1)
    expect(rows.locator('tr', has_text="subtask.done")).to_have_count(1)
    done = in_thread(lambda: list(TaskEvent.objects.filter(task_id=task.pk, kind="step_done")
                                  .values_list("payload__step", flat=True)))
    assert len(done) == 22 and len(set(done)) == 22  # nothing done twice
