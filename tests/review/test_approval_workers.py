"""Approvals end to end on real worker processes (django-q2 clusters), the stand-in model over
HTTP and a real SMTP server: an edit made in the page's generated form is what goes out, and
an approval nobody decides expires at its real deadline through the real sweeper
(`manage.py recover --loop`), with no test code moving the clock."""
import re
import time
from html import unescape

import pytest

from orchestrator.engine import approvals, services
from orchestrator.models import AgentMessage, AuditEntry, Task, WalEntry
from review.models import ReviewItem
from tests.conftest import wait_for

from .conftest import logged_in

pytestmark = [pytest.mark.workers, pytest.mark.django_db(transaction=True)]

GOAL = "Parse the 2 contracts and email a summary to ops@example.org"
TOOLS = ["contracts_list", "contracts_read", "email_send"]


def worker_env(model, smtp_server) -> dict:
    return {"LLM_BASE_URL": model.base_url, "LLM_API_KEY": "standin", "LLM_MODEL": "standin-planner",
            "EMAIL_HOST": "127.0.0.1", "EMAIL_PORT": smtp_server.port, "ORCH_AGENT_EMAIL_ALLOW": "*@example.org"}


def agent_mail(smtp_server) -> list:
    """What the agent sent (the reviewers' notification emails go through the same server)."""
    return [m for m in smtp_server.messages if m["To"] == "ops@example.org"]


def open_approval(task: Task) -> ReviewItem:
    wait_for(lambda: ReviewItem.objects.filter(task=task, kind="approval", status="open").exists(), timeout=90,
             message="the email's approval to open")
    wait_for(lambda: Task.objects.get(pk=task.pk).status == "waiting", timeout=30, message="the task to wait")
    return ReviewItem.objects.get(task=task, kind="approval", status="open")


def form_values(page: str, form_testid: str) -> dict:
    """What the browser would post from one form of the page: its inputs, textareas and selects."""
    form = page.split(f'data-testid="{form_testid}"', 1)[1].split("</form>", 1)[0]
    values = {}
    for name, value in re.findall(r'<input type="(?:hidden|text|number)"[^>]*?name="([^"]+)" value="([^"]*)"', form):
        values[name] = unescape(value)
    for name, value in re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)"', form):
        values[name] = unescape(value)
    for name, value in re.findall(r'<textarea[^>]*?name="([^"]+)"[^>]*>(.*?)</textarea>', form, re.S):
        values[name] = unescape(value)
    return values


def test_an_edit_made_in_the_generated_form_is_what_the_worker_sends(standin_server, smtp_server, start_workers,
                                                                     reviewer):
    start_workers(1, **worker_env(standin_server, smtp_server))
    task = services.task_create(type="agent.plan_execute", params={"goal": GOAL, "tools": TOOLS})
    item = open_approval(task)
    proposed = item.proposal["arguments"]
    assert proposed["subject"] == "Summary of 2 contracts" and agent_mail(smtp_server) == []
    client = logged_in(reviewer)
    page = client.get(f"/review/{item.pk}/").content.decode()
    assert 'data-testid="email-subject"><strong>Summary of 2 contracts<' in page
    posted = form_values(page, "edit-form")
    # The form as generated, prefilled with what the model proposed; the reviewer changes the subject.
    assert posted["decision"] == "edit_approve" and posted["arguments.to"] == "ops@example.org"
    assert posted["arguments.subject"] == "Summary of 2 contracts" and posted["arguments.body"] == proposed["body"]
    assert posted["arguments_sha256"] == approvals.arguments_digest(proposed)
    posted.update({"arguments.subject": "Contracts: the totals you asked for", "note": "a clearer subject"})
    response = client.post(f"/review/{item.pk}/", posted)
    assert response.status_code == 302, response.content.decode()[:3000]
    wait_for(lambda: Task.objects.get(pk=task.pk).status == "completed", timeout=90, message="the task to complete")
    [mail] = agent_mail(smtp_server)
    assert mail["Subject"] == "Contracts: the totals you asked for"
    edited = {**proposed, "subject": "Contracts: the totals you asked for"}
    entry = WalEntry.objects.get(task=task, tool="email.send")
    assert entry.status == "done" and entry.args["subject"] == edited["subject"]
    item.refresh_from_db()
    assert (item.status, item.decision, item.decided_by.username) == ("decided", "edit_approve", "rita")
    assert item.decision_result == edited
    audit = AuditEntry.objects.get(task=task, action="review.approval")
    assert audit.after["arguments_sha256"] == approvals.arguments_digest(edited)


def test_an_approval_nobody_decides_expires_at_its_deadline_through_the_sweeper_and_the_agent_goes_on(
        standin_server, smtp_server, start_workers, start_sweeper):
    start_workers(1, **worker_env(standin_server, smtp_server))
    start_sweeper(interval=0.3)
    task = services.task_create(type="agent.plan_execute", params={"goal": GOAL, "tools": TOOLS,
                                                                   "approval_timeout_seconds": 3})
    item = open_approval(task)
    asked = time.monotonic()
    wait_for(lambda: Task.objects.get(pk=task.pk).status == "completed", timeout=90, message="the task to complete")
    item.refresh_from_db()
    # Not before its deadline (measured from when the item was opened, a moment before `asked`).
    assert time.monotonic() - asked > 3 - 1
    assert item.status == "expired" and item.decided_by is None and item.expired_at >= item.expires_at
    assert agent_mail(smtp_server) == []
    answer = AgentMessage.objects.get(task=task, role="tool", name="email_send").content
    assert answer.startswith("not executed: the approval expired: nobody decided within 3 s")
    # The model read it and answered (the stand-in reports the email could not be sent).
    final = AgentMessage.objects.filter(task=task, role="assistant", interrupted=False).order_by("-turn").first()
    assert "could not be sent" in final.content
    assert AuditEntry.objects.filter(task=task, action="review.approval_expired").count() == 1
