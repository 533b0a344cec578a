"""`waiting_on` in a real Chromium: the task list's row and the task page's header say what a
task waits on, and the link opens the approval it waits for (tests/test_waiting_on.py checks
each reason). Skipped without Chromium (conftest.py)."""
import re

import pytest
from playwright.sync_api import expect

from orchestrator.engine import approvals, services
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
