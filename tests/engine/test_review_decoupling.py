"""Review depends on the engine, never the reverse (issue 23, item 4). The engine records what
needs a person (an effect in doubt, a call awaiting approval) in its own record (ReviewItem,
orchestrator/models.py) and opens, expires and revokes it itself; the review queue lists those
records and decides them through the engine's services.

Beyond the import contract (pyproject.toml, tests/test_layers.py): while the engine runs, not
one line of the review app's code executes — no signal, no lazy import, no registry lookup
reaches it — and what the engine recorded is what the queue then lists."""
import re
import sys
import threading
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import pytest
from django.db import transaction
from django.utils import timezone

from orchestrator.engine import approvals, reviews, services
from orchestrator.engine.recovery import recover_task
from orchestrator.engine.worker import drive_inline
from orchestrator.models import InboundEvent, ReviewItem, Task, WalEntry
from orchestrator.tools.catalog import get_tool

ROOT = Path(__file__).resolve().parents[2]
REVIEW_APP = str(ROOT / "review") + "/"
# A signal, or the review app reached by name: a registry lookup, a dotted path to import.
LOOKUP = (r"\bSignal\(|get_model\(\s*[\"']review\b|get_app_config\(\s*[\"']review\b"
          r"|[\"']review\.(?:models|services|selectors|approvals|apps|presenters|views|admin)\b"
          r"|^\s*(?:from|import) review\b")
# The core: what the engine and everything under it is made of.
CORE = ["orchestrator/engine", "orchestrator/tools", "orchestrator/llm", "orchestrator/agent",
        "orchestrator/tasktypes", "orchestrator/primitives", "orchestrator/models.py"]


@contextmanager
def review_app_not_consulted():
    """Fails if any function of the review app (review/*.py) runs inside the block, in this
    thread or one it starts (a step's thread)."""
    ran: list[str] = []

    def watch(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(REVIEW_APP):
            ran.append(f"{frame.f_code.co_filename}:{frame.f_code.co_name}")

    sys.setprofile(watch)
    threading.setprofile(watch)
    try:
        yield
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    assert not ran, f"the engine consulted the review app: {sorted(set(ran))}"


def queue_lists(item: ReviewItem) -> bool:
    """The review queue's own list (its selector, as its page and the API read it)."""
    from review.selectors import review_list

    return item.pk in {i.pk for i in review_list(status="open", task_id=item.task_id)}


def test_the_guard_sees_the_review_app_when_it_runs():
    from review.selectors import review_list

    with pytest.raises(AssertionError, match=r"review/selectors\.py:review_list"):
        with review_app_not_consulted():
            review_list()


def test_the_core_has_no_signal_and_no_lookup_of_the_review_app():
    found = []
    for top in CORE:
        paths = [ROOT / top] if top.endswith(".py") else sorted((ROOT / top).rglob("*.py"))
        for path in paths:
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if re.search(LOOKUP, line) and "getLogger(" not in line:
                    found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, "\n".join(found)


@pytest.mark.django_db(transaction=True)
@pytest.mark.task_types("tests.support.testtypes")
def test_an_effect_in_doubt_is_recorded_by_the_engine_alone_and_the_queue_lists_it(silent_http):
    task = services.task_create(type="test.swallower", params={"signal": "effect", "url": silent_http.url})
    with review_app_not_consulted():
        assert drive_inline(task.pk) == "awaiting_review"
    [item] = ReviewItem.objects.filter(task=task, status="open")
    assert item.kind == "effect" and item.wal_entry_id == WalEntry.objects.get(task=task).pk
    assert queue_lists(item)


@pytest.mark.django_db(transaction=True)
@pytest.mark.task_types("tests.support.probe_types")
def test_recovery_of_a_dead_workers_effect_in_doubt_needs_no_review_app():
    """A worker died between the intent and the outcome of a non-idempotent call whose probe
    cannot tell (no status URL): recovery records the item and the task waits for a person."""
    args = {"method": "POST", "url": "http://192.0.2.1/orders", "json": {"order": "o-1"}}
    task = services.task_create(type="test.one_effect", params={"tool": "http.request", "args": args})
    Task.objects.filter(pk=task.pk).update(status="running", lease_owner="host:1", lease_epoch=1,
                                           heartbeat_at=timezone.now() - timedelta(hours=1))
    entry = WalEntry.objects.create(task=task, step_id="effect", call_index=0, tool="http.request",
                                    args=get_tool("http.request").wal_args(args), idempotent=False,
                                    idempotency_key=f"t{task.pk}:effect:0", lease_epoch=1, worker="host:1")
    with review_app_not_consulted():
        assert recover_task(task.pk)
    assert Task.objects.get(pk=task.pk).status == "awaiting_review"
    [item] = ReviewItem.objects.filter(task=task, status="open")
    assert item.wal_entry_id == entry.pk and item.dead_worker == "host:1" and "probe" in item.evidence
    assert queue_lists(item)


@pytest.mark.django_db(transaction=True)
def test_an_approval_is_opened_expired_and_revoked_by_the_engine_alone():
    task = services.task_create(type="agent.plan_execute", params={"goal": "email the totals", "tools": ["email_send"]})
    asked = dict(task_id=task.pk, step_id="tool-002-1", tool="email_send", arguments={"to": ["a@example.org"]},
                 call_id="call_1", policy=approvals.Policy(timeout_seconds=0))
    with review_app_not_consulted():
        approval_id = approvals.request(**asked)
        assert approvals.request(**asked) == approval_id  # asked again: the same record
        second = approvals.request(**{**asked, "call_id": "call_2", "policy": approvals.Policy(timeout_seconds=3600)})
    item = ReviewItem.objects.get(pk=approval_id)
    assert item.kind == "approval" and item.status == "open" and queue_lists(item)
    with review_app_not_consulted():
        assert reviews.expire_due(now=timezone.now() + timedelta(seconds=1)) == [approval_id]
        with transaction.atomic():
            assert approvals.revoke(task_id=task.pk, reason="the task ended") == [second]
    assert ReviewItem.objects.get(pk=approval_id).status == "expired"
    assert ReviewItem.objects.get(pk=second).status == "revoked"
    [event] = InboundEvent.objects.filter(task=task, type="approval.decided")
    assert event.payload["approval_id"] == str(approval_id) and event.payload["expired"] is True
