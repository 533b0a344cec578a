"""The example extension (examples/tickets, loaded through ORCH_EXTENSIONS) on real worker
processes against its real tracker: its task type and its tools go through the WAL like the
built-ins and survive kill -9 like them (a keyed call replayed with its key, a non-idempotent one
in front of a reviewer, a keyed call in doubt on a terminated task settled by its probe); an agent
calls the read tool at once and the non-idempotent one only after a reviewer approved it."""
import threading

import pytest

from orchestrator.engine import services
from orchestrator.models import AgentMessage, Task, WalEntry
from review.models import ReviewItem
from review.services import review_decide
from tests.conftest import wait_for
from tests.support.attacker_model import AttackerModel
from tests.support.helpers import settle

pytestmark = [pytest.mark.workers, pytest.mark.django_db(transaction=True)]

TICKETS = "examples.tickets"


@pytest.fixture(autouse=True)
def tickets(settings):
    settings.ORCH_EXTENSIONS = [TICKETS]


def env(tracker, **overrides) -> dict:
    return {"ORCH_EXTENSIONS": TICKETS, "TICKETS_URL": tracker.url, **overrides}


def posts(tracker, path: str) -> int:
    return sum(1 for method, p in tracker.requests if (method, p) == ("POST", path))


def escalate(**params) -> Task:
    return services.task_create(type="tickets.escalate",
                                params={"title": "Printer on fire", "body": "smoke", "comment": "on it", **params})


def test_the_task_type_runs_on_workers_and_its_side_effects_go_through_the_wal(tracker, start_workers):
    start_workers(1, **env(tracker))
    task = settle(escalate().pk, timeout=90)
    assert task.status == "completed", task.status_reason
    [ticket] = tracker.tickets.values()
    assert ticket["title"] == "Printer on fire" and [c["text"] for c in ticket["comments"]] == ["on it"]
    assert task.steps.get(step_id="report").result == {"ticket": 1, "opened": True, "comment": 1}
    entries = {e.tool: e for e in WalEntry.objects.filter(task=task)}
    assert set(entries) == {"tickets_create", "tickets_comment"}  # the search is a read: no entry
    create, comment = entries["tickets_create"], entries["tickets_comment"]
    assert (create.status, create.idempotent, create.idempotency_key) == ("done", True, f"t{task.pk}:open:0")
    assert (comment.status, comment.idempotent) == ("done", False)
    assert ticket["key"] == create.idempotency_key  # the key travelled to the tracker
    # A second escalation of the same title finds the ticket and only comments.
    again = settle(escalate(comment="still burning").pk, timeout=90)
    assert again.status == "completed" and len(tracker.tickets) == 1
    assert [c["text"] for c in tracker.tickets[1]["comments"]] == ["on it", "still burning"]


def test_kill_9_after_the_tracker_opened_the_ticket_replays_the_call_with_its_key(tracker, start_workers, tmp_path):
    start_workers(1, **env(tracker, ORCH_FAULTS="after_effect@open:kill-once", ORCH_VAR_DIR=tmp_path))
    task = settle(escalate().pk, timeout=90)
    assert (tmp_path / "faults" / "after_effect@open").exists(), "the crash did not happen"
    assert task.status == "completed", task.status_reason
    assert task.recovery_attempts == 1
    # Sent twice with the same key, opened once: the tracker answered the replay with the first ticket.
    assert posts(tracker, "/tickets") == 2 and len(tracker.tickets) == 1
    entry = WalEntry.objects.get(task=task, tool="tickets_create")
    assert entry.status == "done" and entry.result["id"] == 1 and tracker.by_key == {entry.idempotency_key: 1}
    assert not ReviewItem.objects.filter(task=task).exists()


def test_kill_9_after_the_comment_went_out_goes_to_review_and_it_is_never_sent_twice(
        tracker, start_workers, tmp_path, make_user):
    start_workers(1, **env(tracker, ORCH_FAULTS="after_effect@comment:kill-once", ORCH_VAR_DIR=tmp_path))
    task = settle(escalate().pk, timeout=90)
    assert (tmp_path / "faults" / "after_effect@comment").exists(), "the crash did not happen"
    assert task.status == "awaiting_review", task.status_reason
    [item] = ReviewItem.objects.filter(task=task)
    assert item.wal_entry.tool == "tickets_comment" and item.wal_entry.status == "pending"
    assert len(tracker.comments()) == 1  # it did go out: the reviewer can see it on the ticket
    review_decide(item_id=item.pk, decision="happened", note="it is on the ticket",
                  actor=make_user("rita", "reviewer"))
    task = settle(task.pk, timeout=60)
    assert task.status == "completed", task.status_reason
    assert len(tracker.comments()) == 1 and posts(tracker, "/tickets/1/comments") == 1


def test_a_keyed_call_in_doubt_when_the_task_is_terminated_is_settled_by_its_probe(tracker, start_workers):
    release = threading.Event()
    tracker.after_write = lambda what: release.wait(60) if what.startswith("ticket") else None
    start_workers(1, **env(tracker))
    try:
        task = escalate(comment="")
        wait_for(lambda: len(tracker.tickets) == 1, timeout=60, message="the tracker to open the ticket")
        wait_for(lambda: WalEntry.objects.filter(task=task, status="pending").exists(), message="the intent")
        services.task_terminate(task_id=task.pk, reason="test: the tracker hangs")
        wait_for(lambda: Task.objects.get(pk=task.pk).status == "terminated", timeout=60, message="terminated")
    finally:
        release.set()
    entry = WalEntry.objects.get(task=task)
    # Nobody was asked: the probe asked the tracker by key, which had opened the ticket.
    assert (entry.status, entry.settled_by, entry.result["id"]) == ("done", "probe", 1)
    assert "GET /tickets/by-key/" in entry.error and ": 200, ticket #1" in entry.error
    assert not ReviewItem.objects.filter(task=task).exists()
    assert posts(tracker, "/tickets") == 1


def test_an_agent_calls_the_read_tool_at_once_with_no_reviewer_and_no_wal_entry(tracker, start_workers,
                                                                                 standin_server):
    tracker.tickets[1] = {"id": 1, "title": "printer jam", "body": "tray 2", "key": "", "comments": []}
    start_workers(1, **env(tracker, LLM_BASE_URL=standin_server.base_url, LLM_API_KEY="standin",
                          LLM_MODEL="standin-planner"))
    task = services.task_create(type="agent.plan_execute",
                                params={"goal": "Search the tickets: printer", "tools": ["tickets_search"]})
    task = settle(task.pk, timeout=90)
    assert task.status == "completed", task.status_reason
    assert ("GET", "/tickets") in tracker.requests
    answer = AgentMessage.objects.get(task=task, role="tool", name="tickets_search")
    assert answer.content.startswith('{"tickets": [')
    assert not ReviewItem.objects.filter(task=task).exists() and not WalEntry.objects.filter(task=task).exists()


def test_an_agents_non_idempotent_call_runs_only_after_a_reviewer_approved_it(
        tracker, start_workers, operator, reviewer):
    tracker.tickets[1] = {"id": 1, "title": "printer jam", "body": "tray 2", "key": "", "comments": []}
    script = [("tickets_comment", {"ticket": 1, "text": "fixed: the tray was jammed"})]
    with AttackerModel(script) as model:
        start_workers(1, **env(tracker, LLM_BASE_URL=model.base_url, LLM_MODEL="scripted", LLM_MAX_ATTEMPTS=1))
        task = services.task_create(type="agent.plan_execute", actor=operator,
                                    params={"goal": "Close the printer ticket", "tools": ["tickets_comment"]})
        item = wait_for(lambda: ReviewItem.objects.filter(task=task, kind="approval", status="open").first(),
                        timeout=60, message="the approval item")
        wait_for(lambda: Task.objects.get(pk=task.pk).status == "waiting", timeout=30,
                 message="the task to wait (holding no worker)")
        assert item.proposal["tool"] == "tickets_comment" and "not idempotent" in item.reason
        assert tracker.comments() == [] and not WalEntry.objects.filter(task=task).exists()
        review_decide(item_id=item.pk, decision="approve", note="fine", actor=reviewer)
        task = settle(task.pk, timeout=90)
    assert task.status == "completed", task.status_reason
    assert [c["text"] for c in tracker.comments()] == ["fixed: the tray was jammed"]
    entry = WalEntry.objects.get(task=task)
    assert (entry.tool, entry.status, entry.idempotent) == ("tickets_comment", "done", False)


def test_kill_9_after_an_agents_keyed_call_reached_the_tracker_replays_it_with_its_key(
        tracker, start_workers, tmp_path):
    script = [("tickets_create", {"title": "printer jam", "body": "tray 2"})]
    with AttackerModel(script) as model:
        start_workers(1, **env(tracker, LLM_BASE_URL=model.base_url, LLM_MODEL="scripted", LLM_MAX_ATTEMPTS=1,
                               ORCH_FAULTS="after_effect:kill-once", ORCH_VAR_DIR=tmp_path))
        task = services.task_create(type="agent.plan_execute",
                                    params={"goal": "File the printer ticket", "tools": ["tickets_create"]})
        task = settle(task.pk, timeout=90)
    assert (tmp_path / "faults" / "after_effect").exists(), "the crash did not happen"
    assert task.status == "completed", task.status_reason
    assert task.recovery_attempts == 1
    assert posts(tracker, "/tickets") == 2 and len(tracker.tickets) == 1
    answer = AgentMessage.objects.get(task=task, role="tool", name="tickets_create")
    assert '"id": 1' in answer.content
