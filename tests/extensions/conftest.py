import pytest

from examples.tickets.tracker import TicketTracker


@pytest.fixture
def tracker(monkeypatch):
    """The example's ticket tracker, a real HTTP server on a free port (TICKETS_URL points at it
    for this process; give it to the workers' environment too)."""
    server = TicketTracker().start()
    monkeypatch.setenv("TICKETS_URL", server.url)
    yield server
    server.after_write = None
    server.stop()
