"""One base for the errors the harness raises, and control flow a step cannot swallow
(orchestrator/primitives/errors.py)."""
import importlib
import inspect
import pkgutil

import pytest

import orchestrator
import review
from orchestrator.engine import inbox, services
from orchestrator.engine.worker import drive_inline
from demo.models import DemoDestination
from orchestrator.models import Step, Task, WalEntry
from orchestrator.primitives.errors import HarnessError, StepSignal
from review.models import ReviewItem

# Exceptions that never leave the code that raises them: each is caught a few lines away.
INTERNAL = {
    "orchestrator.agent.history.Unsettled": "caught by the agent's turn, which settles the call and asks again",
    "orchestrator.agent.compaction.NothingToCompact": "caught by the compaction step",
    "orchestrator.engine.checkpoint.EventTakenAlready": "caught by the checkpoint, which retries the wait",
    "orchestrator.engine.wal._RecordedEarlier": "caught by wal._perform_in_transaction, which then reads what the "
                                                "earlier execution settled",
    "orchestrator.llm.client._Retry": "the client's retry loop",
    "orchestrator.llm.standin._Aborted": "the stand-in server's own stream loop",
    "orchestrator.primitives.faults.InjectedFault": "the crash tests' fault points (ORCH_FAULTS), never in production",
}


def exception_classes():
    for package in (orchestrator, review):
        for found in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            if ".migrations" in found.name:
                continue
            module = importlib.import_module(found.name)
            for _, cls in inspect.getmembers(module, inspect.isclass):
                if issubclass(cls, BaseException) and cls.__module__ == module.__name__:
                    yield f"{cls.__module__}.{cls.__qualname__}", cls


def test_every_error_the_harness_raises_has_one_base_and_every_signal_is_not_an_exception():
    classes = dict(exception_classes())
    assert len(classes) > 30  # the walk found the harness's exceptions
    loose = [name for name, cls in classes.items()
             if not issubclass(cls, (HarnessError, StepSignal)) and name not in INTERNAL]
    assert loose == []
    assert [name for name in INTERNAL if name not in classes] == []  # the list names what exists
    signals = {name.rsplit(".", 1)[1] for name, cls in classes.items() if issubclass(cls, StepSignal)} - {"StepSignal"}
    assert signals == {"WaitForEvent", "LimitExceeded", "AmbiguousEffect", "LeaseLost"}
    assert not any(issubclass(cls, Exception) for cls in classes.values() if issubclass(cls, StepSignal))


pytestmark = [pytest.mark.task_types("tests.support.testtypes")]


def swallowed(task: Task) -> dict | None:
    step = Step.objects.get(task=task, step_id="careless")
    return step.result if step.status == "done" else None


@pytest.mark.django_db(transaction=True)
def test_a_wait_inside_except_exception_still_parks_the_task():
    task = services.task_create(type="test.swallower", params={"signal": "wait"})
    assert drive_inline(task.pk) == "waiting"
    assert swallowed(task) is None
    inbox.send(task_id=task.pk, type="instruction", payload={"approved": True, "note": "go"})
    assert drive_inline(task.pk) == "completed"
    assert swallowed(Task.objects.get(pk=task.pk))["got"]["note"] == "go"


@pytest.mark.django_db(transaction=True)
def test_an_effect_in_doubt_inside_except_exception_still_goes_to_review(silent_http):
    task = services.task_create(type="test.swallower", params={"signal": "effect", "url": silent_http.url})
    assert drive_inline(task.pk) == "awaiting_review"
    assert swallowed(task) is None and len(silent_http.requests) == 1
    [item] = ReviewItem.objects.filter(task=task, status="open")
    assert item.wal_entry_id == WalEntry.objects.get(task=task).pk


@pytest.mark.django_db(transaction=True)
def test_a_limit_inside_except_exception_still_pauses_the_task():
    task = services.task_create(type="test.swallower", params={"signal": "limit"}, limits={"max_subtasks": 1})
    assert drive_inline(task.pk) == "paused", Step.objects.get(task=task).result
    task.refresh_from_db()
    assert task.status_reason.startswith("limit: max_subtasks") and swallowed(task) is None


@pytest.mark.django_db(transaction=True)
def test_a_lost_lease_inside_except_exception_still_stops_the_step_before_it_acts_again(tmp_path):
    marker = tmp_path / "went-on"
    task = services.task_create(type="test.swallower", params={"signal": "lease", "marker": str(marker)})
    assert drive_inline(task.pk) == "lease lost"
    # The step's code after its `except Exception` never ran: the worker whose task another
    # took did nothing more (the checkpoint's fence alone would only have refused its result).
    assert not marker.exists() and swallowed(task) is None
    assert not DemoDestination.objects.filter(id=800_000 + task.pk).exists()
    assert not WalEntry.objects.filter(task=task).exists()
