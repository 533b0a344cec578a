import pytest

from orchestrator.models import NotificationSubscription
from orchestrator.notifications import outbox
from tests.notifications.receiver import Receiver

PUBLIC_URL = "https://orchestrator.example.net"


@pytest.fixture
def start_receiver():
    """start_receiver(script=[500, "hang", 200], hang_seconds=...): a receiver with a secret of its own."""
    receivers = []

    def start(script=(200,), hang_seconds: float = 10.0) -> Receiver:
        receiver = Receiver(secret=outbox.new_secret(), script=list(script), hang_seconds=hang_seconds)
        receivers.append(receiver)
        return receiver

    yield start
    for receiver in receivers:
        receiver.stop()


def subscribe(receiver: Receiver, *, name: str = "ops-hook", events: list[str] | None = None,
              enabled: bool = True) -> NotificationSubscription:
    return NotificationSubscription.objects.create(name=name, url=receiver.url, secret=receiver.secret,
                                                   events=events or [], enabled=enabled)


@pytest.fixture
def people(make_user):
    """Two reviewers, an operator, a viewer, and a reviewer without an email address."""
    users = {name: make_user(name, role) for name, role in
             (("rita", "reviewer"), ("rex", "reviewer"), ("otto", "operator"), ("vera", "viewer"))}
    users["nomail"] = make_user("nomail", "reviewer")
    users["nomail"].email = ""
    users["nomail"].save()
    return users


@pytest.fixture
def public_url(settings):
    settings.ORCH_PUBLIC_URL = PUBLIC_URL
    return PUBLIC_URL
