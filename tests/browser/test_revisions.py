"""Edit params & resume in a real Chromium against daphne + real workers: an operator fixes
the rate of a paused migration, reviews the impact preview, confirms, and watches the task
finish live with the new rate.

The paused task is made before the browser starts (drive_inline, in a helper thread);
once the browser runs, database calls go through `in_thread` (see test_dashboard.py).
"""
import re
from decimal import Decimal

import pytest
from playwright.sync_api import expect

from orchestrator.engine import services
from orchestrator.engine.worker import drive_inline
from orchestrator.models import AuditEntry, Task
from demo.models import DemoDestination, DemoSource
from tests.browser.conftest import in_thread

pytestmark = [pytest.mark.browser, pytest.mark.workers, pytest.mark.django_db(transaction=True)]

LIVE = 60_000  # ms: worker start-up plus the run
MARK = "window.__noReload = 'still the same page'"


def paused_migration() -> Task:
    """5 batches of 100 rows at rate 1.0, paused by max_steps=3 (prepare + 2 batches done)."""
    task = services.task_create(type="demo.migrate_rows", params={"rows": 500, "batch_size": 100, "rate": 1.0},
                                limits={"max_steps": 3, "max_subtasks": 1})
    drive_inline(task.pk)
    return Task.objects.get(pk=task.pk)


def sums(rows: int) -> tuple[Decimal, Decimal]:
    source = sum(DemoSource.objects.filter(id__lte=rows).values_list("amount", flat=True), Decimal(0))
    destination = sum(DemoDestination.objects.filter(id__lte=rows).values_list("amount", flat=True), Decimal(0))
    return source, destination


def step_ids(page, name: str) -> list[str]:
    return page.get_by_test_id(f"steps-{name}").get_by_test_id("step-id").all_text_contents()


def test_operator_edits_the_rate_of_a_paused_task_and_it_finishes_live(stack, new_page, make_user):
    make_user("olga", "operator")
    task = in_thread(paused_migration)
    assert task.status == "paused" and task.steps_done == 3
    source, destination = in_thread(sums, 200)
    assert destination == source  # the two finished batches copied at rate 1.0

    page = new_page("olga")
    page.goto(f"/tasks/{task.pk}/")
    header = page.get_by_test_id("task-header")
    expect(header.get_by_test_id("task-status")).to_have_text("paused")
    expect(page.get_by_test_id("live-indicator")).to_have_text("live")
    expect(page.get_by_test_id("btn-rollback")).not_to_have_count(0)

    page.get_by_test_id("btn-edit").click()
    page.wait_for_url(re.compile(rf"/tasks/{task.pk}/edit/$"))
    expect(page.locator('[name="params.rate"]')).to_have_value("1.0")
    expect(page.locator('[name="params.rows"]')).to_have_value("500")
    expect(page.get_by_test_id("limit-note")).to_contain_text("max_steps")
    page.fill('[name="params.rate"]', "2")
    page.fill('[name="limits.max_steps"]', "1000")  # the limit that paused it: else it pauses again
    page.get_by_test_id("btn-preview").click()

    preview = page.get_by_test_id("edit-preview")
    expect(preview).to_be_visible()
    rate = page.locator('[data-testid="diff-row"][data-key="rate"]')
    expect(rate.locator(".diff-old")).to_have_text("1.0")
    expect(rate.locator(".diff-new")).to_have_text("2.0")
    assert step_ids(page, "kept") == ["prepare-source"]
    assert step_ids(page, "rerun") == ["batch-0001", "batch-0002"]
    assert step_ids(page, "pending") == ["batch-0001", "batch-0002", "batch-0003", "batch-0004", "batch-0005"]
    expect(page.get_by_test_id("repeated-effects").get_by_test_id("effect-row")).to_have_count(2)
    expect(page.get_by_test_id("limit-warning")).to_have_count(0)
    assert in_thread(lambda: Task.objects.get(pk=task.pk).params["rate"]) == 1.0  # the preview changed nothing

    page.get_by_test_id("btn-confirm").click()
    page.wait_for_url(re.compile(rf"/tasks/{task.pk}/$"))
    expect(page.get_by_test_id("message")).to_contain_text("parameters edited (rate)")
    expect(header.get_by_test_id("task-status")).to_have_text("queued")
    expect(page.get_by_test_id("params")).to_contain_text('"rate": 2.0')
    expect(page.get_by_test_id("btn-edit")).to_be_hidden()  # only for a paused task
    expect(page.get_by_test_id("btn-rollback")).to_have_count(0)
    expect(page.get_by_test_id("live-indicator")).to_have_text("live")
    page.evaluate(MARK)

    stack.start_workers(1)

    expect(header.get_by_test_id("task-status")).to_have_text("completed", timeout=LIVE)
    expect(page.locator('[data-testid="step-row"][data-status="done"]')).to_have_count(6)
    expect(header.locator(".progress-label")).to_have_text("6/6 · 100%")
    assert page.evaluate("window.__noReload") == "still the same page", "the page was reloaded"

    source, destination = in_thread(sums, 500)
    assert in_thread(DemoDestination.objects.count) == 500
    assert destination == 2 * source
    assert in_thread(lambda: AuditEntry.objects.filter(task_id=task.pk, action="task.edit_params",
                                                       actor_name="olga").exists())
