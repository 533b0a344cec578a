"""The example's tools against its tracker, in this process: what each failure means (refused
or unreachable: not performed; the answer lost after the request left: unknown), a cancelled call
closes its connection at once, and the keyed tool's probe asks the tracker by key."""
import threading
import time

import pytest

from orchestrator import extensions
from orchestrator.primitives.cancellation import CancellationToken, Cancelled
from orchestrator.tools.base import OutcomeUnknown, ProbeResult, ToolError
from orchestrator.tools.catalog import get_tool
from tests.conftest import free_port, wait_for

KEY = "t7:open:0"
TICKET = {"title": "Printer on fire", "body": "smoke"}


@pytest.fixture(autouse=True)
def tickets(settings):
    settings.ORCH_EXTENSIONS = ["examples.tickets"]
    extensions.require()  # what every process does at start-up


def perform(name: str, args: dict, token: CancellationToken | None = None, key: str = KEY):
    return get_tool(name).perform(args, key=key, token=token or CancellationToken())


def test_the_probe_finds_a_ticket_by_its_key_and_says_when_there_is_none(tracker):
    create = get_tool("tickets_create")
    assert create.probe(TICKET, key=KEY).state == ProbeResult.NOT_DONE
    made = perform("tickets_create", TICKET)
    assert perform("tickets_create", TICKET) == made and len(tracker.tickets) == 1  # the key drops the repeat
    found = create.probe(TICKET, key=KEY)
    assert found.state == ProbeResult.DONE and found.result == made
    assert found.how == f"GET /tickets/by-key/t7%3Aopen%3A0: 200, ticket #{made['id']}"
    tracker.stop()
    assert create.probe(TICKET, key=KEY).state == ProbeResult.UNKNOWN  # nobody to ask: a reviewer decides


def test_an_unreachable_tracker_or_a_refusal_is_not_performed(tracker, monkeypatch):
    with pytest.raises(ToolError, match="the tracker refused it \\(404: there is no ticket 9\\)"):
        perform("tickets_comment", {"ticket": 9, "text": "hello"})
    monkeypatch.setenv("TICKETS_URL", f"http://127.0.0.1:{free_port()}")
    with pytest.raises(ToolError, match="cannot be reached"):
        perform("tickets_create", TICKET)


def test_an_answer_lost_after_the_tracker_acted_is_an_unknown_outcome(tracker):
    def crash(what):
        raise ConnectionAbortedError("the tracker died before answering")

    tracker.after_write = crash
    with pytest.raises(OutcomeUnknown, match="no answer from the tracker"):
        perform("tickets_create", TICKET)
    assert len(tracker.tickets) == 1  # it did happen: unknown was the right answer


def test_a_cancelled_call_closes_its_connection_at_once_and_its_outcome_is_unknown(tracker):
    release = threading.Event()
    tracker.after_write = lambda what: release.wait(30)
    token = CancellationToken()
    errors = []

    def call():
        try:
            perform("tickets_comment", {"ticket": 1, "text": "hello"}, token=token)
        except Exception as exc:
            errors.append((exc, time.monotonic()))

    tracker.tickets[1] = {"id": 1, "title": "t", "body": "", "key": "", "comments": []}
    thread = threading.Thread(target=call)
    thread.start()
    try:
        wait_for(lambda: tracker.comments(), message="the comment to reach the tracker")
        cancelled = time.monotonic()
        token.cancel("stopped by an operator")
        thread.join(5)
    finally:
        release.set()
    [(error, at)] = errors
    assert isinstance(error, OutcomeUnknown) and "cancelled" in str(error)
    assert at - cancelled < 1.0


def test_a_call_cancelled_before_it_was_sent_is_not_performed(tracker):
    token = CancellationToken()
    token.cancel("stopped")
    with pytest.raises(Cancelled):
        perform("tickets_create", TICKET, token=token)
    assert tracker.requests == []
