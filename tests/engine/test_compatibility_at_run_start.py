"""The compatibility gate for tasks that continue without an operator (issue 24, item 7;
engine/run_gate.py): a task recovered after its worker died, or woken by its awaited event, after
a deploy changed its type's code meets its type's policy before a step runs — pin and ask hold it
in `needs_human` with the differences (ask: until an operator accepts them), migrate continues
with the migrated params. A task whose code did not change continues as before. Real engine,
real database, the inline runner (a deploy is the test changing the type's code)."""
from datetime import timedelta

import pytest
from django.utils import timezone

from orchestrator.engine import compat, inbox, recovery, services
from orchestrator.engine.lease import claim
from orchestrator.engine.worker import drive_inline
from orchestrator.models import AuditEntry, NotificationDelivery, Step, Task, TaskEvent
from orchestrator.notifications import TASK_NEEDS_HUMAN
from orchestrator.tasktypes import get_type
from tests.conftest import wait_for
from tests.engine.test_compatibility import change_tool_schema
from tests.notifications.conftest import start_receiver, subscribe  # noqa: F401 (a fixture)
from tests.support import compat_types

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.task_types("tests.support.compat_types")]


def recovered_after_its_worker_died(type_name: str, **params) -> Task:
    """A task that ran its first step, was claimed by a worker that died before it ran the next
    one (its heartbeat went stale), and was recovered by the sweeper: queued for the next worker."""
    task = services.task_create(type=type_name, params=params, limits={"max_steps": 1, "max_subtasks": 1})
    assert drive_inline(task.pk) == "paused"
    assert "tool:compat_lookup" in Task.objects.get(pk=task.pk).compat  # recorded by the run
    services.task_resume(task_id=task.pk, limits={"max_steps": 100})
    assert claim(task.pk) is not None  # the worker that took it, and died
    Task.objects.filter(pk=task.pk).update(heartbeat_at=timezone.now() - timedelta(hours=1))
    assert recovery.recover_task(task.pk)
    task = Task.objects.get(pk=task.pk)
    assert task.recovering_since is not None and task.lease_owner == ""
    return task


def step_results(task: Task) -> dict:
    return dict(Step.objects.filter(task=task).values_list("step_id", "result"))


def test_an_unchanged_recovered_task_continues_as_before():
    task = recovered_after_its_worker_died("test.compat_pin")
    assert drive_inline(task.pk) == "completed"
    assert not TaskEvent.objects.filter(task=task, kind="compat_held").exists()


def test_pin_holds_a_recovered_task_in_needs_human_with_the_differences_and_its_operators_are_told(
        monkeypatch, start_receiver):  # noqa: F811
    receiver = start_receiver()
    subscribe(receiver, events=[TASK_NEEDS_HUMAN])
    task = recovered_after_its_worker_died("test.compat_pin")
    change_tool_schema(monkeypatch)  # the deploy
    assert drive_inline(task.pk) == "needs_human"
    task = Task.objects.get(pk=task.pk)
    assert task.status == "needs_human" and task.lease_owner == ""
    assert "tool compat_lookup: its argument schema changed" in task.status_reason
    assert "recovered after its worker stopped" in task.status_reason and "pin" in task.status_reason
    assert Step.objects.get(task=task, step_id="step-2").status == "pending"  # no step ran on the new code
    held = TaskEvent.objects.get(task=task, kind="compat_held")
    assert held.payload["policy"] == "pin" and [d["key"] for d in held.payload["differences"]] == ["tool:compat_lookup"]
    assert NotificationDelivery.objects.filter(event=TASK_NEEDS_HUMAN).count() == 1
    # Its page shows the differences beside Resume, and Resume stays refused, accepted or not.
    assert compat.for_page(task)["refused"]
    with pytest.raises(compat.IncompatibleResume):
        services.task_resume(task_id=task.pk, accept_changes=True)
    assert Task.objects.get(pk=task.pk).status == "needs_human"


def test_ask_holds_a_recovered_task_until_an_operator_accepts_the_changes(monkeypatch, operator):
    task = recovered_after_its_worker_died("test.compat_ask")
    recorded = task.compat["tool:compat_lookup"]
    change_tool_schema(monkeypatch)
    assert drive_inline(task.pk) == "needs_human"
    task = Task.objects.get(pk=task.pk)
    assert "tool compat_lookup: its argument schema changed" in task.status_reason
    assert "accept_changes" in task.status_reason
    assert task.compat["tool:compat_lookup"] == recorded  # still the code it ran on: nothing admitted
    shown = compat.for_page(task)
    assert shown["needs_acceptance"] and [d["key"] for d in shown["differences"]] == ["tool:compat_lookup"]
    with pytest.raises(compat.IncompatibleResume, match="accept_changes"):
        services.task_resume(task_id=task.pk)
    services.task_resume(task_id=task.pk, accept_changes=True, actor=operator)
    assert drive_inline(task.pk) == "completed"
    assert AuditEntry.objects.get(task=task, action="task.accept_changes").actor == operator
    assert Task.objects.get(pk=task.pk).compat["tool:compat_lookup"] != recorded


def test_migrate_continues_a_recovered_task_with_the_migrated_params(monkeypatch):
    compat_types.MIGRATIONS.clear()
    task = recovered_after_its_worker_died("test.compat_migrate")
    change_tool_schema(monkeypatch)
    assert drive_inline(task.pk) == "completed"
    [(params, differences)] = compat_types.MIGRATIONS
    assert params["label"] == "original" and [d["key"] for d in differences] == ["tool:compat_lookup"]
    task = Task.objects.get(pk=task.pk)
    assert task.params["label"] == "migrated"
    results = step_results(task)
    assert results["step-1"]["label"] == "original"  # finished before the deploy: kept
    assert results["step-2"]["label"] == results["step-3"]["label"] == "migrated"
    entry = AuditEntry.objects.get(task=task, action="task.migrate")
    assert entry.actor is None and entry.after["params"]["label"] == "migrated"
    assert "recovered after its worker stopped" in entry.after["action"]


def test_a_migrate_that_raises_holds_the_recovered_task_with_why(monkeypatch):
    task = recovered_after_its_worker_died("test.compat_migrate", label="refuse")
    change_tool_schema(monkeypatch)
    assert drive_inline(task.pk) == "needs_human"
    assert "a label of 'refuse' cannot be carried over" in Task.objects.get(pk=task.pk).status_reason


def test_a_waiting_task_woken_by_its_event_after_a_deploy_waits_for_an_operator(monkeypatch, settings, operator):
    """demo.pipeline (policy ask, the default) waits for its upstream data set; the deploy raises
    the type's version; the event wakes it: it is held, then runs once the changes are accepted."""
    settings.ORCH_INBOX_MERGE_SECONDS = 0.2
    settings.ORCH_INBOX_MERGE_CAP_SECONDS = 0.5
    task = services.task_create(type="demo.pipeline", params={"stages": 2, "seconds_per_stage": 0.05,
                                                              "wait_for_upstream": "sales"})
    assert drive_inline(task.pk) == "waiting"
    assert Task.objects.get(pk=task.pk).compat["version"] == "1"
    monkeypatch.setattr(type(get_type("demo.pipeline")), "version", "2")  # the deploy
    inbox.send(task_id=task.pk, type="upstream.ready", payload={"resource": "sales"}, merge_key="sales")

    def driven():
        recovery.wake_expired_waits()
        return drive_inline(task.pk) == "needs_human"

    wait_for(driven, timeout=30, interval=0.2, message="the woken task to meet the gate")
    task = Task.objects.get(pk=task.pk)
    assert "the task type's version changed: 1 → 2" in task.status_reason
    assert "woken from its wait" in task.status_reason
    assert Step.objects.get(task=task, step_id="stage-01").status == "pending"
    held = TaskEvent.objects.get(task=task, kind="compat_held")
    assert held.payload["how"] == "woken from its wait"
    services.task_resume(task_id=task.pk, accept_changes=True, actor=operator)

    def completed():
        recovery.wake_expired_waits()  # the event may still be in its merge window: the task waits for it
        return drive_inline(task.pk) == "completed" or Task.objects.get(pk=task.pk).status == "completed"

    wait_for(completed, timeout=30, interval=0.2, message="the accepted task to complete")
    assert Step.objects.get(task=task, step_id="stage-01").result["upstream"] == {"resource": "sales"}
    assert not TaskEvent.objects.filter(task=task, kind="compat_held").exclude(pk=held.pk).exists()


@pytest.mark.task_types("tests.support.testtypes")
def test_a_waiting_task_woken_by_its_timer_after_a_deploy_waits_for_an_operator(monkeypatch, operator):
    task = services.task_create(type="test.approval", params={"timeout": 0.5})
    assert drive_inline(task.pk) == "waiting"
    monkeypatch.setattr(type(get_type("test.approval")), "version", "2")  # the deploy
    wait_for(lambda: recovery.wake_expired_waits() == [task.pk], timeout=30, interval=0.1,
             message="the wait's timer to fire")
    assert drive_inline(task.pk) == "needs_human"
    task = Task.objects.get(pk=task.pk)
    assert "the task type's version changed: 1 → 2" in task.status_reason
    assert "woken from its wait" in task.status_reason
    assert Step.objects.get(task=task, step_id="await").status == "pending"
    services.task_resume(task_id=task.pk, accept_changes=True, actor=operator)
    assert drive_inline(task.pk) == "completed"
    assert Step.objects.get(task=task, step_id="finish").result == "not paid"  # the timer's outcome, kept
