"""The review pages: the queue, one item with everything a reviewer needs, and the
decision form — what each decision does to the WAL, the idempotency store, the task and
the audit log, and who may decide."""
import json

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils.html import escape

from orchestrator.models import AuditEntry, IdempotencyRecord, Task, WalEntry
from review.models import DECISIONS_BY_KIND, Decision, ReviewItem, ReviewKind

from .conftest import logged_in, make_review

pytestmark = pytest.mark.django_db

QUEUE = "/review/"


def item_url(item) -> str:
    return f"/review/{item.pk}/"


def state(item) -> dict:
    """Everything a decision could change."""
    item = ReviewItem.objects.get(pk=item.pk)
    return {"item": (item.status, item.decision, item.note, item.decided_by_id, item.decided_at),
            "wal": WalEntry.objects.filter(pk=item.wal_entry_id).values_list("status", "result", "error").get(),
            "task": Task.objects.get(pk=item.task_id).status,
            "audit": AuditEntry.objects.filter(action__startswith="review.").count(),
            "records": IdempotencyRecord.objects.count()}


# --- the queue ----------------------------------------------------------------------------

def test_the_queue_lists_open_items_oldest_first(viewer, review_item):
    newer = make_review(to="b@example.org")
    response = logged_in(viewer).get(QUEUE)
    assert response.status_code == 200
    page = response.content.decode()
    assert 'data-testid="review-count">2<' in page
    rows = [item.pk for item in response.context["items"]]
    assert rows == [review_item.pk, newer.pk]
    entry = review_item.wal_entry
    assert f'href="/review/{review_item.pk}/"' in page
    assert f'href="/tasks/{review_item.task_id}/"' in page
    for text in (entry.idempotency_key, "email.send", "send-001", "host:1", "demo.notify"):
        assert text in page, text


def test_a_long_queue_pages_by_keyset_oldest_first_with_the_filters_kept(viewer, review_item, monkeypatch):
    from review import views

    monkeypatch.setattr(views, "QUEUE_ROWS_SHOWN", 2)
    items = [review_item] + [make_review(to=f"r{i}@example.org") for i in range(4)]
    ReviewItem.objects.filter(pk=items[2].pk).update(detected_at=items[1].detected_at)  # a tie: the id decides
    client = logged_in(viewer)
    seen, url = [], QUEUE + "?tool=email.send"
    while url:
        response = client.get(url)
        assert response.status_code == 200 and 'data-testid="review-count">5<' in response.content.decode()
        seen += [i.pk for i in response.context["items"]]
        after = response.context["next_after"]
        url = f"{QUEUE}?tool=email.send&after={after}" if after else None
        if after:
            assert f'href="?tool=email.send&amp;after={after}"' in response.content.decode()
    assert seen == [i.pk for i in items]
    assert client.get(QUEUE, {"after": "not-a-number"}).context["items"][0].pk == review_item.pk


def test_the_queue_filters_by_status_tool_and_task(reviewer, review_item):
    other = make_review(to="b@example.org")
    client = logged_in(reviewer)
    client.post(item_url(other), {"decision": "skip", "note": "not needed"})

    def ids(**params):
        response = client.get(QUEUE, params)
        assert response.status_code == 200
        return [i.pk for i in response.context["items"]]

    assert ids() == [review_item.pk]
    assert ids(status="decided") == [other.pk]
    assert ids(status="all") == [review_item.pk, other.pk]
    assert ids(status="all", task=other.task_id) == [other.pk]
    assert ids(status="all", task=f"#{review_item.task_id}") == [review_item.pk]
    assert ids(status="all", tool="email.send") == [review_item.pk, other.pk]
    assert ids(status="all", tool="http.post") == []
    assert "not a task id" in client.get(QUEUE, {"task": "abc"}).content.decode()


def test_an_empty_queue_says_so(viewer):
    page = logged_in(viewer).get(QUEUE).content.decode()
    assert "Nothing to review" in page


# --- one item -----------------------------------------------------------------------------

def test_the_item_page_shows_what_a_reviewer_needs(reviewer, review_item):
    sibling = make_review(review_item.task, step_id="send-002", to="b@example.org")
    response = logged_in(reviewer).get(item_url(review_item))
    assert response.status_code == 200
    page = response.content.decode()
    entry = review_item.wal_entry
    assert 'data-testid="review-tool">email.send<' in page
    assert f'data-testid="review-key">{entry.idempotency_key}<' in page
    assert "&quot;to&quot;: &quot;a@example.org&quot;" in page  # the pretty-printed arguments
    assert 'data-testid="how-to-check"' in page
    assert escape(review_item.evidence["how_to_check"]) in page
    assert escape(review_item.evidence["message_id"]) in page
    assert entry.created_at.strftime("%Y-%m-%d %H:%M:%S") in page  # when the intent was written
    assert "host:1" in page and "stopped heartbeating mid-send" in page
    assert f'href="/tasks/{review_item.task_id}/"' in page and "awaiting_review" in page
    assert f'href="/review/{sibling.pk}/"' in page  # the task's other items
    # The decision form: CSRF, the four decisions with their labels, a note, a result.
    assert 'data-testid="decision-form"' in page and "csrfmiddlewaretoken" in page
    for value, label in [(d.value, d.label) for d in DECISIONS_BY_KIND[ReviewKind.EFFECT]]:
        assert f'value="{value}"' in page and label in page
    assert 'name="note"' in page and 'name="result"' in page


def test_a_missing_item_is_404(viewer):
    assert logged_in(viewer).get("/review/999999/").status_code == 404


@pytest.mark.parametrize("identity", ["viewer", "operator"])
def test_viewers_and_operators_see_the_item_but_cannot_decide(request, identity, review_item):
    client = logged_in(request.getfixturevalue(identity))
    response = client.get(item_url(review_item))
    assert response.status_code == 200
    page = response.content.decode()
    assert 'data-testid="decision-form"' not in page and 'data-testid="no-decision-form"' in page
    before = state(review_item)
    assert client.post(item_url(review_item), {"decision": "happened", "note": "sure"}).status_code == 403
    assert state(review_item) == before


def test_no_role_is_forbidden_and_anonymous_goes_to_login(client, make_user, review_item):
    anonymous = client.get(item_url(review_item))
    assert anonymous.status_code == 302 and anonymous["Location"].startswith("/accounts/login/")
    nobody = logged_in(make_user("nobody"))
    assert nobody.get(QUEUE).status_code == 403
    assert nobody.get(item_url(review_item)).status_code == 403
    before = state(review_item)
    assert nobody.post(item_url(review_item), {"decision": "skip", "note": "x"}).status_code == 403
    assert client.post(item_url(review_item), {"decision": "skip", "note": "x"}).status_code == 302
    assert state(review_item) == before


# --- decisions ----------------------------------------------------------------------------

def test_happened_records_the_result_and_the_task_continues(reviewer, review_item):
    client = logged_in(reviewer)
    note = "Found Message-ID in the recipient's mailbox"
    response = client.post(item_url(review_item), {"decision": "happened", "note": note,
                                                   "result": '{"message_id": "<x@y>"}'}, follow=True)
    assert response.redirect_chain == [(QUEUE, 302)]
    assert f"Review #{review_item.pk} decided" in response.content.decode()

    item = ReviewItem.objects.get(pk=review_item.pk)
    entry = item.wal_entry
    assert (item.status, item.decision, item.note, item.decided_by) == ("decided", "happened", note, reviewer)
    assert item.decided_at is not None and item.decision_result == {"message_id": "<x@y>"}
    assert entry.status == "done" and entry.result == {"message_id": "<x@y>"}
    assert IdempotencyRecord.objects.filter(key=entry.idempotency_key).exists()
    audit = AuditEntry.objects.get(action="review.decide", task_id=item.task_id)
    assert (audit.actor, audit.reason, audit.ip) == (reviewer, note, "127.0.0.1")
    assert audit.after["decision"] == "happened"
    assert Task.objects.get(pk=item.task_id).status == "queued"  # it was the last open item

    page = client.get(item_url(item)).content.decode()  # a decided item shows the decision
    assert 'data-testid="decision-form"' not in page
    assert 'data-testid="decision">happened<' in page and escape(note) in page
    assert 'data-testid="decided-by">rita<' in page


def test_happened_without_a_result_is_confirmed_by_the_reviewer(reviewer, review_item):
    logged_in(reviewer).post(item_url(review_item), {"decision": "happened", "note": "seen", "result": "  "})
    entry = WalEntry.objects.get(pk=review_item.wal_entry_id)
    # The tool's own result shape (the step reads message_id), marked as confirmed by a person.
    assert entry.status == "done" and entry.result["confirmed_by_reviewer"] is True
    assert entry.result["message_id"].startswith("<") and entry.result["to"] == entry.args["to"] if isinstance(
        entry.args["to"], list) else [entry.args["to"]]


@pytest.mark.parametrize("decision,wal_status", [("not_happened", "failed"), ("skip", "skipped")])
def test_not_happened_and_skip_settle_the_wal_entry(reviewer, review_item, decision, wal_status):
    response = logged_in(reviewer).post(item_url(review_item), {"decision": decision, "note": "checked the log",
                                                                "result": "ignored: not JSON"})
    assert response.status_code == 302 and response["Location"] == QUEUE
    entry = WalEntry.objects.get(pk=review_item.wal_entry_id)
    assert entry.status == wal_status
    assert not IdempotencyRecord.objects.filter(key=entry.idempotency_key).exists()
    assert ReviewItem.objects.get(pk=review_item.pk).decision == decision
    assert Task.objects.get(pk=review_item.task_id).status == "queued"


def test_abort_task_fails_the_task_and_closes_its_other_items(reviewer, review_item):
    sibling = make_review(review_item.task, step_id="send-002", to="b@example.org")
    unrelated = make_review(to="c@example.org")
    response = logged_in(reviewer).post(item_url(review_item), {"decision": "abort_task", "note": "wrong list"})
    assert response.status_code == 302
    assert Task.objects.get(pk=review_item.task_id).status == "failed"
    sibling.refresh_from_db()
    assert (sibling.status, sibling.decision, sibling.decided_by) == ("decided", "abort_task", reviewer)
    unrelated.refresh_from_db()
    assert unrelated.status == "open"
    assert Task.objects.get(pk=unrelated.task_id).status == "awaiting_review"


def test_the_task_waits_until_its_last_item_is_decided(reviewer, review_item):
    sibling = make_review(review_item.task, step_id="send-002", to="b@example.org")
    client = logged_in(reviewer)
    client.post(item_url(review_item), {"decision": "skip", "note": "one"})
    assert Task.objects.get(pk=review_item.task_id).status == "awaiting_review"
    client.post(item_url(sibling), {"decision": "skip", "note": "two"})
    assert Task.objects.get(pk=review_item.task_id).status == "queued"


def test_a_missing_note_is_refused_with_the_input_kept(reviewer, review_item):
    before = state(review_item)
    response = logged_in(reviewer).post(item_url(review_item), {"decision": "happened", "note": "  ",
                                                                "result": '{"kept": true}'})
    assert response.status_code == 422
    page = response.content.decode()
    assert 'data-field="note">a note is required' in page
    assert 'value="happened" data-testid="decision-happened" checked' in page
    assert "{&quot;kept&quot;: true}" in page
    assert state(review_item) == before


def test_a_missing_decision_is_refused(reviewer, review_item):
    before = state(review_item)
    response = logged_in(reviewer).post(item_url(review_item), {"note": "hmm"})
    assert response.status_code == 422
    assert 'data-testid="field-error" data-field="decision"' in response.content.decode()
    assert state(review_item) == before


def test_an_invalid_json_result_is_a_field_error(reviewer, review_item):
    before = state(review_item)
    response = logged_in(reviewer).post(item_url(review_item), {"decision": "happened", "note": "seen",
                                                                "result": "{not json"})
    assert response.status_code == 422
    page = response.content.decode()
    assert 'data-field="result">Not valid JSON' in page
    assert "{not json" in page and ">seen</textarea>" in page
    assert state(review_item) == before


def test_deciding_twice_is_refused_and_changes_nothing(reviewer, make_user, review_item):
    client = logged_in(reviewer)
    assert client.post(item_url(review_item), {"decision": "skip", "note": "first"}).status_code == 302
    before = state(review_item)
    second = logged_in(make_user("rudi", "reviewer"))
    response = second.post(item_url(review_item), {"decision": "happened", "note": "second"})
    assert response.status_code == 409
    page = response.content.decode()
    assert "already decided" in page and 'data-testid="decision">skip<' in page
    assert state(review_item) == before
    assert ReviewItem.objects.get(pk=review_item.pk).decided_by == reviewer


# --- the nav and the task page ------------------------------------------------------------

def test_the_nav_shows_the_open_count_and_the_needs_human_badge(viewer, review_item):
    client = logged_in(viewer)
    page = client.get("/").content.decode()
    assert 'data-testid="review-badge" data-count="1"' in page
    assert 'data-testid="needs-human-badge"' not in page
    Task.objects.filter(pk=review_item.task_id).update(status="needs_human")
    page = client.get(QUEUE).content.decode()
    assert 'href="/?status=needs_human"' in page
    assert 'data-testid="needs-human-badge" data-count="1"' in page


def test_the_nav_counts_cost_one_query_each(viewer, review_item):
    client = logged_in(viewer)
    client.get("/")  # warm up (session, groups)
    with CaptureQueriesContext(connection) as queries:
        client.get("/")
    sql = [q["sql"] for q in queries.captured_queries]
    assert len([s for s in sql if "COUNT" in s and "review_reviewitem" in s]) == 1
    assert len([s for s in sql if "COUNT" in s and "needs_human" in s]) == 1


def test_the_task_page_links_to_its_reviews_and_the_export(viewer, review_item):
    client = logged_in(viewer)
    page = client.get(f"/tasks/{review_item.task_id}/").content.decode()
    assert f'href="/review/?task={review_item.task_id}"' in page
    assert f'href="/api/tasks/{review_item.task_id}/export"' in page
    assert 'data-testid="needs-human-callout"' not in page
    Task.objects.filter(pk=review_item.task_id).update(status="needs_human")
    page = client.get(f"/tasks/{review_item.task_id}/").content.decode()
    assert 'data-testid="needs-human-callout"' in page
    # One callout at a time: the review callout gives way; the open item's wait still links to it.
    assert 'data-testid="review-callout"' not in page
    assert page.count(f'href="/review/?task={review_item.task_id}"') == 1 and 'data-testid="review-wait"' in page
    export = client.get(f"/api/tasks/{review_item.task_id}/export")
    assert export.status_code == 200
    assert json.loads(export.content)["reviews"][0]["id"] == review_item.pk


def test_an_approval_item_shows_the_proposed_call_and_a_rejection_goes_into_the_task(reviewer):
    from orchestrator.engine import services as engine_services
    from orchestrator.models import InboundEvent
    from review.services import open_for_approval

    task = engine_services.task_create(type="agent.plan_execute", params={"goal": "email ops"})
    item = open_for_approval(None, task_id=task.pk, step_id="tool-002-1", tool="email_send",
                             arguments={"to": ["ops@example.org"], "subject": "s", "body": "b"},
                             context="I will email the summary now.", call_id="call_7")
    client = logged_in(reviewer)
    listed = client.get(QUEUE).content.decode()
    assert 'data-testid="kind-approval"' in listed and "email_send" in listed
    page = client.get(item_url(item)).content.decode()
    assert 'data-testid="review-proposal"' in page and "I will email the summary now." in page
    assert all(f'value="{d}"' in page for d in ("approve", "edit_approve", "reject"))
    assert 'value="happened"' not in page
    response = client.post(item_url(item), {"decision": "reject", "note": "wrong recipient"})
    assert response.status_code == 302
    item.refresh_from_db()
    assert (item.status, item.decision) == ("decided", "reject")
    event = InboundEvent.objects.get(task=task, type="approval.decided")
    assert event.payload == {"approved": False, "approval_id": str(item.pk), "call_id": "call_7",
                             "arguments_sha256": "", "note": "wrong recipient", "arguments": None,
                             "expired": False}
    assert event.source == "review"
    assert AuditEntry.objects.filter(action="review.approval", task=task).exists()
