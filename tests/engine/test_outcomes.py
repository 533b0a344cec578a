"""Outcome classes of tool failures, against real servers that misbehave: a send that may
have happened goes to review (never retried blindly); one that certainly did not retries."""
import pytest

from orchestrator.engine import services
from orchestrator.engine.worker import drive_inline
from orchestrator.models import Task, WalEntry
from review.models import ReviewItem
from review.services import review_decide

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.task_types("tests.support.testtypes")]


def effect_task(**params) -> Task:
    task = services.task_create(type="test.effects", params=params)
    drive_inline(task.pk)
    return Task.objects.get(pk=task.pk)


def the_review(task: Task) -> ReviewItem:
    items = list(ReviewItem.objects.filter(task=task, status="open"))
    assert len(items) == 1, items
    return items[0]


def test_smtp_server_that_takes_the_message_and_drops_the_connection_sends_it_to_review(smtp, reviewer):
    smtp.mode = "drop_after_data"
    task = effect_task(kind="nonidempotent", to="ann@example.org")
    assert task.status == "awaiting_review", task.status_reason
    item = the_review(task)
    assert item.wal_entry.status == "pending" and "outcome unknown" in item.wal_entry.error
    assert item.evidence["phase"] == "after DATA" and "SMTPServerDisconnected" in item.evidence["error"]
    assert item.evidence["message_id"]  # the tool's own evidence is there too
    assert "may or may not have been accepted" in item.reason
    assert smtp.keys() == [item.wal_entry.idempotency_key]  # the server has it: exactly once

    smtp.mode = "ok"
    review_decide(item_id=item.pk, decision="happened", note="in the server log", actor=reviewer)
    drive_inline(task.pk)
    assert Task.objects.get(pk=task.pk).status == "completed"
    assert len(smtp.received) == 1  # never sent a second time


def test_smtp_server_that_answers_after_the_client_timeout_sends_it_to_review(smtp, reviewer):
    smtp.mode, smtp.late_seconds = "reply_late", 2.5
    task = effect_task(kind="nonidempotent")
    assert task.status == "awaiting_review", task.status_reason
    item = the_review(task)
    assert item.evidence["phase"] == "after DATA" and "timed out" in item.evidence["error"]
    assert len(smtp.received) == 1

    # The reviewer checks the server's log: not there (say it was lost) -> sent again, same key.
    smtp.mode = "ok"
    review_decide(item_id=item.pk, decision="not_happened", note="not in the log", actor=reviewer)
    drive_inline(task.pk)
    assert Task.objects.get(pk=task.pk).status == "completed"
    assert smtp.keys() == [item.wal_entry.idempotency_key] * 2  # the only repeat is the one the reviewer asked for


def test_smtp_server_that_refuses_the_recipient_is_not_performed_and_retried(smtp):
    smtp.mode = "refuse_rcpt"
    task = effect_task(kind="nonidempotent", to="nobody@example.org")
    assert not ReviewItem.objects.filter(task=task).exists()  # certainly not sent: nothing to review
    assert smtp.received == []
    entry = WalEntry.objects.get(task=task)
    assert entry.status == "failed" and "refused recipient nobody@example.org" in entry.error
    assert "550" in entry.error
    step = task.steps.get(step_id="effect")
    assert step.attempts >= 2  # retried with backoff before giving up
    assert task.status in ("needs_human", "failed")


def test_http_server_that_reads_the_post_and_never_answers_sends_it_to_review(silent_http, reviewer):
    task = effect_task(kind="post", url=silent_http.url, timeout=0.5)
    assert task.status == "awaiting_review", task.status_reason
    item = the_review(task)
    assert len(silent_http.requests) == 1 and silent_http.requests[0].startswith(b"POST /charges")
    assert item.evidence["phase"] == "after sending, before the response"
    assert "timed out" in item.evidence["error"]
    assert item.wal_entry.tool == "http.request" and item.wal_entry.status == "pending"


def test_http_connection_refused_is_not_performed_and_never_reviewed():
    import socket

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/charges"
    task = effect_task(kind="post", url=url, timeout=0.5)
    assert not ReviewItem.objects.filter(task=task).exists()
    entry = WalEntry.objects.get(task=task)
    assert entry.status == "failed" and "failed before it reached the server" in entry.error
    assert task.steps.get(step_id="effect").attempts >= 2


def test_an_unexpected_exception_inside_a_non_idempotent_tool_counts_as_unknown():
    task = effect_task(kind="explode")
    assert task.status == "awaiting_review", task.status_reason
    item = the_review(task)
    assert "unexpected RuntimeError" in item.reason and "driver crashed" in item.evidence["error"]


def test_a_post_cancelled_in_flight_is_recorded_as_unknown_not_as_not_performed(silent_http, operator):
    import threading

    from tests.conftest import wait_for

    from tests.support.helpers import drive_and_close

    task = services.task_create(type="test.effects", params={"kind": "post", "url": silent_http.url, "timeout": 60})
    runner = threading.Thread(target=drive_and_close, args=(task.pk,))
    runner.start()
    wait_for(lambda: len(silent_http.requests) == 1, message="the POST to reach the server")
    services.task_stop(task_id=task.pk, actor=operator)  # cancels the request in flight
    runner.join(timeout=30)
    task = Task.objects.get(pk=task.pk)
    assert task.status == "stopped"
    entry = WalEntry.objects.get(task=task)
    # Not "failed" (= did not happen): the server had the request when it was cut off.
    assert entry.status == "pending" and "cancelled" in entry.error and "after the request was sent" in entry.error
    assert len(silent_http.requests) == 1
    # ...and a reviewer is asked what happened, although the task ended (Stop never hides it).
    item = the_review(task)
    assert item.wal_entry == entry and item.evidence["phase"] == "cancelled in flight"
    assert "stopped by an operator" in item.reason and "1 side effect(s) in doubt" in task.status_reason
