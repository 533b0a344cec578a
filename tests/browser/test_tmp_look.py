import re
from playwright.sync_api import expect
import pytest
from orchestrator.engine import services
pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

def test_look(stack, new_page, make_user):
    make_user("olga", "operator")
    t = services.task_create(type="demo.migrate_rows", params={"rows": 1000, "batch_size": 100}, limits={"max_subtasks": 1})
    page = new_page("olga")
    page.goto(f"/tasks/{t.pk}/")
    expect(page.get_by_test_id("live-indicator")).to_have_text("live")
    stack.start_workers(1)
    expect(page.get_by_test_id("task-header").get_by_test_id("task-status")).to_have_text("completed", timeout=60000)
    page.wait_for_timeout(500)
    page.screenshot(path="/tmp/detail-full.png", full_page=True)
    page.goto(f"/tasks/{t.pk}/")
    page.screenshot(path="/tmp/detail-full-reloaded.png", full_page=True)
