"""Watching an agent in a real Chromium: its answer streams into the Conversation panel; the
operator pauses it mid-stream, sends it a message (from the Inbox tab), resumes it, and it
answers with the message in view."""

import pytest
from playwright.sync_api import expect

from orchestrator.engine import services
from orchestrator.llm.standin import StandinServer

pytestmark = [pytest.mark.browser, pytest.mark.workers, pytest.mark.django_db(transaction=True)]

LIVE = 60_000
GOAL = ("Explain in plain words why a durable task harness checkpoints every step, what a write-ahead log intent "
        "is for, and why an idempotency key makes a replay safe")


def test_operator_watches_an_agent_stream_pauses_it_sends_a_message_and_resumes(stack, new_page, make_user):
    make_user("olga", "operator")
    with StandinServer(token_seconds=0.0005) as model:
        # Workers (and the web, which shares their model settings) first, then the page.
        stack.start_workers(1, LLM_BASE_URL=model.base_url, LLM_API_KEY="standin",
                            LLM_MODEL="standin-planner+slow=0.1")
        task = services.task_create(type="agent.plan_execute", params={"goal": GOAL, "tools": []})
        page = new_page("olga")
        page.goto(f"/tasks/{task.pk}/#conversation")  # the Conversation tab
        streaming = page.locator('[data-testid="dialog-message"][data-streaming="true"]')
        expect(streaming).to_be_visible(timeout=LIVE)
        expect(streaming.get_by_test_id("dialog-text")).not_to_be_empty()
        page.get_by_test_id("btn-pause").click()
        expect(page.get_by_test_id("task-header").get_by_test_id("task-status")).to_have_text("paused", timeout=30_000)
        partial = page.locator('[data-testid="dialog-message"][data-role="assistant"]').filter(
            has=page.get_by_test_id("interrupted"))
        expect(partial).to_have_count(1)
        page.get_by_test_id("tab-inbox").click()  # the send form is the Inbox tab's
        expect(page.get_by_test_id("tab-inbox")).to_have_attribute("aria-selected", "true")
        expect(page.get_by_test_id("panel-inbox")).to_be_visible()
        page.get_by_test_id("send-type").select_option("user.message")
        page.get_by_test_id("send-text").fill("Answer in one sentence, please")
        page.get_by_test_id("btn-send-event").click()
        expect(page.get_by_test_id("message")).to_contain_text("(user.message, P1) sent")
        page.get_by_test_id("btn-resume").click()
        # The resume's own answer first: a refusal shows its reason here rather than a 60 s wait.
        expect(page.get_by_test_id("message")).to_contain_text(f"Task #{task.pk} resumed.", timeout=30_000)
        expect(page.get_by_test_id("task-header").get_by_test_id("task-status")).to_have_text("completed",
                                                                                              timeout=LIVE)
        conversation = page.get_by_test_id("conversation")
        expect(conversation.locator('[data-role="user"]', has_text="Answer in one sentence, please")).to_have_count(1)
        expect(conversation.locator('[data-role="assistant"]')).to_have_count(2)  # the partial and the answer
        last = model.requests[-1].body["messages"]
        assert {"role": "user", "content": "Answer in one sentence, please"} in last
