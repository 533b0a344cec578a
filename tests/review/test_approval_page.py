"""Approvals a reviewer can act on (issue 21, item 3): the page shows the proposed call as a
person reads it, with the model's words that led to it; Approve / Edit / Reject are buttons;
Edit is a form generated from the tool's argument model and validated by it; a decision is
taken once ("already decided by X at T"); two-person approval; who may decide; every decision
audited. Django's test client against the real pages and services (the worker side is in
test_approval_workers.py)."""
import json

import pytest
from django.contrib.auth.models import Group
from django.utils.html import escape

from orchestrator.engine import approvals, services
from orchestrator.models import AgentMessage, AuditEntry, InboundEvent
from review import presenters
from review.models import ApprovalVote, ReviewItem
from review.services import open_for_approval, review_decide

from .conftest import logged_in

pytestmark = pytest.mark.django_db

EMAIL = {"to": ["ops@example.org"], "subject": "Weekly totals", "body": "Totals:\nEUR 1,200.00\nUSD 90.00"}


def agent_task(**params):
    return services.task_create(type="agent.plan_execute",
                                params={"goal": "email the totals", "tools": ["email_send", "http_request"], **params})


def approval(task=None, *, tool="email_send", arguments=None, policy=None, step_id="tool-002-1", call_id="call_7",
             context="(the step's copy of the turn's text)") -> ReviewItem:
    task = task or agent_task()
    return open_for_approval(None, task_id=task.pk, step_id=step_id, tool=tool,
                             arguments=EMAIL if arguments is None else arguments, context=context, call_id=call_id,
                             arguments_sha256=approvals.arguments_digest(EMAIL if arguments is None else arguments),
                             policy=(policy or approvals.Policy()).resolved())


def url(item) -> str:
    return f"/review/{item.pk}/"


def decided_events(item) -> list[InboundEvent]:
    return list(InboundEvent.objects.filter(task_id=item.task_id, type="approval.decided",
                                            payload__approval_id=str(item.pk)))


# --- how the call reads ----------------------------------------------------------------------

def test_an_email_reads_as_to_subject_and_body_with_the_models_reasoning_and_three_buttons(reviewer):
    task = agent_task()
    AgentMessage.objects.create(task=task, key="turn-002:g0", turn=2, order=0, role="assistant",
                                content="The totals are ready; I will email them to ops now.",
                                reasoning="The goal says ops wants the totals weekly.",
                                tool_calls=[{"id": "call_7", "name": "email_send"},
                                            {"id": "call_8", "name": "memory_write"}])
    item = approval(task)
    response = logged_in(reviewer).get(url(item))
    assert response.status_code == 200
    page = response.content.decode()
    assert 'data-kind="email"' in page
    assert 'data-testid="email-to">ops@example.org<' in page
    assert 'data-testid="email-subject"><strong>Weekly totals<' in page
    # The body as text, its line breaks kept: no JSON string with \n escapes outside the raw view.
    assert 'data-testid="email-body">Totals:\nEUR 1,200.00\nUSD 90.00</div>' in page
    readable = page.split('class="raw-arguments"')[0]
    assert "\\n" not in readable and "&quot;to&quot;" not in readable
    # The model's words in the turn that made the call, its reasoning, and what else it called.
    assert "The totals are ready; I will email them to ops now." in page
    assert "The goal says ops wants the totals weekly." in page
    assert 'data-testid="review-other-calls"' in page and "memory_write" in page
    # Approve / Reject as buttons, Edit as a form; the question is no longer about a side effect.
    for testid in ("btn-approve", "btn-reject", "btn-edit", "btn-edit-approve"):
        assert f'data-testid="{testid}"' in page, testid
    assert "What happened to this side effect?" not in page
    assert f'name="arguments_sha256" value="{approvals.arguments_digest(EMAIL)}"' in page
    assert 'data-testid="review-deadline"' in page


def test_an_http_request_reads_as_method_url_and_pretty_json_body(reviewer):
    arguments = {"method": "POST", "url": "https://api.example.org/v1/orders",
                 "json_body": {"order": 42, "lines": [{"sku": "A-1", "qty": 2}]}}
    item = approval(tool="http_request", arguments=arguments)
    page = logged_in(reviewer).get(url(item)).content.decode()
    assert 'data-kind="http"' in page
    assert 'data-testid="http-method">POST<' in page
    assert 'data-testid="http-url">https://api.example.org/v1/orders<' in page
    body = json.dumps(arguments["json_body"], indent=2, sort_keys=True)
    assert f'data-testid="http-body">{escape(body)}</pre>' in page
    # The edit form is generated from http_request's argument model: a select for the method.
    assert '<select id="id_arguments.method" name="arguments.method">' in page
    assert 'name="arguments.url"' in page and 'name="arguments.json_body"' in page


def test_a_command_an_mcp_call_and_any_other_tool_read_as_argv_server_and_tool_and_a_definition_list(reviewer):
    shell = presenters.present_call("shell_run", {"argv": ["grep", "-c", "two words", "/data/x.csv"], "timeout": 30})
    assert (shell.kind, shell.argv, shell.command_line) == ("shell", ["grep", "-c", "two words", "/data/x.csv"],
                                                           "grep -c 'two words' /data/x.csv")
    assert [(a.name, a.text) for a in shell.arguments] == [("timeout", "30")]
    mcp = presenters.present_call("git__git_commit", {"repo_path": "/srv/repo", "message": "Fix the totals"})
    assert (mcp.kind, mcp.server, mcp.mcp_tool) == ("mcp", "git", "git_commit")
    assert [(a.name, a.text) for a in mcp.arguments] == [("repo_path", "/srv/repo"), ("message", "Fix the totals")]
    other = presenters.present_call("db_upsert", {"table": "demo_destination", "columns": ["id"], "rows": [[1]]})
    assert other.kind == "arguments" and other.arguments[0].text == "demo_destination"
    assert other.arguments[1].structured and json.loads(other.arguments[1].text) == ["id"]
    # The harness's own names (an effect in doubt) and an extension's mail tool, by its arguments' shape.
    assert presenters.present_call("email.send", EMAIL).kind == "email"
    assert presenters.present_call("crm_mail", {"to": "a@example.org, b@example.org", "subject": "s",
                                                "body": "b"}).to == ["a@example.org", "b@example.org"]
    # An MCP tool the toolbox does not know: the page shows it, and its edit is a JSON object.
    item = approval(tool="git__git_commit", arguments={"repo_path": "/srv/repo", "message": "Fix the totals"})
    page = logged_in(reviewer).get(url(item)).content.decode()
    assert 'data-testid="mcp-server">git<' in page and 'data-testid="mcp-tool">git_commit<' in page
    assert 'data-argument="message"><span class="call-text">Fix the totals</span>' in page
    assert 'name="result"' in page


def test_without_a_dialog_row_the_reasoning_is_the_text_the_step_recorded(reviewer):
    item = approval(context="I will email the summary now.")
    assert presenters.reasoning_for(item.task_id, item.step_id, "call_7", fallback="x").text == "x"
    page = logged_in(reviewer).get(url(item)).content.decode()
    assert 'data-testid="review-context">I will email the summary now.<' in page


# --- edit: a generated form, validated by the tool's model ---------------------------------------

def edit_form(item, **changes) -> dict:
    """The edit form as a browser posts it (a textarea's line breaks as CRLF)."""
    values = {"to": "\r\n".join(EMAIL["to"]), "subject": EMAIL["subject"], "body": EMAIL["body"].replace("\n", "\r\n"),
              **changes}
    return {"decision": "edit_approve", "arguments_sha256": approvals.arguments_digest(EMAIL), "note": "tidied",
            **{f"arguments.{k}": v for k, v in values.items()}}


def test_the_edit_form_is_checked_by_the_tools_argument_model_and_binds_the_edited_arguments(reviewer):
    item = approval()
    client = logged_in(reviewer)
    page = client.get(url(item)).content.decode()
    # Generated from EmailSendArgs, prefilled: recipients one per line, subject a text field, body a textarea.
    assert '<textarea id="id_arguments.to" name="arguments.to" rows="5" placeholder="One per line" required>' \
           'ops@example.org</textarea>' in page
    assert 'name="arguments.subject" value="Weekly totals" maxlength="300"' in page
    assert '<textarea id="id_arguments.body" name="arguments.body"' in page
    # Wrong values: each error next to its field, nothing decided, nothing sent into the task.
    response = client.post(url(item), edit_form(item, to="", subject="x" * 301))
    assert response.status_code == 422
    page = response.content.decode()
    assert 'data-field="arguments.to">List should have at least 1 item' in page
    assert 'data-field="arguments.subject">String should have at most 300 characters' in page
    item.refresh_from_db()
    assert item.status == "open" and decided_events(item) == []
    # A good edit: the edited arguments, as the model reads them, bound by their own digest.
    response = client.post(url(item), edit_form(item, to="finance@example.org\nops@example.org",
                                                subject="Weekly totals (corrected)"))
    assert response.status_code == 302, response.content.decode()[:2000]
    edited = {**EMAIL, "to": ["finance@example.org", "ops@example.org"], "subject": "Weekly totals (corrected)"}
    item.refresh_from_db()
    assert (item.status, item.decision, item.decision_result) == ("decided", "edit_approve", edited)
    [event] = decided_events(item)
    assert event.payload["arguments"] == edited and event.payload["approved"]
    assert event.payload["arguments_sha256"] == approvals.arguments_digest(edited)
    assert approvals.bound(event.payload, approval_id=item.pk, call_id="call_7", arguments=EMAIL)["arguments"] == edited
    audit = AuditEntry.objects.get(action="review.approval", task_id=item.task_id)
    assert audit.actor_name == "rita" and audit.after["decision"] == "edit_approve"
    assert audit.after["arguments"] == edited and audit.reason == "tidied"


def test_the_api_edit_is_validated_by_the_same_model(reviewer):
    from tests.support.helpers import bearer

    item = approval()
    client = logged_in(reviewer)
    response = client.post(f"/api/reviews/{item.pk}/decide", data=json.dumps(
        {"decision": "edit_approve", "result": {**EMAIL, "to": [], "cc": ["x@example.org"]}}),
        content_type="application/json", **bearer(reviewer))
    assert response.status_code == 422
    fields = {e["field"] for e in response.json()["errors"]}
    assert fields == {"arguments.to", "arguments.cc"}
    item.refresh_from_db()
    assert item.status == "open" and decided_events(item) == []
    detail = client.get(f"/api/reviews/{item.pk}", **bearer(reviewer)).json()
    assert detail["approval"]["arguments_sha256"] == approvals.arguments_digest(EMAIL)
    assert detail["approval"]["on_expiry"] == "reject" and detail["approval"]["approvals_required"] == 1


# --- decided once --------------------------------------------------------------------------------

def test_a_double_click_or_a_second_reviewer_is_told_who_decided_and_when_and_nothing_happens_twice(
        reviewer, make_user):
    from tests.support.helpers import bearer

    item = approval()
    first = logged_in(reviewer)
    assert first.post(url(item), {"decision": "approve", "arguments_sha256": approvals.arguments_digest(EMAIL)}
                      ).status_code == 302
    again = first.post(url(item), {"decision": "approve"})
    assert again.status_code == 409
    item.refresh_from_db()
    assert f"already decided (approve) by rita at {item.decided_at.strftime('%Y-%m-%d %H:%M:%S')}" in \
           again.content.decode()
    other = make_user("sam", "reviewer")
    response = logged_in(other).post(url(item), {"decision": "reject", "note": "no"})
    assert response.status_code == 409 and "by rita at" in response.content.decode()
    response = logged_in(other).post(f"/api/reviews/{item.pk}/decide", data=json.dumps(
        {"decision": "reject", "note": "no"}), content_type="application/json", **bearer(other))
    assert response.status_code == 409 and "by rita at" in response.json()["detail"]
    assert len(decided_events(item)) == 1
    item.refresh_from_db()
    assert (item.decision, item.decided_by.username) == ("approve", "rita")
    assert AuditEntry.objects.filter(action="review.approval", task_id=item.task_id).count() == 1


def test_a_reject_needs_a_note_the_model_reads_and_an_approve_does_not(reviewer):
    item = approval()
    client = logged_in(reviewer)
    response = client.post(url(item), {"decision": "reject", "note": " "})
    assert response.status_code == 422 and "the model reads it as the reason" in response.content.decode()
    response = client.post(url(item), {"decision": "reject", "note": "not to ops: finance"})
    assert response.status_code == 302
    [event] = decided_events(item)
    assert event.payload["approved"] is False and event.payload["note"] == "not to ops: finance"


def test_approving_arguments_that_changed_since_the_page_was_loaded_is_refused(reviewer):
    item = approval()
    response = logged_in(reviewer).post(url(item), {"decision": "approve",
                                                    "arguments_sha256": approvals.arguments_digest({"x": 1})})
    assert response.status_code == 409 and "changed since you loaded them" in response.content.decode()
    item.refresh_from_db()
    assert item.status == "open" and decided_events(item) == []


# --- who may decide ------------------------------------------------------------------------------

def test_a_viewer_and_an_operator_cannot_decide_by_the_page_or_the_api(viewer, operator):
    from tests.support.helpers import bearer

    item = approval()
    for user in (viewer, operator):
        client = logged_in(user)
        page = client.get(url(item)).content.decode()
        assert 'data-testid="btn-approve"' not in page and 'data-testid="edit-form"' not in page
        assert 'data-testid="no-decision-form"' in page
        assert client.post(url(item), {"decision": "approve"}).status_code == 403
        response = client.post(f"/api/reviews/{item.pk}/decide", data=json.dumps({"decision": "approve"}),
                               content_type="application/json", **bearer(user))
        assert response.status_code == 403
        with pytest.raises(Exception) as refused:  # the service itself refuses, whatever calls it
            review_decide(item_id=item.pk, decision="approve", note="", actor=user)
        assert "reviewer role" in str(refused.value)
    item.refresh_from_db()
    assert item.status == "open" and decided_events(item) == []
    assert not AuditEntry.objects.filter(action__startswith="review.", task_id=item.task_id).exists()


def test_two_person_approval_needs_two_different_reviewers_and_the_same_one_twice_is_refused(reviewer, make_user):
    item = approval(policy=approvals.Policy(approvers=2))
    digest = approvals.arguments_digest(EMAIL)
    rita = logged_in(reviewer)
    assert 'Approve (1 of 2)' in rita.get(url(item)).content.decode()
    response = rita.post(url(item), {"decision": "approve", "arguments_sha256": digest})
    assert response.status_code == 302 and response.url == url(item)
    item.refresh_from_db()
    assert item.status == "open" and decided_events(item) == []
    # The same person again (a double click, or a second tab): refused, nothing recorded.
    response = rita.post(url(item), {"decision": "approve", "arguments_sha256": digest})
    assert response.status_code == 409 and "another reviewer must approve them too" in response.content.decode()
    with pytest.raises(Exception, match="another reviewer"):
        review_decide(item_id=item.pk, decision="approve", note="", actor=reviewer)
    assert ApprovalVote.objects.filter(item=item).count() == 1
    # The installation itself is nobody: it cannot be the second person.
    with pytest.raises(Exception, match="different reviewers"):
        review_decide(item_id=item.pk, decision="approve", note="")
    sam = make_user("sam", "reviewer")
    page = logged_in(sam).get(url(item)).content.decode()
    assert 'data-testid="review-votes"' in page and "rita approved" in page
    assert logged_in(sam).post(url(item), {"decision": "approve", "arguments_sha256": digest}).status_code == 302
    item.refresh_from_db()
    assert (item.status, item.decision, item.decided_by.username) == ("decided", "approve", "sam")
    [event] = decided_events(item)
    assert event.payload["arguments_sha256"] == digest and event.payload["arguments"] is None
    votes = AuditEntry.objects.filter(action="review.approval_vote", task_id=item.task_id).order_by("id")
    assert [(v.actor_name, v.after["runs"]) for v in votes] == [("rita", False), ("sam", True)]
    final = AuditEntry.objects.get(action="review.approval", task_id=item.task_id)
    assert sorted(final.after["approved_by"]) == ["rita", "sam"]


def test_under_two_person_approval_an_edit_is_what_the_second_reviewer_approves(reviewer, make_user):
    item = approval(policy=approvals.Policy(approvers=2))
    rita, sam = logged_in(reviewer), logged_in(make_user("sam", "reviewer"))
    # Rita loads the page, Sam edits meanwhile: Rita's approval of what she saw is refused.
    seen = approvals.arguments_digest(EMAIL)
    assert sam.post(url(item), edit_form(item, subject="Corrected")).status_code == 302
    response = rita.post(url(item), {"decision": "approve", "arguments_sha256": seen})
    assert response.status_code == 409 and "changed since you loaded them" in response.content.decode()
    # Sam cannot approve his own edit a second time.
    edited = {**EMAIL, "subject": "Corrected"}
    assert sam.post(url(item), {"decision": "approve", "arguments_sha256": approvals.arguments_digest(edited)}
                    ).status_code == 409
    page = rita.get(url(item)).content.decode()
    assert 'data-testid="edited-by">Edited by sam' in page and 'data-testid="email-subject"><strong>Corrected<' in page
    assert rita.post(url(item), {"decision": "approve", "arguments_sha256": approvals.arguments_digest(edited)}
                     ).status_code == 302
    item.refresh_from_db()
    assert (item.status, item.decision, item.decision_result) == ("decided", "edit_approve", edited)
    [event] = decided_events(item)
    assert event.payload["arguments"] == edited
    assert event.payload["arguments_sha256"] == approvals.arguments_digest(edited)


# --- who sets the rules -------------------------------------------------------------------------

def test_operators_may_ask_for_two_reviewers_but_only_an_admin_may_drop_them(operator, make_user):
    from orchestrator.engine import revisions

    task = services.task_create(type="agent.plan_execute", actor=operator, params={
        "goal": "email the totals", "tools": ["email_send"], "two_person_approval": ["email_send"],
        "approval_timeout_seconds": 600,
        "approval_rules": {"email_send": {"on_expiry": "keep_waiting", "timeout_seconds": 60}}})
    services.task_pause(task_id=task.pk, actor=operator)
    task.refresh_from_db()
    dropped = revisions.edited_params(task, {"two_person_approval": []})
    with pytest.raises(services.InvalidInput) as refused:
        revisions.apply_edit(task_id=task.pk, new_params=dropped, expected_version=None, actor=operator)
    assert "only an admin may drop two-person approval of email_send" in str(refused.value)
    revisions.apply_edit(task_id=task.pk, new_params=dropped, expected_version=None,
                         actor=make_user("root", superuser=True))
    # An escalation needs a group that exists.
    with pytest.raises(services.InvalidInput, match="no group named 'managers'"):
        services.task_create(type="agent.plan_execute", actor=operator, params={
            "goal": "x", "tools": ["email_send"],
            "approval_rules": {"email_send": {"on_expiry": "escalate", "escalate_to": "managers"}}})
    Group.objects.create(name="managers")
    services.task_create(type="agent.plan_execute", actor=operator, params={
        "goal": "x", "tools": ["email_send"],
        "approval_rules": {"email_send": {"on_expiry": "escalate", "escalate_to": "managers"}}})
    with pytest.raises(services.InvalidInput, match="escalate_to"):
        services.task_create(type="agent.plan_execute", actor=operator, params={
            "goal": "x", "tools": ["email_send"], "approval_rules": {"email_send": {"on_expiry": "escalate"}}})


def test_a_tool_known_by_its_json_schema_only_gets_a_generated_form_checked_by_that_schema(reviewer, monkeypatch):
    """An MCP server's tool has a JSON schema, no pydantic model; the approval keeps it when it
    opens, so the page never asks the server (from the web process) for it."""
    from orchestrator.agent import toolbox
    from orchestrator.agent.tooldef import AgentTool

    schema = {"type": "object", "properties": {
        "repo_path": {"type": "string"}, "message": {"type": "string", "minLength": 1, "maxLength": 72}},
        "required": ["repo_path", "message"], "additionalProperties": False}
    commit = AgentTool("git__git_commit", "Commit", None, lambda ctx, args: None, parameters=schema)
    real = toolbox.find_tool
    monkeypatch.setattr(toolbox, "find_tool", lambda name: commit if name == "git__git_commit" else real(name))
    item = approval(tool="git__git_commit", arguments={"repo_path": "/srv/repo", "message": "Fix the totals"})
    other = approval(tool="git__git_commit", arguments={"repo_path": "/r", "message": "m"}, call_id="call_9")
    assert item.proposal["schema"] == schema and item.proposal["schema_from"] == "json_schema"
    monkeypatch.setattr(toolbox, "find_tool", lambda name: pytest.fail(f"the page asked the source for {name}")
                        if name == "git__git_commit" else real(name))
    client = logged_in(reviewer)
    page = client.get(url(item)).content.decode()
    assert 'data-testid="mcp-server">git<' in page
    assert 'name="arguments.message" value="Fix the totals"' in page and 'name="result"' not in page
    form = {"decision": "edit_approve", "arguments.repo_path": "/srv/repo", "arguments.message": "x" * 73}
    response = client.post(url(item), form)
    assert response.status_code == 422 and 'data-field="arguments.message">' in response.content.decode()
    response = client.post(url(item), {**form, "arguments.message": "Fix the EUR totals"})
    assert response.status_code == 302
    [event] = decided_events(item)
    assert event.payload["arguments"] == {"repo_path": "/srv/repo", "message": "Fix the EUR totals"}
    with pytest.raises(services.InvalidInput) as refused:  # the API's path: the same schema
        review_decide(item_id=other.pk, decision="edit_approve", note="", result={"message": "m", "extra": 1},
                      actor=reviewer)
    assert {e.field for e in refused.value.errors} == {"arguments.repo_path", "arguments.extra"}
