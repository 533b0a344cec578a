"""Fixtures of the engine's tests."""
import pytest

from orchestrator.engine import scheduler


@pytest.fixture
def lost_sends(monkeypatch):
    """The broker loses every message (or the process died between the commit and the send):
    nothing reaches the broker; the task ids sent are listed."""
    lost = []
    monkeypatch.setattr(scheduler, "send", lambda task_id: lost.append(task_id))
    # A re-send to the front (a Redis list whose waiting messages are all newer than the backdated
    # hand-over reads as stranded: engine/stranded.py) is lost the same way.
    monkeypatch.setattr(scheduler, "send_first", lambda task_id: lost.append(task_id))
    return lost
