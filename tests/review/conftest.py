import pytest
from django.test import Client

from orchestrator.engine import services
from orchestrator.models import Task, WalEntry
from review.services import review_open


def make_review(task: Task | None = None, *, step_id: str = "send-001", call_index: int = 0,
                to: str = "a@example.org", awaiting: bool = True):
    """A real review item: a demo.notify task in awaiting_review whose `email.send` intent
    was written by a worker that then died."""
    if task is None:
        task = services.task_create(type="demo.notify", params={"recipients": [to], "subject": "s"})
    if awaiting:
        Task.objects.filter(pk=task.pk).update(status="awaiting_review")
    entry = WalEntry.objects.create(
        task=task, step_id=step_id, call_index=call_index, tool="email.send",
        args={"to": to, "subject": "s", "body": "hello"},
        idempotency_key=f"t{task.pk}:{step_id}:{call_index}", idempotent=False, lease_epoch=1, worker="host:1")
    return review_open(entry=entry, reason="worker host:1 stopped heartbeating mid-send", dead_worker="host:1")


@pytest.fixture
def review_item(db):
    return make_review()




def logged_in(user) -> Client:
    client = Client()
    client.force_login(user)
    return client
