"""The Content-Security-Policy in a real Chromium: the dashboard's scripts, styles and
websockets and the API docs (Swagger UI from local static files) work under it, and the
browser reports no violation."""
import re

import pytest
from playwright.sync_api import expect

from orchestrator.engine import services

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

COLLECT_VIOLATIONS = """() => {
  window.__cspViolations = [];
  document.addEventListener("securitypolicyviolation", (e) => window.__cspViolations.push(
    e.violatedDirective + " " + e.blockedURI));
}"""


def watch(page) -> list[str]:
    """Console errors about the policy, on every page this `page` loads."""
    messages = []
    page.on("console", lambda m: messages.append(m.text) if "Content Security Policy" in m.text else None)
    page.add_init_script(f"({COLLECT_VIOLATIONS})()")
    return messages


def test_the_dashboard_and_the_api_docs_work_under_the_policy(stack, new_page, make_user):
    make_user("olga", "operator")
    task = services.task_create(type="demo.pipeline", params={"stages": 2})
    page = new_page("olga")
    console = watch(page)

    page.goto("/")
    expect(page.get_by_test_id("live-indicator")).to_have_text("live")  # the websocket connected
    assert page.evaluate("getComputedStyle(document.querySelector('.live-indicator')).borderRadius") == "10px"
    assert "default-src 'self'" in page.evaluate("""async () => (await fetch("/")).headers.get(
        "content-security-policy")""")

    page.goto(f"/tasks/{task.pk}/")
    expect(page.get_by_test_id("live-indicator")).to_have_text("live")
    bar = page.get_by_test_id("task-header").locator(".progress-bar")
    assert bar.get_attribute("data-percent") == "0"  # its width comes from app.css, not an inline style

    page.goto("/tasks/new/")
    page.get_by_test_id("type-select").select_option("demo.pipeline")  # submits through forms.js
    page.wait_for_url(re.compile(r"type=demo\.pipeline"))

    page.goto(f"/tasks/{task.pk}/")
    page.fill('[data-testid="terminate-reason"]', "checking the confirm dialog")
    dialogs = []
    page.once("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    page.get_by_test_id("btn-terminate").click()
    expect(page.get_by_test_id("task-summary")).to_have_attribute("data-status", "queued")
    assert dialogs and dialogs[0].startswith(f"Force-terminate task #{task.pk}?")

    page.goto("/api/docs")
    expect(page.locator(".opblock").first).to_be_visible(timeout=15_000)
    assert page.locator(".opblock").count() >= 10

    assert page.evaluate("window.__cspViolations") == []
    assert console == []
