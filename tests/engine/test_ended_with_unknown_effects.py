"""Whatever ends a task, an effect whose outcome is unknown goes in front of a reviewer.

Real worker processes, real servers that hang (a POST read and never answered; an SMTP
server that took the message after DATA and never replies), real Stop, Force-terminate and
kill -9. Each way of ending leaves the task `stopped`/`terminated`, the WAL row `pending`
(unknown: neither done nor "did not happen"), one open review item, and the "unreviewed
effect" badge on the task list and the task page (first paint and live fragments). Deciding
it records what happened and runs nothing: the task stays as it ended."""
import os
import signal

import pytest
from django.urls import reverse

from orchestrator.engine import actions, services
from orchestrator.engine.worker import drive_inline
from tests.support.helpers import drive_and_close
from orchestrator.models import AuditEntry, Task, WalEntry
from orchestrator.presenters import fragments
from orchestrator.selectors import task_export
from review.models import ReviewItem
from review.services import review_decide
from tests.conftest import wait_for

TYPES = "tests.support.testtypes"
ENDED = ("stopped", "terminated")

pytestmark = [pytest.mark.workers, pytest.mark.django_db(transaction=True), pytest.mark.task_types(TYPES)]


@pytest.fixture
def hung(request, silent_http, misbehaving_smtp):
    """A side effect that hangs once it has reached the other side: a POST the server read and
    never answers, or an email the server took after DATA and never confirms."""
    kind = request.param
    if kind == "post":
        params = {"kind": "post", "url": silent_http.url, "timeout": 60}
        reached = lambda: len(silent_http.requests)  # noqa: E731
    else:
        misbehaving_smtp.mode, misbehaving_smtp.late_seconds = "reply_late", 60
        params = {"kind": "nonidempotent", "to": "ann@example.org"}
        # The task's own email only: the reviewers are told of the review item by email too.
        reached = lambda: sum(m["X-Idempotency-Key"] is not None for m in misbehaving_smtp.received)  # noqa: E731
    return kind, params, reached


def worker_env(misbehaving_smtp, **overrides) -> dict:
    # The email client waits 2 s for the server's answer: within Stop's grace period, so Stop
    # ends the task itself (`stopped`), with the email's outcome unknown.
    return {"ORCH_EXTRA_TASK_TYPES": TYPES, "EMAIL_HOST": "127.0.0.1", "EMAIL_PORT": misbehaving_smtp.port,
            "EMAIL_TIMEOUT": 2, "ORCH_GRACE_SECONDS": 15, **overrides}


def start_hung_task(start_workers, misbehaving_smtp, hung, **env) -> Task:
    kind, params, reached = hung
    start_workers(1, **worker_env(misbehaving_smtp, **env))
    task = services.task_create(type="test.effects", params=params)
    wait_for(lambda: reached() == 1, message=f"the {kind} to reach its server")
    wait_for(lambda: WalEntry.objects.filter(task=task, status="pending").exists(), message="the intent")
    return task


def ended(task_id: int) -> Task:
    wait_for(lambda: Task.objects.get(pk=task_id).status in ENDED, timeout=60, message="the task to end")
    return Task.objects.get(pk=task_id)


def badges(task: Task, client, user) -> dict[str, bool]:
    """Where the "unreviewed effect" badge shows: the list and the page, first paint and live."""
    client.force_login(user)
    marker = 'data-testid="unreviewed-effects"'
    _, regions = fragments.task_page_regions(task.pk, user, "token")
    page = client.get(reverse("task_detail", args=[task.pk])).content.decode()
    # The page also says where to decide it (the review queue, filtered to this task).
    callout = 'data-testid="ended-review-callout"' in page and f'href="/review/?task={task.pk}"' in page
    assert callout == (marker in page)
    return {
        "list": marker in client.get(reverse("task_list")).content.decode(),
        "page": marker in page,
        "live row": marker in fragments.task_rows([task.pk])[0]["html"],
        "live page": marker in regions["task-summary"],
    }


def assert_unknown_and_reviewed(task: Task, status: str, client, user) -> ReviewItem:
    assert task.status == status, task.status_reason
    entry = WalEntry.objects.get(task=task)
    assert entry.status == "pending", (entry.status, entry.error)  # unknown: neither done nor failed
    items = list(ReviewItem.objects.filter(task=task))
    assert len(items) == 1 and items[0].status == "open" and items[0].wal_entry == entry, items
    assert "in doubt" in task.status_reason and entry.idempotency_key in task.status_reason
    assert badges(task, client, user) == {"list": True, "page": True, "live row": True, "live page": True}
    return items[0]


def decide_and_assert_nothing_runs(task: Task, item: ReviewItem, decision: str, reached, client, user, reviewer):
    before = Task.objects.get(pk=task.pk)
    review_decide(item_id=item.pk, decision=decision, note="checked the server's log", actor=reviewer)
    item.refresh_from_db()
    assert item.status == "decided" and item.decision == decision
    entry = WalEntry.objects.get(pk=item.wal_entry_id)
    assert entry.status == {"happened": "done", "not_happened": "failed", "skip": "skipped"}[decision]
    if decision == "not_happened":
        assert f"the task had {task.status}: not performed again" in entry.error
    after = Task.objects.get(pk=task.pk)
    # Recorded, not re-executed: the task stays as it ended, nothing was queued, and a worker
    # that got a message anyway would not take it.
    assert (after.status, after.status_reason, after.enqueued_at) == (before.status, before.status_reason,
                                                                       before.enqueued_at)
    assert drive_inline(task.pk) == "not claimed"
    assert reached() == 1
    assert AuditEntry.objects.filter(task=task, action="review.decide").count() == 1
    event = after.events.filter(kind="effect_reviewed").get()
    assert event.payload["decision"] == decision and event.payload["open_reviews"] == 0
    exported = task_export(task.pk)
    assert [r["decision"] for r in exported["reviews"]] == [decision]
    assert badges(after, client, user) == {"list": False, "page": False, "live row": False, "live page": False}


@pytest.mark.parametrize("hung", ["post", "email"], indirect=True)
def test_stop_during_an_effect_in_flight_ends_stopped_with_the_effect_reviewed(
        hung, start_workers, misbehaving_smtp, operator, reviewer, client):
    task = start_hung_task(start_workers, misbehaving_smtp, hung)
    services.task_stop(task_id=task.pk, actor=operator)
    task = ended(task.pk)
    item = assert_unknown_and_reviewed(task, "stopped", client, operator)
    assert "stopped by an operator" in item.reason and "runs nothing again" in item.reason
    decide_and_assert_nothing_runs(task, item, "happened" if hung[0] == "post" else "not_happened", hung[2],
                                   client, operator, reviewer)


@pytest.mark.parametrize("hung", ["post", "email"], indirect=True)
def test_force_terminate_during_an_effect_in_flight_ends_terminated_with_the_effect_reviewed(
        hung, start_workers, misbehaving_smtp, operator, reviewer, client):
    task = start_hung_task(start_workers, misbehaving_smtp, hung)
    services.task_terminate(task_id=task.pk, actor=operator, reason="runaway")
    task = ended(task.pk)
    item = assert_unknown_and_reviewed(task, "terminated", client, operator)
    assert "force-terminated" in item.reason
    decide_and_assert_nothing_runs(task, item, "not_happened" if hung[0] == "post" else "happened", hung[2],
                                   client, operator, reviewer)


@pytest.mark.parametrize("hung", ["post", "email"], indirect=True)
def test_a_stopping_task_whose_worker_is_killed_is_stopped_by_recovery_with_the_effect_reviewed(
        hung, start_workers, misbehaving_smtp, operator, reviewer, client):
    # A long grace: the watchdog must not escalate the Stop while the executor is frozen.
    task = start_hung_task(start_workers, misbehaving_smtp, hung, ORCH_GRACE_SECONDS=120)
    pid = wait_for(lambda: Task.objects.get(pk=task.pk).worker_pid, message="the executor's pid")
    os.kill(pid, signal.SIGSTOP)  # frozen mid-effect: it cannot act on the Stop
    services.task_stop(task_id=task.pk, actor=operator)
    assert Task.objects.get(pk=task.pk).status == "stopping"
    os.kill(pid, signal.SIGKILL)
    task = ended(task.pk)
    item = assert_unknown_and_reviewed(task, "stopped", client, operator)
    assert "stop completed by recovery" in item.reason
    decide_and_assert_nothing_runs(task, item, "happened", hung[2], client, operator, reviewer)


def test_the_stop_tooltip_says_an_effect_cut_in_flight_goes_to_review(operator, client, settings):
    settings.ORCH_GRACE_SECONDS = 7
    task = services.task_create(type="test.effects", params={"kind": "post", "url": "http://127.0.0.1:9/x"})
    client.force_login(operator)
    page = client.get(reverse("task_detail", args=[task.pk])).content.decode()
    hint = actions.hints()["stop"]
    assert f'data-testid="btn-stop" title="{hint}"' in page
    # Not the old promise ("finish the current step's side effect safely"): Stop cuts it.
    assert "safely" not in hint and "after 7 s is force-terminated" in hint and "review queue" in hint


@pytest.mark.parametrize("hung", ["email"], indirect=True)
def test_a_stop_that_outlives_its_grace_is_escalated_with_the_effect_reviewed(
        hung, start_workers, misbehaving_smtp, operator, reviewer, client):
    # The email client would wait a minute for the server's answer; Stop's grace is 1 s: the
    # watchdog kills the executor and terminates the task ("stop escalated").
    task = start_hung_task(start_workers, misbehaving_smtp, hung, EMAIL_TIMEOUT=60, ORCH_GRACE_SECONDS=1)
    services.task_stop(task_id=task.pk, actor=operator)
    task = ended(task.pk)
    item = assert_unknown_and_reviewed(task, "terminated", client, operator)
    assert "stop escalated to force-terminate" in task.status_reason and "stop escalated" in item.reason
    decide_and_assert_nothing_runs(task, item, "skip", hung[2], client, operator, reviewer)


def test_abort_on_an_ended_task_closes_the_item_and_moves_nothing_and_a_second_decision_is_refused(
        silent_http, operator, reviewer):
    import threading

    from review.services import ReviewClosed

    task = services.task_create(type="test.effects", params={"kind": "post", "url": silent_http.url, "timeout": 60})
    runner = threading.Thread(target=drive_and_close, args=(task.pk,))
    runner.start()
    wait_for(lambda: len(silent_http.requests) == 1, message="the POST to reach the server")
    services.task_stop(task_id=task.pk, actor=operator)
    runner.join(timeout=30)
    task = Task.objects.get(pk=task.pk)
    item = ReviewItem.objects.get(task=task, status="open")
    review_decide(item_id=item.pk, decision="abort_task", note="the charge is in their dashboard", actor=reviewer)
    after = Task.objects.get(pk=task.pk)
    assert (after.status, after.status_reason, after.error) == ("stopped", task.status_reason, task.error)
    assert after.events.filter(kind="effect_reviewed").count() == 1
    with pytest.raises(ReviewClosed):
        review_decide(item_id=item.pk, decision="not_happened", note="changed my mind", actor=reviewer)
    assert WalEntry.objects.get(task=task).status == "pending"  # abort records no outcome; nothing ran
    assert len(silent_http.requests) == 1 and drive_inline(task.pk) == "not claimed"


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("control", ["stop", "terminate"])
def test_stopping_a_task_no_worker_holds_reviews_the_effect_it_left_pending(control, operator):
    # A recovered task queued to replay an idempotent effect: ended now, nothing will replay it.
    task = services.task_create(type="demo.pipeline", params={"stages": 1})
    entry = WalEntry.objects.create(task=task, step_id="stage-1", call_index=0, tool="http.request",
                                    args={"method": "PUT", "url": "http://127.0.0.1:9/x"},
                                    idempotency_key=f"t{task.pk}:stage-1:0", idempotent=True, lease_epoch=1,
                                    worker="gone:1")
    getattr(services, f"task_{control}")(task_id=task.pk, actor=operator, reason="enough")
    task.refresh_from_db()
    assert task.status == {"stop": "stopped", "terminate": "terminated"}[control]
    [item] = ReviewItem.objects.filter(task=task, status="open")
    assert item.wal_entry_id == entry.pk
    assert WalEntry.objects.get(pk=entry.pk).status == "pending"


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("policy, ends", [("skip", "completed"), ("fail", "failed")])
def test_a_task_that_completes_past_a_skipped_effect_in_doubt_puts_it_in_front_of_a_reviewer(
        silent_http, reviewer, policy, ends):
    # A keyed POST the server read and never answered: in doubt, replayed with its key until the
    # step's retries ran out; then its policy skips it (the task goes on and completes) or fails
    # the task. Either way nothing will replay the call now: a reviewer records whether it happened.
    task = services.task_create(type="test.effects", params={"kind": "keyed", "url": silent_http.url, "timeout": 1,
                                                             "on_failure": policy})
    assert drive_inline(task.pk) == ends
    task.refresh_from_db()
    entry = WalEntry.objects.get(task=task)
    sent = len(silent_http.requests)
    keys = {line.split(b":", 1)[1].strip().decode() for request in silent_http.requests
            for line in request.split(b"\r\n") if line.lower().startswith(b"idempotency-key:")}
    assert sent >= 2 and keys == {entry.idempotency_key}
    assert task.status_reason.endswith(f"; 1 side effect(s) in doubt wait for review ({entry.idempotency_key})")
    [item] = ReviewItem.objects.filter(task=task, status="open")
    assert item.wal_entry_id == entry.pk and "The task ended" in item.reason
    review_decide(item_id=item.pk, decision="happened", note="the ledger has it", actor=reviewer)
    assert WalEntry.objects.get(pk=entry.pk).status == "done"
    assert Task.objects.get(pk=task.pk).status == ends and len(silent_http.requests) == sent
