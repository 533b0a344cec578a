"""`waiting_on`: what each task waits on, said for people, on the task list, the task page (first
paint and live update alike) and the API — one reason per state, each read from durable rows
(issue 24, item 5). A finished task waits on nothing."""
import re
from datetime import timedelta

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from orchestrator.engine import approvals, services
from orchestrator.models import AgentMessage, Step, Task
from orchestrator.presenters import fragments, task_page
from orchestrator.presenters.waiting import waiting_on, with_waiting_on
from tests.review.conftest import make_review
from tests.support.helpers import bearer

pytestmark = pytest.mark.django_db


def new_task(**fields) -> Task:
    task = services.task_create(type="demo.notify", params={"recipients": ["a@example.org"], "subject": "s"})
    if fields:
        Task.objects.filter(pk=task.pk).update(**fields)
    return Task.objects.get(pk=task.pk)


def hhmm(value, now=None) -> str:
    """A moment as the page writes it: "10:42" on `now`'s day (today), with its date on another
    (a deadline 30 minutes away, read at 23:45, is tomorrow's)."""
    local = timezone.localtime(value)
    same_day = now is None or local.date() == timezone.localtime(now).date()
    return f"{local:%H:%M}" if same_day else f"{local:%Y-%m-%d %H:%M}"


def running(now, *, activities, heartbeat_ago=2.0, **fields) -> Task:
    fields.setdefault("status", "running")
    return new_task(lease_owner="host-a:999:abc", lease_epoch=1, worker_host="host-a",
                    worker_pid=999, heartbeat_at=now - timedelta(seconds=heartbeat_ago),
                    claimed_at=now - timedelta(seconds=30), started_at=now - timedelta(seconds=30),
                    activities=activities, **fields)


def page(user, url: str) -> str:
    client = Client()
    client.force_login(user)
    response = client.get(url)
    assert response.status_code == 200
    return response.content.decode()


def shown_lines(html: str) -> list[str]:
    """The waiting-on lines of a page, as text (tags dropped, spaces folded)."""
    return [re.sub(r"\s+", " ", re.sub(r"<[^>]+>", "", line)).strip()
            for line in re.findall(r'<div class="waiting-on[^"]*" data-testid="waiting-on".*?</div>', html, re.S)]


def approval_task(now=None):
    task = new_task(status="waiting", waiting_for=[{"step": "tool-006-1", "type": "approval.decided", "until": None}])
    approval_id = approvals.request(task_id=task.pk, step_id="tool-006-1", tool="email_send", call_id="c1",
                                    arguments={"to": "ops@example.org", "subject": "quarterly numbers"})
    return Task.objects.get(pk=task.pk), approval_id


# --- each reason ---------------------------------------------------------------------------------------------------

def test_an_approval_names_the_call_its_target_the_deadline_and_links_to_the_approval():
    task, approval_id = approval_task()
    from review.models import ReviewItem

    item = ReviewItem.objects.get(pk=approval_id)
    now = timezone.now()
    found = waiting_on(task, now)
    assert found.kind == "approval"
    assert found.text.startswith(f"waiting for approval of email_send to ops@example.org since {hhmm(item.detected_at)} "
                                 f"(approval #{approval_id}")
    assert item.expires_at is not None and found.deadline == item.expires_at
    assert f"deadline {timezone.localtime(item.expires_at):%Y-%m-%d %H:%M})" in found.text  # tomorrow: with its date
    assert (found.link, found.link_text) == (f"/review/{approval_id}/", "open the approval")
    assert found.sentence.endswith(" — open the approval")
    assert found.since == item.detected_at


def test_a_side_effect_in_review_links_to_its_review():
    item = make_review(to="b@example.org")
    found = waiting_on(Task.objects.get(pk=item.task_id), timezone.now())
    assert found.kind == "review"
    assert found.text == (f"waiting for a reviewer to say whether email.send to b@example.org happened, since "
                          f"{hhmm(item.detected_at)} (review #{item.pk})")
    assert (found.link, found.link_text) == (f"/review/{item.pk}/", "open the review")


def test_an_event_wait_names_the_type_the_step_and_the_deadline():
    now = timezone.now()
    until = now + timedelta(minutes=30)
    task = new_task(status="waiting", waiting_until=until,
                    waiting_for=[{"step": "wait-upstream", "type": "upstream.ready", "until": until.isoformat()}])
    found = waiting_on(task, now)
    assert found.kind == "event"
    assert found.text == (f"waiting for the event upstream.ready since {hhmm(task.updated_at)} (step wait-upstream), "
                          f"until {hhmm(until, now)} at the latest")
    assert (found.deadline, found.link) == (until, "")


def test_a_wait_for_an_upstream_data_set_is_a_dependency_naming_it():
    now = timezone.now()
    task = new_task(status="waiting", waiting_for=[
        {"step": "stage-01", "type": "upstream.ready", "until": None, "match": {"resource": "sales-2026-12"}}])
    found = waiting_on(task, now)
    assert found.kind == "dependency"
    assert found.text == (f"waiting for the upstream data set sales-2026-12 (upstream.ready) to be ready since "
                          f"{hhmm(task.updated_at)} (step stage-01)")


def test_a_step_waiting_for_its_subtasks_is_a_dependency():
    now = timezone.now()
    task = running(now, activities=[{"kind": "step", "label": "batch", "since": now.timestamp() - 20},
                                    {"kind": "subtask", "label": "batch/sub-1", "since": now.timestamp() - 12},
                                    {"kind": "subtask", "label": "batch/sub-2", "since": now.timestamp() - 5}])
    found = waiting_on(task, now)
    assert found.kind == "dependency"
    assert found.text.startswith("step batch waits for its subtask batch/sub-2 (and 1 more) for 5 s · worker host-a")


@pytest.mark.django_db(transaction=True)
def test_a_pipeline_waiting_for_its_upstream_says_so_in_the_list_the_page_and_the_api(viewer):
    """A real demo.pipeline, run inline until its first stage parks on `upstream.ready`."""
    from orchestrator.engine.worker import drive_inline

    task = services.task_create(type="demo.pipeline", params={"stages": 1, "seconds_per_stage": 0.05,
                                                              "wait_for_upstream": "sales-2026-12"})
    assert drive_inline(task.pk) == "waiting"
    task = Task.objects.get(pk=task.pk)
    expected = waiting_on(task)
    assert expected.kind == "dependency" and "upstream data set sales-2026-12" in expected.text
    row = re.search(rf'<tr[^>]*data-task-id="{task.pk}".*?</tr>', page(viewer, "/"), re.S).group(0)
    assert 'data-kind="dependency"' in row and "upstream data set sales-2026-12" in row
    assert "upstream data set sales-2026-12" in " ".join(shown_lines(page(viewer, f"/tasks/{task.pk}/")))
    shown = Client().get(f"/api/tasks/{task.pk}", **bearer(viewer)).json()["waiting_on"]
    assert shown["kind"] == "dependency" and shown["text"] == expected.text


def test_a_timer_says_when_it_wakes():
    now = timezone.now()
    task = new_task(status="waiting", waiting_for=[], waiting_until=now + timedelta(minutes=12))
    found = waiting_on(task, now)
    assert found.kind == "timer"
    assert found.text == f"waiting for a timer: wakes at {hhmm(now + timedelta(minutes=12), now)} (in 12 min)"


def test_a_running_tool_names_the_tool_its_pid_how_long_and_the_lease():
    now = timezone.now()
    t = now.timestamp()
    task = running(now, activities=[
        {"kind": "step", "label": "send", "since": t - 14, "token": "root"},
        {"kind": "tool", "label": "email_send", "since": t - 12, "token": "root"},
        {"kind": "subprocess", "label": "pid 1234: sendmail -t", "since": t - 11, "token": "root"}])
    found = waiting_on(task, now)
    assert found.kind == "tool"
    assert found.text == "running email_send (pid 1234) for 12 s · worker host-a (pid 999), heartbeat 2 s ago"
    assert not found.stalled


def test_a_running_tool_without_a_subprocess_shows_the_workers_pid():
    now = timezone.now()
    task = running(now, activities=[{"kind": "tool", "label": "http_request", "since": now.timestamp() - 3}])
    assert waiting_on(task, now).text.startswith("running http_request (pid 999) for 3 s · ")


def test_a_model_stream_says_how_long_and_how_fast():
    now = timezone.now()
    task = running(now, activities=[{"kind": "step", "label": "turn-003", "since": now.timestamp() - 9}])
    attempt = AgentMessage.objects.create(task=task, key="turn-003:g0:attempt:x", turn=3, role="assistant",
                                          interrupted=True, accounted=False, step_id="turn-003",
                                          completion_tokens=400)
    AgentMessage.objects.filter(pk=attempt.pk).update(created_at=now - timedelta(seconds=8))
    found = waiting_on(task, now)
    assert found.kind == "llm"
    assert found.text.startswith("streaming from the model for 8 s (400 tokens, 50 tokens/s) · worker host-a")


def test_a_running_step_and_a_stale_heartbeat():
    now = timezone.now()
    task = running(now, activities=[{"kind": "step", "label": "fetch", "since": now.timestamp() - 5}],
                   heartbeat_ago=75)
    found = waiting_on(task, now)
    assert (found.kind, found.text) == (
        "step", "running step fetch for 5 s · worker host-a (pid 999), no heartbeat for 1 min: the sweeper will "
                "recover it")
    quiet = running(now, activities=[])
    assert waiting_on(quiet, now).text == "running for 30 s · worker host-a (pid 999), heartbeat 2 s ago"
    assert waiting_on(quiet, now).kind == "lease"


def test_pausing_waits_for_the_running_work():
    now = timezone.now()
    task = running(now, activities=[{"kind": "tool", "label": "email_send", "since": now.timestamp() - 4}],
                   status="pausing", control="pause", control_requested_at=now - timedelta(seconds=3))
    found = waiting_on(task, now)
    assert found.kind == "control"
    assert found.text.startswith("pausing (asked 3 s ago): waiting for the running work to end — running email_send")


def test_a_limit_names_the_limit_and_what_was_used():
    task = new_task(status="paused", paused_by_limit="max_tokens", limits={"max_tokens": 1000}, tokens_used=1200)
    found = waiting_on(task, timezone.now())
    assert found.kind == "budget"
    assert found.text == (f"paused at its token limit (1200 of 1000) since {hhmm(task.updated_at)}: "
                          f"raise max_tokens to resume")


def test_a_queued_task_says_its_place_in_the_queue_and_how_long_it_has_waited():
    now = timezone.now()
    first, second, third = (new_task(enqueued_at=now - timedelta(seconds=s)) for s in (90, 40, 5))
    # Elsewhere: a running task between slices is in the queue too; a claimed one and a waiting one are not.
    new_task(status="running", lease_owner="w", heartbeat_at=now)
    new_task(status="waiting")
    Task.objects.exclude(pk__in=[first.pk, second.pk, third.pk]).filter(status="queued").update(status="paused")
    found = with_waiting_on([Task.objects.get(pk=second.pk)], now)[0].waiting_on
    assert (found.kind, found.text) == ("queue", "waiting 40 s for a worker, 2nd of 3 in the queue")
    assert found.since == second.enqueued_at


def test_places_are_counted_over_the_queues_head_only(monkeypatch):
    """Only the first QUEUE_COUNTED tasks of the queue are ranked (every POST /api/tasks answers
    with its place): a task further back is behind "more than" that many, and the head's say
    "of over"."""
    from orchestrator.presenters import waiting

    monkeypatch.setattr(waiting, "QUEUE_COUNTED", 3)
    now = timezone.now()
    queued = [new_task(enqueued_at=now - timedelta(seconds=s)) for s in (50, 40, 30, 20, 10)]
    Task.objects.exclude(pk__in=[t.pk for t in queued]).filter(status="queued").update(status="paused")
    second, fourth, fifth = with_waiting_on([Task.objects.get(pk=queued[i].pk) for i in (1, 3, 4)], now)
    assert second.waiting_on.text == "waiting 40 s for a worker, 2nd of over 3 in the queue"
    assert fourth.waiting_on.text == "waiting 20 s for a worker, behind more than 3 tasks in the queue"
    assert fifth.waiting_on.text == "waiting 10 s for a worker, behind more than 3 tasks in the queue"
    Task.objects.filter(pk__in=[queued[0].pk, queued[1].pk]).update(status="paused")  # three left: all counted
    third = with_waiting_on([Task.objects.get(pk=queued[4].pk)], now)[0]
    assert third.waiting_on.text == "waiting 10 s for a worker, 3rd of 3 in the queue"


def test_the_queues_head_is_read_in_order_from_an_index_without_sorting_the_queue():
    """The head's read takes its order from the partial index task_unclaimed_queue: no sort of
    every task waiting (the cost that grew with the queue)."""
    from orchestrator.presenters.waiting import queue_head_sql

    if connection.vendor != "postgresql":
        pytest.skip("SQLite's indexes keep NULLs first, the queue's order last: it sorts the (small) queue")
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")  # a tiny test table would be read whole
        cursor.execute("EXPLAIN " + queue_head_sql())
        plan = "\n".join(row[0] for row in cursor.fetchall())
    assert "task_unclaimed_queue" in plan and "Limit" in plan, plan
    assert "Sort" not in plan, plan


def test_an_operator_pause_names_who_when_and_why(operator):
    task = new_task()
    services.task_pause(task_id=task.pk, actor=operator, reason="checking the mailbox first")
    task = Task.objects.get(pk=task.pk)
    assert task.status == "paused"
    found = waiting_on(task, timezone.now())
    assert found.kind == "paused"
    assert found.text == (f"paused by {operator.username} since {hhmm(found.since)}: checking the mailbox first "
                          f"— waiting for Resume")


def test_needs_human_says_why():
    task = new_task(status="needs_human", status_reason="the same failure twice: SMTP 550")
    found = waiting_on(task, timezone.now())
    assert (found.kind, found.text) == ("needs_human",
                                        f"needs a person since {hhmm(task.updated_at)}: the same failure twice: SMTP 550")


@pytest.mark.parametrize("status", ["completed", "failed", "stopped", "terminated"])
def test_a_finished_task_waits_on_nothing(status):
    task = new_task(status=status, finished_at=timezone.now(), waiting_until=timezone.now())
    assert waiting_on(task, timezone.now()) is None


def test_a_running_task_whose_step_outlasts_its_types_p95_is_stalled(settings):
    settings.ORCH_STALL_FACTOR = 5.0
    now = timezone.now()
    done = new_task(status="completed")
    for n in range(10):  # p95: 3 s; × 5 = 15 s
        Step.objects.create(task=done, step_id=f"s{n}", position=n, status="done",
                            started_at=now - timedelta(seconds=100), finished_at=now - timedelta(seconds=100 - 1 - n % 3))
    slow = running(now, activities=[{"kind": "step", "label": "send", "since": now.timestamp() - 40}])
    quick = running(now, activities=[{"kind": "step", "label": "send", "since": now.timestamp() - 4}])
    with_waiting_on([slow, quick], now)
    assert slow.waiting_on.stalled and not quick.waiting_on.stalled
    assert "stalled: no step finished for 40 s (over 15 s)" in slow.waiting_on.text
    settings.ORCH_STALL_FACTOR = 0
    assert not waiting_on(slow, now).stalled


# --- one computation for a whole page ------------------------------------------------------------------------------

def test_the_list_costs_a_fixed_number_of_queries(operator):
    now = timezone.now()

    def mixed(n):
        tasks = []
        for i in range(n):
            tasks.append(approval_task()[0])
            tasks.append(Task.objects.get(pk=make_review(to=f"x{i}@example.org").task_id))
            tasks.append(running(now, activities=[{"kind": "step", "label": "turn-001", "since": now.timestamp()}]))
            tasks.append(new_task())
            tasks.append(new_task(status="paused"))
        return tasks

    counts = []
    for n in (1, 4):
        tasks = mixed(n)
        with CaptureQueriesContext(connection) as queries:
            with_waiting_on(tasks, now)
        assert all(t.waiting_on is not None for t in tasks)
        counts.append(len(queries))
    assert counts[0] == counts[1] <= 6


# --- where it is shown ---------------------------------------------------------------------------------------------

def test_the_list_and_the_task_page_show_it_first_paint_and_live_alike(viewer):
    task, approval_id = approval_task()
    done = new_task(status="completed", finished_at=timezone.now())
    fixed = timezone.now()
    task_page.page_clock = lambda: fixed
    try:
        expected = waiting_on(task, fixed).sentence
        listing = page(viewer, "/")
        row = re.search(rf'<tr[^>]*data-task-id="{task.pk}".*?</tr>', listing, re.S).group(0)
        assert shown_lines(row) == [expected]
        assert f'href="/review/{approval_id}/" data-testid="waiting-on-link">open the approval</a>' in row
        done_row = re.search(rf'<tr[^>]*data-task-id="{done.pk}".*?</tr>', listing, re.S).group(0)
        assert 'data-testid="waiting-on"' not in done_row
        # The live row is the same line.
        live_row = fragments.task_rows([task.pk])[0]["html"]
        assert shown_lines(live_row) == [expected]

        detail = page(viewer, f"/tasks/{task.pk}/")
        summary = re.search(r'id="task-summary".*?<div class="task-links">', detail, re.S).group(0)
        assert shown_lines(summary) == [expected]
        assert f'href="/review/{approval_id}/"' in summary
        _, regions = fragments.task_page_regions(task.pk, viewer, "csrf")
        assert shown_lines(regions["task-summary"]) == [expected]
        assert 'data-testid="waiting-on"' not in page(viewer, f"/tasks/{done.pk}/")
    finally:
        task_page.page_clock = timezone.now


def test_a_stalled_task_shows_a_badge_on_the_list(viewer, settings):
    settings.ORCH_STALL_FACTOR = 2.0
    now = timezone.now()
    done = new_task(status="completed")
    for n in range(5):
        Step.objects.create(task=done, step_id=f"s{n}", position=n, status="done",
                            started_at=now - timedelta(seconds=60), finished_at=now - timedelta(seconds=59))
    slow = running(now, activities=[{"kind": "step", "label": "send", "since": now.timestamp() - 120}])
    row = re.search(rf'<tr[^>]*data-task-id="{slow.pk}".*?</tr>', page(viewer, "/"), re.S).group(0)
    assert 'data-testid="stalled-badge"' in row


def test_the_api_returns_it_on_the_task_and_the_list(viewer):
    task, approval_id = approval_task()
    done = new_task(status="completed", finished_at=timezone.now())
    client = Client()
    detail = client.get(f"/api/tasks/{task.pk}", **bearer(viewer)).json()
    assert detail["waiting_on"]["kind"] == "approval"
    assert detail["waiting_on"]["text"].startswith("waiting for approval of email_send to ops@example.org since ")
    assert detail["waiting_on"]["link"] == f"/review/{approval_id}/"
    assert detail["waiting_on"]["link_text"] == "open the approval"
    assert detail["waiting_on"]["deadline"] and detail["waiting_on"]["since"]
    assert detail["waiting_on"]["stalled"] is False
    assert client.get(f"/api/tasks/{done.pk}", **bearer(viewer)).json()["waiting_on"] is None
    items = {row["id"]: row for row in client.get("/api/tasks", **bearer(viewer)).json()["items"]}
    assert items[task.pk]["waiting_on"]["kind"] == "approval"
    assert items[done.pk]["waiting_on"] is None
