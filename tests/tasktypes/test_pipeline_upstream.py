"""demo.pipeline acts on `upstream.ready` (issue 20, item 11): with `wait_for_upstream` its
first stage waits, holding no worker, for the named data set; an event naming another data
set leaves it waiting; the right one runs it to completion. Real engine, real database, real
stage subprocesses (inline runner)."""
import pytest

from orchestrator.engine import inbox, recovery, services
from orchestrator.engine.worker import drive_inline
from orchestrator.models import InboundEvent, Step, Task
from tests.conftest import wait_for

pytestmark = pytest.mark.django_db(transaction=True)


def pipeline(**params) -> Task:
    return services.task_create(type="demo.pipeline", params={"stages": 2, "seconds_per_stage": 0.05, **params})


def upstream_ready(task: Task, resource: str, **kwargs):
    return inbox.send(task_id=task.pk, type="upstream.ready", payload={"resource": resource}, **kwargs).event


def drive_until_settled(task_id: int) -> str:
    """The inline runner hands a task back between slices ('sliced'); drive it until it
    ends up somewhere that needs nothing more from a worker right now."""
    outcome = drive_inline(task_id)
    for _ in range(20):
        if outcome != "sliced":
            return outcome
        outcome = drive_inline(task_id)
    raise AssertionError(f"task #{task_id} kept being handed back (busy loop): {outcome}")


def test_the_first_stage_waits_for_its_upstream_data_set_and_nothing_else_wakes_it(settings):
    task = pipeline(wait_for_upstream="sales-2026-12")
    assert drive_until_settled(task.pk) == "waiting"
    task = Task.objects.get(pk=task.pk)
    assert task.status == "waiting" and task.lease_owner == ""  # holds no worker
    assert task.waiting_for[0]["step"] == "stage-01" and task.waiting_for[0]["type"] == "upstream.ready"
    assert Step.objects.get(task=task, step_id="stage-01").status == "pending"

    other = upstream_ready(task, "inventory-2026-12", merge_key="inventory-2026-12")
    task = Task.objects.get(pk=task.pk)
    assert task.status == "waiting", task.status_reason  # another data set does not wake it
    assert drive_inline(task.pk) == "not claimed"  # nothing for a worker to do
    assert Step.objects.get(task=task, step_id="stage-01").status == "pending"

    right = upstream_ready(task, "sales-2026-12", merge_key="sales-2026-12")
    assert Task.objects.get(pk=task.pk).status == "queued"  # woken by the send
    # Visible after the merge window (a burst of the same group collapses into one): until
    # then the task waits again with that moment as its deadline, and the sweeper wakes it.
    wait_for(lambda: recovery.wake_expired_waits() or drive_until_settled(task.pk) == "completed",
             timeout=30, interval=0.2, message="the pipeline to run once its upstream is ready")
    if Task.objects.get(pk=task.pk).status != "completed":
        assert drive_until_settled(task.pk) == "completed"
    task = Task.objects.get(pk=task.pk)
    assert task.status == "completed"
    first = Step.objects.get(task=task, step_id="stage-01")
    assert first.result["upstream"] == {"resource": "sales-2026-12"} and first.result["count"] == 20000
    assert Step.objects.get(task=task, step_id="stage-02").status == "done"
    assert InboundEvent.objects.get(pk=right.pk).outcome == "received by the wait of step stage-01"
    assert InboundEvent.objects.get(pk=other.pk).state != "consumed"  # never taken for the wrong data set


def test_the_wait_is_woken_when_the_event_becomes_visible_after_the_merge_window(settings):
    """upstream.ready is mergeable: it becomes visible ORCH_INBOX_MERGE_SECONDS after it was
    sent. The task must not go back to sleep for good in between."""
    settings.ORCH_INBOX_MERGE_SECONDS = 0.5
    settings.ORCH_INBOX_MERGE_CAP_SECONDS = 1.0
    task = pipeline(wait_for_upstream="sales")
    assert drive_until_settled(task.pk) == "waiting"
    upstream_ready(task, "sales")
    assert Task.objects.get(pk=task.pk).status == "queued"  # woken by the send
    assert drive_until_settled(task.pk) == "waiting"  # not visible yet: waits again...
    task = Task.objects.get(pk=task.pk)
    assert task.waiting_until is not None  # ...with the moment it becomes visible as a deadline
    wait_for(lambda: recovery.wake_expired_waits(), timeout=10, message="the sweeper to wake it")
    assert drive_until_settled(task.pk) == "completed"


def test_without_the_param_it_starts_at_once_and_an_upstream_event_changes_nothing():
    task = pipeline()
    assert drive_until_settled(task.pk) == "completed"


def test_the_param_is_validated():
    with pytest.raises(Exception, match="wait_for_upstream"):
        pipeline(wait_for_upstream="x" * 501)
