"""`waiting_on` in a real Chromium: the task list's row and the task page's header say what a
task waits on, and the link opens the approval it waits for (tests/test_waiting_on.py checks
each reason). Skipped without Chromium (conftest.py)."""
import re

import pytest
from django.db import transaction
from playwright.sync_api import expect

from orchestrator.engine import approvals, services
from orchestrator.engine.events import append_event
from orchestrator.models import Task
from tests.browser.conftest import in_thread

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def waiting_for_approval() -> tuple[int, int]:
    task = services.task_create(type="demo.notify", params={"recipients": ["ops@example.org"], "subject": "s"})
    Task.objects.filter(pk=task.pk).update(
        status="waiting", waiting_for=[{"step": "tool-006-1", "type": "approval.decided", "until": None}])
    approval_id = approvals.request(task_id=task.pk, step_id="tool-006-1", tool="email_send", call_id="c1",
                                    arguments={"to": "ops@example.org", "subject": "numbers"})
    return task.pk, approval_id


def test_the_list_and_the_task_page_say_what_a_task_waits_on_and_link_to_it(stack, new_page, make_user):
    make_user("rita", "reviewer")
    task_id, approval_id = in_thread(waiting_for_approval)
    page = new_page("rita")
    page.goto("/")
    line = page.locator(f"#task-row-{task_id}").get_by_test_id("waiting-on")
    expect(line).to_contain_text("waiting for approval of email_send to ops@example.org since ")
    expect(line).to_have_attribute("data-kind", "approval")
    page.goto(f"/tasks/{task_id}/")
    header = page.get_by_test_id("task-summary").get_by_test_id("waiting-on")
    expect(header).to_contain_text(f"(approval #{approval_id}, deadline ")
    header.get_by_test_id("waiting-on-link").click()
    page.wait_for_url(re.compile(rf"/review/{approval_id}/$"))
    expect(page.get_by_test_id("btn-approve")).to_be_visible()


def rename(task_id: int, title: str) -> None:
    """A new title and an event (what makes the live page refresh): the header changes."""
    with transaction.atomic():
        task = Task.objects.select_for_update().get(pk=task_id)
        Task.objects.filter(pk=task_id).update(title=title)
        append_event(task, "progress", {"message": "still waiting"})


def test_a_link_pressed_as_its_region_is_swapped_still_opens_and_the_update_follows_the_release(
        stack, new_page, make_user):
    # A live update that replaced the header between the press and the release took the click
    # away from the link (the browser sends it to the common ancestor): the page held still.
    make_user("rita", "reviewer")
    task_id, approval_id = in_thread(waiting_for_approval)
    page = new_page("rita")
    page.goto(f"/tasks/{task_id}/")
    expect(page.get_by_test_id("live-indicator")).to_have_text("live")
    summary = page.get_by_test_id("task-summary")

    # A press on the header's text: the update waits for the release, then shows.
    summary.locator("h1").hover()
    page.mouse.down()
    in_thread(rename, task_id, "first rename")
    page.wait_for_selector("html[data-live-held]", state="attached")
    expect(summary.locator("h1")).not_to_contain_text("first rename")  # held while the button is down
    page.mouse.up()
    expect(summary.locator("h1")).to_contain_text("first rename")
    page.wait_for_selector("html[data-live-held]", state="detached")

    # A press on the link as the header is replaced: the release opens the approval.
    link = summary.get_by_test_id("waiting-on").get_by_test_id("waiting-on-link")
    link.hover()
    page.mouse.down()
    in_thread(rename, task_id, "second rename")
    page.wait_for_selector("html[data-live-held]", state="attached")
    page.mouse.up()
    page.wait_for_url(re.compile(rf"/review/{approval_id}/$"))
