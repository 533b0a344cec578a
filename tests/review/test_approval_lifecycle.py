"""An approval's life beyond the first decision (issue 21, item 3): its deadline and fallback
(reject: *expired*, its own state, which the model reads; keep_waiting; escalate to a group),
revocation when the task is stopped, terminated or rolled back past it, and forged or late
edits that never run. The agent runs in this process (drive_inline: the real runner) against
the stand-in model over HTTP and a real SMTP server; the sweep is the real one."""
import pytest
from django.contrib.auth.models import Group
from django.utils import timezone

from orchestrator.engine import recovery, revisions, services
from orchestrator.engine.worker import drive_inline
from orchestrator.models import AgentMessage, AuditEntry, InboundEvent, Snapshot, Task, WalEntry
from review.models import ReviewItem
from review.services import DecisionRefused, ReviewClosed, review_decide

from .conftest import logged_in
from tests.support.helpers import standin_for_this_process

pytestmark = pytest.mark.django_db(transaction=True)

GOAL = "Parse the 2 contracts and email a summary to ops@example.org"
TOOLS = ["contracts_list", "contracts_read", "email_send"]
WAITING_TOOL = "email_send"  # the tool whose call waits for its approval


@pytest.fixture
def model(settings):
    with standin_for_this_process(settings, ORCH_AGENT_EMAIL_ALLOW=["*@example.org"]) as server:
        yield server


def waiting_agent(**params) -> tuple[Task, ReviewItem]:
    """An agent whose email waits for its approval (email_send is not idempotent: nothing waived)."""
    task = services.task_create(type="agent.plan_execute", params={"goal": GOAL, "tools": TOOLS, **params})
    assert drive_inline(task.pk) == "waiting"
    [item] = ReviewItem.objects.filter(task=task, kind="approval")
    return task, item


def past_deadline(item: ReviewItem) -> None:
    """The deadline passes (the worker test waits for a real one: test_approval_workers.py)."""
    ReviewItem.objects.filter(pk=item.pk).update(expires_at=timezone.now() - timezone.timedelta(seconds=1))


def email_answer(task: Task) -> str:
    return AgentMessage.objects.get(task=task, role="tool", name="email_send").content


# --- the deadline ------------------------------------------------------------------------------

def expiry_emails(mailoutbox, task) -> list:
    return [(m.to, m.body) for m in mailoutbox
            if m.subject == f"[orchestrator] approval expired: {WAITING_TOOL} in task #{task.pk}"]


def test_an_approval_nobody_decides_expires_at_the_sweep_and_the_model_reads_that_it_expired(
        model, smtp, reviewer, mailoutbox):
    task, item = waiting_agent(approval_timeout_seconds=45)
    assert (item.expires_at - item.detected_at).total_seconds() == pytest.approx(45, abs=1)
    assert recovery.sweep() == [] and ReviewItem.objects.get(pk=item.pk).status == "open"  # not yet
    past_deadline(item)
    recovery.sweep()
    item.refresh_from_db()
    # Its own state: not a rejection, nobody decided it.
    assert (item.status, item.decision, item.decided_by) == ("expired", "", None)
    assert item.expired_at is not None and "nobody decided within 45 s" in item.note
    # The reviewers are told, each with the item's link and what the expiry did.
    [(to, body)] = expiry_emails(mailoutbox, task)
    assert to == [reviewer.email] and f"/review/{item.pk}/" in body and "the call did not run" in body
    assert Task.objects.get(pk=task.pk).status == "queued"  # the expiry woke the waiting step
    [event] = InboundEvent.objects.filter(task=task, type="approval.decided")
    assert event.payload["expired"] is True and event.payload["approved"] is False
    assert drive_inline(task.pk) == "completed"
    assert smtp.received == []
    assert email_answer(task).startswith("not executed: the approval expired: nobody decided within 45 s")
    audit = AuditEntry.objects.get(task=task, action="review.approval_expired")
    assert audit.actor_name == "system" and audit.after["fallback"] == "reject"
    # Deciding it afterwards changes nothing, and says why.
    with pytest.raises(ReviewClosed, match=r"expired at .*the call did not run"):
        review_decide(item_id=item.pk, decision="approve", note="", actor=reviewer)
    response = logged_in(reviewer).post(f"/review/{item.pk}/", {"decision": "approve"})
    assert response.status_code == 409 and "expired at" in response.content.decode()
    assert InboundEvent.objects.filter(task=task, type="approval.decided").count() == 1


def test_the_tools_own_deadline_wins_over_the_tasks_and_the_installations(model, smtp, settings):
    _, item = waiting_agent()  # nothing set anywhere: the installation's default, a day
    assert (item.expires_at - item.detected_at).total_seconds() == pytest.approx(86400, abs=1)
    settings.ORCH_APPROVAL_TIMEOUT_SECONDS = 7200
    _, item = waiting_agent()
    assert (item.expires_at - item.detected_at).total_seconds() == pytest.approx(7200, abs=1)
    assert item.on_expiry == "reject" and item.approvals_required == 1
    _, item = waiting_agent(approval_timeout_seconds=600,
                            approval_rules={"email_send": {"timeout_seconds": 30, "on_expiry": "keep_waiting"}})
    assert (item.expires_at - item.detected_at).total_seconds() == pytest.approx(30, abs=1)
    assert item.on_expiry == "keep_waiting"


def test_keep_waiting_marks_it_overdue_and_a_reviewer_still_decides_it(model, smtp, reviewer, mailoutbox):
    task, item = waiting_agent(approval_rules={"email_send": {"on_expiry": "keep_waiting"}})
    past_deadline(item)
    recovery.sweep()
    item.refresh_from_db()
    [(to, body)] = expiry_emails(mailoutbox, task)
    assert to == [reviewer.email] and "it is still waiting for a reviewer" in body
    assert item.status == "open" and item.expired_at is not None and item.expires_at is None
    assert Task.objects.get(pk=task.pk).status == "waiting"
    assert not InboundEvent.objects.filter(task=task, type="approval.decided").exists()
    assert AuditEntry.objects.get(task=task, action="review.approval_expired").after["fallback"] == "keep_waiting"
    recovery.sweep()  # handled once
    assert AuditEntry.objects.filter(task=task, action="review.approval_expired").count() == 1
    assert len(expiry_emails(mailoutbox, task)) == 1
    client = logged_in(reviewer)
    assert 'data-testid="review-overdue"' in client.get(f"/review/{item.pk}/").content.decode()
    assert client.post(f"/review/{item.pk}/", {"decision": "approve"}).status_code == 302
    assert drive_inline(task.pk) == "completed"
    assert [m["To"] for m in smtp.received] == ["ops@example.org"]


def test_escalate_hands_it_to_the_groups_reviewers_for_one_more_timeout_then_it_expires(
        model, smtp, reviewer, make_user):
    managers = Group.objects.create(name="managers")
    mona = make_user("mona", "reviewer")
    mona.groups.add(managers)
    operator_in_group = make_user("oleg", "operator")
    operator_in_group.groups.add(managers)
    task, item = waiting_agent(approval_rules={"email_send": {"timeout_seconds": 120, "on_expiry": "escalate",
                                                              "escalate_to": "managers"}})
    past_deadline(item)
    recovery.sweep()
    item.refresh_from_db()
    assert item.status == "open" and item.escalated_at is not None and item.escalate_to == "managers"
    assert (item.expires_at - item.escalated_at).total_seconds() == pytest.approx(120, abs=2)
    assert AuditEntry.objects.filter(task=task, action="review.approval_escalated").exists()
    # Reviewers outside the group may no longer decide it; a member without the reviewer role never may.
    response = logged_in(reviewer).post(f"/review/{item.pk}/", {"decision": "approve"})
    assert response.status_code == 403 and "escalated to the group" in response.content.decode()
    assert logged_in(operator_in_group).post(f"/review/{item.pk}/", {"decision": "approve"}).status_code == 403
    page = logged_in(mona).get(f"/review/{item.pk}/").content.decode()
    assert 'data-testid="review-escalated"' in page and 'data-testid="btn-approve"' in page
    # Nobody in the group decides either: then it expires.
    past_deadline(item)
    recovery.sweep()
    item.refresh_from_db()
    assert item.status == "expired" and "escalated to managers" in item.note
    assert drive_inline(task.pk) == "completed"
    assert smtp.received == [] and email_answer(task).startswith("not executed: the approval expired")


def test_an_escalated_item_is_decided_by_a_reviewer_of_the_group(model, smtp, make_user):
    managers = Group.objects.create(name="managers")
    mona = make_user("mona", "reviewer")
    mona.groups.add(managers)
    task, item = waiting_agent(approval_rules={"email_send": {"on_expiry": "escalate", "escalate_to": "managers"}})
    past_deadline(item)
    recovery.sweep()
    review_decide(item_id=item.pk, decision="approve", note="ok", actor=mona)
    assert drive_inline(task.pk) == "completed"
    assert [m["To"] for m in smtp.received] == ["ops@example.org"]


# --- revocation --------------------------------------------------------------------------------

@pytest.mark.parametrize("control", ["stop", "terminate"])
def test_stopping_or_terminating_the_task_revokes_its_open_approval(model, smtp, reviewer, operator, control):
    task, item = waiting_agent()
    getattr(services, f"task_{control}")(task_id=task.pk, actor=operator, reason="not needed any more")
    item.refresh_from_db()
    ended = {"stop": "stopped", "terminate": "terminated"}[control]
    assert item.status == "revoked" and item.note.startswith(f"the task {ended}")
    assert item.decided_by == operator
    audit = AuditEntry.objects.get(task=task, action="review.approval_revoked")
    assert audit.actor_name == "otto" and audit.after["review"] == item.pk
    with pytest.raises(ReviewClosed, match=f"revoked at .*the task {ended}"):
        review_decide(item_id=item.pk, decision="approve", note="", actor=reviewer)
    page = logged_in(reviewer).get(f"/review/{item.pk}/").content.decode()
    assert 'data-testid="review-closed"' in page and "was revoked" in page and 'data-testid="btn-approve"' not in page
    assert not InboundEvent.objects.filter(task=task, type="approval.decided").exists()
    assert smtp.received == []


def test_a_rollback_past_the_call_revokes_its_approval_and_the_call_asks_again(model, smtp, reviewer, operator):
    task, item = waiting_agent()
    services.task_pause(task_id=task.pk, actor=operator)
    task.refresh_from_db()
    assert task.status == "paused"
    # The version before the turn that proposed the email: that turn runs again.
    version = Snapshot.objects.filter(task=task, step_id="turn-003").values_list("version", flat=True).get() - 1
    revisions.apply_rollback(task_id=task.pk, version=version, expected_version=None, actor=operator)
    item.refresh_from_db()
    assert item.status == "revoked" and "rollback" in item.note
    with pytest.raises(ReviewClosed, match="revoked"):
        review_decide(item_id=item.pk, decision="approve", note="", actor=reviewer)
    assert drive_inline(task.pk) == "waiting"
    [again] = ReviewItem.objects.filter(task=task, kind="approval", status="open")
    assert again.pk != item.pk and again.proposal["generation"] > item.proposal.get("generation", 0)
    review_decide(item_id=again.pk, decision="approve", note="", actor=reviewer)
    assert drive_inline(task.pk) == "completed"
    assert [m["To"] for m in smtp.received] == ["ops@example.org"]


def test_skipping_the_step_that_asked_revokes_its_approval(model, smtp, reviewer, operator):
    from django.db import transaction

    from orchestrator.engine import states

    task, item = waiting_agent()
    # The task needs a human while the approval is open (the state is set here; a step of its
    # own failing is what brings it there in production), and the operator skips the step that asked.
    with transaction.atomic():
        states.transition(states.lock_task(task.pk), "queued", reason="test: woken")
    with transaction.atomic():
        states.transition(states.lock_task(task.pk), "needs_human", reason="test: a step failed")
    skipped = services.task_skip_step(task_id=task.pk, step_id=item.step_id, reason="we send it by hand",
                                      actor=operator)
    item.refresh_from_db()
    assert item.step_id in skipped
    assert item.status == "revoked" and item.note == f"step {item.step_id} was skipped by an operator: we send it by hand"
    audit = AuditEntry.objects.get(task=task, action="review.approval_revoked")
    assert audit.actor_name == "otto" and audit.after == {"review": item.pk, "tool": "email_send", "step": item.step_id}
    with pytest.raises(ReviewClosed, match="revoked"):
        review_decide(item_id=item.pk, decision="approve", note="", actor=reviewer)
    assert not InboundEvent.objects.filter(task=task, type="approval.decided").exists()
    assert smtp.received == []


def test_pausing_keeps_the_approval_open(model, smtp, reviewer, operator):
    task, item = waiting_agent()
    services.task_pause(task_id=task.pk, actor=operator)
    item.refresh_from_db()
    assert item.status == "open"
    review_decide(item_id=item.pk, decision="approve", note="", actor=reviewer)
    services.task_resume(task_id=task.pk, actor=operator)
    assert drive_inline(task.pk) == "completed"
    assert len(smtp.received) == 1


# --- forged and late edits ----------------------------------------------------------------------

def test_arguments_changed_after_the_approval_do_not_run(model, smtp, reviewer, settings):
    settings.ORCH_STEP_MAX_ATTEMPTS = 1
    task, item = waiting_agent()
    review_decide(item_id=item.pk, decision="approve", note="", actor=reviewer)
    # Someone rewrites the decision's arguments after the reviewer approved (here, in the
    # database itself): their digest is not the one approved, so the call never runs with them.
    event = InboundEvent.objects.get(task=task, type="approval.decided")
    event.payload = {**event.payload, "arguments": {**item.proposal["arguments"], "to": ["thief@evil.example"]}}
    event.save(update_fields=["payload"])
    drive_inline(task.pk)
    assert smtp.received == []
    assert not WalEntry.objects.filter(task=task, tool="email.send").exists()
    task.refresh_from_db()
    assert task.status != "completed"
    step = task.steps.get(step_id=item.step_id)
    assert "differ from those the reviewer approved" in step.error


def test_an_edit_after_the_approval_is_refused_and_what_runs_is_what_was_approved(model, smtp, reviewer, make_user):
    task, item = waiting_agent()
    review_decide(item_id=item.pk, decision="approve", note="", actor=reviewer)
    late = {**item.proposal["arguments"], "to": ["thief@evil.example"]}
    with pytest.raises(ReviewClosed, match="already decided"):
        review_decide(item_id=item.pk, decision="edit_approve", note="", result=late,
                      actor=make_user("sam", "reviewer"))
    assert drive_inline(task.pk) == "completed"
    assert [m["To"] for m in smtp.received] == ["ops@example.org"]


def test_under_two_person_approval_one_reviewers_edit_does_not_run_alone(model, smtp, reviewer, make_user):
    task, item = waiting_agent(two_person_approval=["email_send"])
    assert item.approvals_required == 2
    sam = make_user("sam", "reviewer")
    review_decide(item_id=item.pk, decision="approve", note="", actor=reviewer)  # the proposal, by rita
    edited = {**item.proposal["arguments"], "to": ["finance@example.org"], "subject": "Edited by sam"}
    review_decide(item_id=item.pk, decision="edit_approve", note="", result=edited, actor=sam)
    # Rita approved the proposal, Sam the edit: nobody has approved the same arguments twice.
    assert ReviewItem.objects.get(pk=item.pk).status == "open"
    assert Task.objects.get(pk=task.pk).status == "waiting" and smtp.received == []
    with pytest.raises(DecisionRefused, match="another reviewer"):
        review_decide(item_id=item.pk, decision="approve", note="", actor=sam)
    review_decide(item_id=item.pk, decision="approve", note="", actor=reviewer)
    assert drive_inline(task.pk) == "completed"
    [mail] = smtp.received
    assert (mail["To"], mail["Subject"]) == ("finance@example.org", "Edited by sam")
    entry = WalEntry.objects.get(task=task, tool="email.send")
    assert entry.args["subject"] == "Edited by sam"
