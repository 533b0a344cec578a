"""The task page's sections (issue 24, item 6) in a real Chromium: an agent's page as tabs —
each tab shows its panel and hides the others; the header, the controls and the `waiting_on`
line stay in view on every tab; /tasks/N/#effects opens the effects tab and a reload keeps
the selected one; the arrow keys move between tabs; the waiting_on link opens the approval;
and a live update reaches a region inside a tab that is not selected. Skipped without
Chromium (conftest.py)."""
import re

import pytest
from django.db import transaction
from playwright.sync_api import expect

from orchestrator.engine import approvals, services, states
from orchestrator.engine.events import append_event
from orchestrator.models import AgentMessage, Task, WalEntry
from tests.browser.conftest import in_thread

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

TABS = ("overview", "conversation", "steps", "effects", "inbox", "history")
# A region of each tab's panel, by its element id.
REGION_OF = {"overview": "task-cards", "conversation": "task-conversation", "steps": "task-steps",
             "effects": "task-wal", "inbox": "task-inbox", "history": "task-history"}


def agent_waiting_for_approval() -> tuple[int, int]:
    task = services.task_create(type="agent.plan_execute",
                                params={"goal": "Tell ops the numbers", "tools": ["email_send"]})
    AgentMessage.objects.create(task=task, key="goal:g0", turn=0, order=1, role="user", content="Tell ops the numbers")
    AgentMessage.objects.create(task=task, key="turn-001:g0", turn=1, order=0, role="assistant",
                                content="I will send the email.",
                                tool_calls=[{"id": "c1", "name": "email_send", "arguments": '{"to": "ops@example.org"}',
                                             "step": "tool-001-1"}])
    Task.objects.filter(pk=task.pk).update(
        status="waiting", waiting_for=[{"step": "tool-001-1", "type": "approval.decided", "until": None}])
    approval_id = approvals.request(task_id=task.pk, step_id="tool-001-1", tool="email_send", call_id="c1",
                                    arguments={"to": "ops@example.org", "subject": "numbers"})
    return task.pk, approval_id


def record_effect(task_id: int) -> None:
    """A side effect recorded, as the runner commits it: the WAL row and an event (the event is
    what makes the live page refresh)."""
    with transaction.atomic():
        task = states.lock_task(task_id)
        WalEntry.objects.create(task=task, step_id="tool-001-1", call_index=0, tool="email_send",
                                args={"to": "ops@example.org"}, idempotency_key=f"task-{task_id}-tool-001-1-0",
                                idempotent=False, lease_epoch=1)
        append_event(task, "progress", {"message": "sending the email"})


def expect_selected(page, key: str) -> None:
    expect(page.get_by_test_id(f"tab-{key}")).to_have_attribute("aria-selected", "true")
    for other in TABS:
        panel = page.get_by_test_id(f"panel-{other}")
        if other == key:
            expect(panel).to_be_visible()
            expect(panel.locator(f"#{REGION_OF[other]}")).to_have_count(1)
        else:
            expect(panel).to_be_hidden()
            expect(page.get_by_test_id(f"tab-{other}")).to_have_attribute("aria-selected", "false")
    # Above the tabs, on every tab: the header, the controls, what the task waits on.
    expect(page.get_by_test_id("task-summary")).to_be_visible()
    expect(page.get_by_test_id("controls")).to_be_visible()
    expect(page.get_by_test_id("task-summary").get_by_test_id("waiting-on")).to_be_visible()


def test_an_agents_page_is_tabs_under_a_header_that_stays(stack, new_page, make_user):
    make_user("olga", "operator", "reviewer")
    task_id, approval_id = in_thread(agent_waiting_for_approval)
    page = new_page("olga")
    page.goto(f"/tasks/{task_id}/")
    expect(page.get_by_test_id("live-indicator")).to_have_text("live")
    tablist = page.get_by_role("tablist")
    expect(tablist.get_by_role("tab")).to_have_count(len(TABS))
    expect_selected(page, "overview")

    for key in TABS:
        page.get_by_test_id(f"tab-{key}").click()
        expect_selected(page, key)
        assert page.url.endswith(f"/tasks/{task_id}/#{key}")
    expect(page.get_by_test_id("conversation").get_by_test_id("dialog-message")).to_have_count(2)
    # The effects tab counts the open approval.
    expect(page.get_by_test_id("tab-effects").get_by_test_id("tab-count")).to_have_text("1")

    # The keyboard: arrows move and select (wrapping), Home and End jump.
    page.get_by_test_id("tab-history").focus()
    page.keyboard.press("ArrowRight")
    expect_selected(page, "overview")
    expect(page.get_by_test_id("tab-overview")).to_be_focused()
    page.keyboard.press("ArrowLeft")
    expect_selected(page, "history")
    page.keyboard.press("Home")
    expect_selected(page, "overview")
    page.keyboard.press("End")
    expect_selected(page, "history")

    # A link to a tab opens it; a reload keeps it.
    page.goto(f"/tasks/{task_id}/#effects")
    expect_selected(page, "effects")
    expect(page.get_by_test_id("review-row")).to_have_attribute("data-review-id", str(approval_id))
    page.reload()
    expect_selected(page, "effects")
    expect(page.get_by_test_id("live-indicator")).to_have_text("live")

    # A live update reaches a region in a tab that is not selected.
    page.get_by_test_id("tab-conversation").click()
    expect_selected(page, "conversation")
    expect(page.get_by_test_id("wal-row")).to_have_count(0)
    in_thread(record_effect, task_id)
    expect(page.get_by_test_id("wal-row")).to_have_count(1)
    expect(page.get_by_test_id("panel-effects")).to_be_hidden()
    expect_selected(page, "conversation")  # the swapped tablist keeps the selection
    page.get_by_test_id("tab-effects").click()
    expect(page.locator('[data-testid="wal-row"][data-status="pending"]')).to_be_visible()

    # The waiting_on line links to the approval it waits for.
    line = page.get_by_test_id("task-summary").get_by_test_id("waiting-on")
    expect(line).to_contain_text("waiting for approval of email_send to ops@example.org since ")
    line.get_by_test_id("waiting-on-link").click()
    page.wait_for_url(re.compile(rf"/review/{approval_id}/$"))
    expect(page.get_by_test_id("btn-approve")).to_be_visible()
