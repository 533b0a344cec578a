"""A real stand-in model server on a free port, and clients of it through the real `openai`
package: every test here goes over HTTP."""
import pytest

from orchestrator.llm.client import LLMClient, RetryPolicy
from orchestrator.llm.standin import STANDIN_MODEL, StandinServer

# Fast, but not zero: the stream still arrives as separate chunks with time between them.
TEST_TOKEN_SECONDS = 0.001


@pytest.fixture(scope="module")
def standin():
    with StandinServer(token_seconds=TEST_TOKEN_SECONDS) as server:
        yield server


@pytest.fixture
def make_client(standin):
    clients = []

    def make(server=None, *, model: str = STANDIN_MODEL, **retry) -> LLMClient:
        policy = RetryPolicy(**{"max_attempts": 3, "base_delay": 0.01, "max_delay": 0.05, **retry})
        client = LLMClient(base_url=(server or standin).base_url, api_key="standin", model=model,
                           connect_timeout=2, read_timeout=5, retry=policy)
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()
