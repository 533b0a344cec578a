"""The review API: deciding with a bearer token, who may, and the errors; the export."""
import pytest

from orchestrator.models import AuditEntry, IdempotencyRecord, Task, WalEntry
from review.models import ReviewItem
from tests.support.helpers import bearer

pytestmark = pytest.mark.django_db


def decide(client, item, user, **body):
    return client.post(f"/api/reviews/{item.pk}/decide", body, content_type="application/json", **bearer(user))


def test_a_reviewer_decides_with_a_token(client, reviewer, review_item):
    response = decide(client, review_item, reviewer, decision="happened", note="in the SMTP log",
                      result={"message_id": "<m@x>"})
    assert response.status_code == 200, response.content
    body = response.json()
    assert (body["status"], body["decision"], body["decided_by"], body["wal_status"]) == (
        "decided", "happened", "rita", "done")
    assert body["task_status"] == "queued"
    entry = WalEntry.objects.get(pk=review_item.wal_entry_id)
    assert entry.result == {"message_id": "<m@x>"}
    assert IdempotencyRecord.objects.filter(key=entry.idempotency_key).exists()
    audit = AuditEntry.objects.get(action="review.decide")
    assert (audit.actor, audit.reason) == (reviewer, "in the SMTP log")


def test_the_item_in_the_api_has_what_the_page_shows(client, viewer, review_item):
    body = client.get(f"/api/reviews/{review_item.pk}", **bearer(viewer)).json()
    assert body["tool"] == "email.send" and body["idempotency_key"] == review_item.wal_entry.idempotency_key
    assert body["dead_worker"] == "host:1" and "how_to_check" in body["evidence"]
    listed = client.get("/api/reviews", **bearer(viewer)).json()
    assert [i["id"] for i in listed] == [review_item.pk]


def test_an_operator_may_not_decide(client, operator, review_item):
    response = decide(client, review_item, operator, decision="skip", note="no")
    assert response.status_code == 403
    assert ReviewItem.objects.get(pk=review_item.pk).status == "open"
    assert not AuditEntry.objects.filter(action__startswith="review.").exists()


def test_a_note_is_required(client, reviewer, review_item):
    response = decide(client, review_item, reviewer, decision="skip")
    assert response.status_code == 422
    assert {e["field"] for e in response.json()["errors"]} == {"note"}
    assert ReviewItem.objects.get(pk=review_item.pk).status == "open"
    assert WalEntry.objects.get(pk=review_item.wal_entry_id).status == "pending"


def test_a_decided_item_is_409(client, reviewer, review_item):
    assert decide(client, review_item, reviewer, decision="skip", note="first").status_code == 200
    response = decide(client, review_item, reviewer, decision="happened", note="second")
    assert response.status_code == 409
    assert "already decided" in response.json()["detail"]
    assert ReviewItem.objects.get(pk=review_item.pk).decision == "skip"
    assert WalEntry.objects.get(pk=review_item.wal_entry_id).status == "skipped"
    assert AuditEntry.objects.filter(action="review.decide").count() == 1


def test_a_missing_item_is_404(client, reviewer):
    response = client.post("/api/reviews/999999/decide", {"decision": "skip", "note": "x"},
                           content_type="application/json", **bearer(reviewer))
    assert response.status_code == 404


def test_the_export_has_the_full_context(client, viewer, review_item):
    response = client.get(f"/api/tasks/{review_item.task_id}/export", **bearer(viewer))
    assert response.status_code == 200
    body = response.json()
    assert {"task", "steps", "wal", "events", "audit", "reviews"} <= set(body)
    assert body["task"]["id"] == review_item.task_id
    assert [w["idempotency_key"] for w in body["wal"]] == [review_item.wal_entry.idempotency_key]
    assert [r["id"] for r in body["reviews"]] == [review_item.pk]
    assert any(a["action"] == "task.create" for a in body["audit"])
    assert Task.objects.get(pk=review_item.task_id).status == "awaiting_review"
