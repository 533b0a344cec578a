"""Fixtures of the engine's tests."""
import pytest

from orchestrator.engine import scheduler, stranded


@pytest.fixture
def lost_sends(monkeypatch):
    """The broker loses every message (or the process died between the commit and the send):
    nothing reaches the broker; the task ids sent are listed."""
    lost = []
    monkeypatch.setattr(scheduler, "send", lambda task_id: lost.append(task_id))
    # A re-send to the front (a Redis list whose waiting messages are all newer than the backdated
    # hand-over reads as stranded: engine/stranded.py) is lost the same way.
    monkeypatch.setattr(scheduler, "send_first", lambda task_id: lost.append(task_id))
    # Nothing reached the broker, so a look there shows nothing of these tasks (the suite's Redis
    # list may hold another test's messages, which would read as theirs still waiting).
    monkeypatch.setattr(stranded, "look", lambda: None)
    return lost


@pytest.fixture
def use_broker(request, monkeypatch):
    """use_broker(broker, env) puts the worker clusters started with `env` and this process
    (which sends the tasks' messages) on one broker: "redis", a private Redis (its URL is
    returned), or "orm", the database even when the suite runs with REDIS_URL set (before, the
    "orm" runs on PostgreSQL in CI had their clusters on the suite's Redis)."""
    from django_q.conf import Conf

    def use(broker: str, env: dict) -> str | None:
        if broker == "redis":
            redis_url = request.getfixturevalue("private_redis").url
            env["REDIS_URL"] = redis_url
            monkeypatch.setattr(Conf, "ORM", None)
            monkeypatch.setattr(Conf, "BROKER_CLASS", None)
            monkeypatch.setattr(Conf, "REDIS", redis_url)
            return redis_url
        assert broker == "orm", broker
        env["REDIS_URL"] = ""
        monkeypatch.setattr(Conf, "REDIS", None)
        monkeypatch.setattr(Conf, "ORM", "default")
        monkeypatch.setattr(Conf, "BROKER_CLASS", "orchestrator.engine.brokers.OrderedORM")
        return None

    return use
