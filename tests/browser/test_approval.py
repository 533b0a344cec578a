"""An approval in a real Chromium against daphne: the reviewer reads the email as To / Subject /
Body, opens Edit (the form generated from the tool's argument model), changes the subject and
approves; what the task is told to run is the edited email. (The worker side of the same edit:
tests/review/test_approval_workers.py.) Skipped without Chromium (conftest.py)."""
import re

import pytest
from playwright.sync_api import expect

from orchestrator.engine import approvals, services
from orchestrator.models import InboundEvent
from review.models import ReviewItem
from review.services import open_for_approval
from tests.browser.conftest import in_thread

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

EMAIL = {"to": ["ops@example.org"], "subject": "Summary of 2 contracts", "body": "Totals:\nEUR 1,200.00"}


def proposed_email() -> ReviewItem:
    task = services.task_create(type="agent.plan_execute", params={"goal": "email ops", "tools": ["email_send"]})
    return open_for_approval(None, task_id=task.pk, step_id="tool-002-1", tool="email_send", arguments=EMAIL,
                             context="I will email the summary to ops now.", call_id="call_1",
                             arguments_sha256=approvals.arguments_digest(EMAIL))


def decision(item_id: int) -> tuple:
    item = ReviewItem.objects.get(pk=item_id)
    event = InboundEvent.objects.get(task_id=item.task_id, type="approval.decided")
    return item.status, item.decision, item.decided_by.username, event.payload["arguments"]


def test_a_reviewer_reads_the_email_edits_its_subject_in_the_generated_form_and_approves(stack, new_page, make_user):
    make_user("rita", "reviewer")
    item = in_thread(proposed_email)
    page = new_page("rita")
    page.goto(f"/review/{item.pk}/")
    expect(page.get_by_test_id("email-to")).to_have_text("ops@example.org")
    expect(page.get_by_test_id("email-subject")).to_have_text("Summary of 2 contracts")
    expect(page.get_by_test_id("email-body")).to_have_text("Totals:\nEUR 1,200.00")
    expect(page.get_by_test_id("review-context")).to_have_text("I will email the summary to ops now.")
    expect(page.get_by_test_id("btn-approve")).to_be_visible()
    expect(page.get_by_test_id("btn-reject")).to_be_visible()
    subject = page.locator('[name="arguments.subject"]')
    expect(subject).to_be_hidden()  # the form opens with Edit
    page.get_by_test_id("btn-edit").click()
    expect(subject).to_have_value("Summary of 2 contracts")
    subject.fill("Contracts: the totals you asked for")
    page.get_by_test_id("btn-edit-approve").click()
    page.wait_for_url(re.compile(r"/review/$"))
    status, decided, by, arguments = in_thread(decision, item.pk)
    assert (status, decided, by) == ("decided", "edit_approve", "rita")
    assert arguments == {**EMAIL, "subject": "Contracts: the totals you asked for"}
