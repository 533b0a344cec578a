"""orchestrator.llm.client through the real `openai` package against the real stand-in server."""
import json
import re
import threading
import time

import pytest

from orchestrator.llm import (
    LLMCancelled,
    LLMRequestRejected,
    LLMStreamCut,
    LLMUnavailable,
    chat,
    client_from_settings,
    tool_result_message,
)
from orchestrator.llm.standin import STANDIN_MODEL, StandinServer
from orchestrator.primitives.cancellation import CancellationToken
from tests.conftest import free_port, wait_for

from .helpers import contract_tools, requests_for

GOAL = "Parse the 3 contracts and email a summary to boss@example.org"


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_streamed_content_is_assembled_and_handed_to_on_token(make_client):
    pieces = []
    completion = make_client().chat(ask("Tell me about the streaming of content"), on_token=pieces.append)
    assert completion.finish_reason == "stop" and not completion.partial
    assert "streaming of content" in completion.content
    assert len(pieces) > 5 and "".join(pieces) == completion.content
    assert completion.tool_calls == [] and completion.attempts == 1
    assert completion.assistant_message() == {"role": "assistant", "content": completion.content}


def test_tool_call_fragments_are_assembled_by_index_with_their_ids(make_client):
    history = ask(GOAL) + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "l1", "type": "function", "function": {"name": "contracts.list", "arguments": '{"limit": 3}'}}]},
        tool_result_message("l1", ["c-01", "c-02", "c-03"])]
    completion = make_client().chat(history, tools=contract_tools())
    assert completion.finish_reason == "tool_calls"
    assert [(c.name, c.parsed_arguments()) for c in completion.tool_calls] == [
        ("contracts.read", {"contract_id": f"c-0{i}"}) for i in (1, 2, 3)]
    ids = [c.id for c in completion.tool_calls]
    assert all(re.fullmatch(r"call_[0-9a-f]{12}", i) for i in ids) and len(set(ids)) == 3
    assert completion.assistant_message()["tool_calls"][2] == {
        "id": ids[2], "type": "function", "function": {"name": "contracts.read", "arguments": '{"contract_id": "c-03"}'}}


def test_usage_is_read_from_the_usage_chunk(make_client, standin):
    completion = make_client().chat(ask("How many tokens does this take?"))
    usage = completion.usage
    assert not usage.estimated
    assert usage.completion_tokens == len(re.findall(r"\s*\S+", completion.content))
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    sent = requests_for(standin, STANDIN_MODEL)[-1].body
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}


def test_usage_is_estimated_and_flagged_when_the_server_sends_none(make_client):
    completion = make_client(model=STANDIN_MODEL + "+no-usage").chat(ask("No usage for this one, please"))
    assert completion.finish_reason == "stop"
    assert completion.usage.estimated
    assert completion.usage.completion_tokens == -(-len(completion.content) // 4)
    assert completion.usage.prompt_tokens > 0


def test_a_429_is_retried_after_the_time_retry_after_asks_for(make_client, standin):
    model = STANDIN_MODEL + "+429=0.4@1"
    started = time.monotonic()
    completion = make_client(model=model, base_delay=0.01).chat(ask("Rate limit me once"))
    elapsed = time.monotonic() - started
    assert completion.finish_reason == "stop" and completion.attempts == 2
    assert [r.status for r in requests_for(standin, model)] == [429, 200]
    assert elapsed >= 0.4  # the back-off alone would be 0.01 s


def test_500s_until_the_attempts_run_out_raise_llm_unavailable(make_client, standin):
    model = STANDIN_MODEL + "+500"
    with pytest.raises(LLMUnavailable) as failure:
        make_client(model=model, max_attempts=3).chat(ask("Fail me"))
    assert [r.status for r in requests_for(standin, model)] == [500, 500, 500]
    message = str(failure.value)
    assert standin.base_url in message and "after 3 attempts" in message and "HTTP 500" in message
    assert failure.value.status_code == 500 and failure.value.attempts == 3


def test_a_server_nobody_runs_raises_llm_unavailable_saying_what_to_check(make_client):
    class Nowhere:
        base_url = f"http://127.0.0.1:{free_port()}/v1"

    with pytest.raises(LLMUnavailable) as failure:
        make_client(Nowhere, max_attempts=2).chat(ask("anyone there?"))
    assert "cannot connect" in str(failure.value) and "LLM_BASE_URL" in str(failure.value)


def test_an_unknown_model_is_rejected_without_retrying(make_client, standin):
    with pytest.raises(LLMRequestRejected) as failure:
        make_client(model="gpt-nonexistent").chat(ask("hello"))
    assert failure.value.status_code == 404 and "LLM_MODEL" in str(failure.value)
    assert len(requests_for(standin, "gpt-nonexistent")) == 1


def test_a_cut_stream_raises_llm_stream_cut_with_the_partial_answer(make_client):
    full = make_client().chat(ask("Cut this answer somewhere in the middle please"))
    with pytest.raises(LLMStreamCut) as failure:
        make_client(model=STANDIN_MODEL + "+cut").chat(ask("Cut this answer somewhere in the middle please"))
    partial = failure.value.partial
    assert partial.stream_cut and partial.finish_reason is None
    assert 0 < len(partial.content) < len(full.content)
    assert full.content.startswith(partial.content)
    assert partial.usage.estimated
    assert "partial answer is kept" in str(failure.value)


def test_a_server_that_stalls_past_the_read_timeout_is_a_cut_stream(make_client):
    started = time.monotonic()
    with pytest.raises(LLMStreamCut) as failure:
        make_client(model=STANDIN_MODEL + "+slow=2").chat(ask("Stall after the first word"), timeout=0.2)
    assert time.monotonic() - started < 1.5  # not the 2 s until the next token
    assert "read timeout" in str(failure.value) and failure.value.partial.content


def test_a_cut_inside_tool_call_arguments_drops_the_incomplete_call(make_client):
    with pytest.raises(LLMStreamCut) as failure:
        make_client(model=STANDIN_MODEL + "+cut").chat(ask(GOAL), tools=contract_tools())
    partial = failure.value.partial
    assert partial.tool_calls == []
    assert [c.name for c in partial.dropped_tool_calls] == ["contracts.list"]
    assert partial.assistant_message() == {"role": "assistant", "content": None}


def test_malformed_tool_call_arguments_come_back_as_the_raw_string(make_client):
    completion = make_client(model=STANDIN_MODEL + "+bad-json").chat(ask(GOAL), tools=contract_tools())
    assert completion.finish_reason == "tool_calls" and not completion.partial
    [call] = completion.tool_calls
    assert call.name == "contracts.list" and call.arguments.startswith('{"limit": 3')
    with pytest.raises(ValueError, match="not valid JSON"):
        call.parsed_arguments()


def test_a_call_to_a_tool_that_was_not_offered_is_returned_as_sent(make_client):
    completion = make_client(model=STANDIN_MODEL + "+unknown-tool").chat(ask(GOAL), tools=contract_tools())
    offered = {t["function"]["name"] for t in contract_tools()}
    [call] = completion.tool_calls
    assert call.name not in offered and call.parsed_arguments() == {"reason": "fault mode unknown-tool"}


def test_max_completion_tokens_falls_back_to_max_tokens_once_per_server(make_client):
    with StandinServer(token_seconds=0.001) as legacy_server:
        client = make_client(legacy_server, model=STANDIN_MODEL + "+legacy")
        first = client.chat(ask("A long answer that the cap will cut short"), max_tokens_cap=3)
        assert first.finish_reason == "length" and len(first.content.split()) == 3
        sent = [(r.status, sorted(k for k in r.body if k.startswith("max_"))) for r in legacy_server.requests]
        assert sent == [(400, ["max_completion_tokens"]), (200, ["max_tokens"])]
        # Remembered for this server: the next call goes straight to max_tokens.
        second = client.chat(ask("Another answer"), max_tokens_cap=2)
        assert second.finish_reason == "length"
        assert [sorted(k for k in r.body if k.startswith("max_")) for r in legacy_server.requests[2:]] == [["max_tokens"]]


def test_a_cap_is_sent_as_max_completion_tokens_to_a_current_server(make_client, standin):
    model = STANDIN_MODEL + "+slow=0"
    make_client(model=model).chat(ask("short"), max_tokens_cap=50)
    [request] = requests_for(standin, model)
    assert request.body["max_completion_tokens"] == 50 and "max_tokens" not in request.body


def cancel_after_first_token(make_client, cancel_hook, trigger):
    """Stream a slow answer; cancel once the first piece has arrived; how long the call
    took to end after the cancellation, and the exception."""
    first_piece = threading.Event()
    cancelled_at = []

    def cancel_when_streaming():
        first_piece.wait(5)
        cancelled_at.append(time.monotonic())
        trigger()

    threading.Thread(target=cancel_when_streaming, daemon=True).start()
    with pytest.raises(LLMCancelled) as failure:
        make_client(model=STANDIN_MODEL + "+slow=0.5").chat(
            ask("Stream this slowly so that it can be cancelled part way"), on_token=lambda _: first_piece.set(),
            cancel=cancel_hook)
    return time.monotonic() - cancelled_at[0], failure.value


def test_a_cancelled_token_closes_a_slow_stream_at_once(make_client):
    token = CancellationToken("step")
    took, error = cancel_after_first_token(make_client, token, lambda: token.cancel("operator pressed Stop"))
    assert took < 0.25  # a token is 0.5 s: the stream was closed, not waited out
    assert error.reason == "operator pressed Stop" and "operator pressed Stop" in str(error)
    assert error.partial.cancelled and error.partial.content and error.partial.usage.estimated


def test_a_cancel_callable_stops_a_slow_stream_promptly(make_client):
    flag = threading.Event()
    took, error = cancel_after_first_token(make_client, flag.is_set, flag.set)
    assert took < 0.25
    assert error.partial.cancelled and error.partial.content


def test_the_contract_plan_end_to_end_by_feeding_tool_results_back(make_client, standin):
    contracts = {f"contract_{i:02d}": f"SUPPLY AGREEMENT {i}\nThe fee is EUR {i * 1000:,}.00, payable monthly."
                 for i in range(1, 8)}
    sent_emails = []

    def run_tool(name: str, arguments: dict) -> str:
        if name == "contracts.list":
            return json.dumps([{"id": cid} for cid in list(contracts)[: arguments.get("limit", 99)]])
        if name == "contracts.read":
            return contracts.get(arguments["contract_id"], "error: no such contract")
        if name == "email.send":
            sent_emails.append(arguments)
            return json.dumps({"status": "sent", "message_id": "<1@example.org>"})
        raise AssertionError(f"the stand-in called {name}, which was not offered")

    goal = "Parse the 7 contracts and email a summary to boss@example.org"
    history, turns = ask(goal), []
    client = make_client(model=STANDIN_MODEL + "+429=0.05@1")  # every turn's first attempt is refused
    for _ in range(10):
        completion = client.chat(history, tools=contract_tools(), max_tokens_cap=2000)
        history.append(completion.assistant_message())
        turns.append([call.name for call in completion.tool_calls])
        if not completion.tool_calls:
            break
        for call in completion.tool_calls:
            history.append(tool_result_message(call.id, run_tool(call.name, call.parsed_arguments())))
    assert turns == [["contracts.list"], ["contracts.read"] * 5, ["contracts.read"] * 2, ["email.send"], []]
    [email] = sent_emails
    assert email["to"] == "boss@example.org" and email["subject"] == "Summary of 7 contracts"
    assert "Total of the amounts: EUR 28,000.00" in email["body"]  # 1,000 + ... + 7,000
    assert "contract_07: EUR 7,000.00" in email["body"]
    assert "emailed the summary to boss@example.org" in history[-1]["content"]


def test_chat_uses_the_llm_settings(standin, settings):
    settings.LLM_BASE_URL, settings.LLM_MODEL, settings.LLM_API_KEY = standin.base_url, STANDIN_MODEL + "+slow=0", "k"
    completion = chat(ask("Which server do the settings name?"))
    assert completion.model == STANDIN_MODEL + "+slow=0" and completion.finish_reason == "stop"
    assert client_from_settings().base_url == standin.base_url
    wait_for(lambda: requests_for(standin, STANDIN_MODEL + "+slow=0"), message="the request at the stand-in")


def test_every_client_checks_the_server_s_certificate_with_the_one_tls_context_it_shares(make_client, tmp_path):
    """The TLS context is built once per process and shared by the clients (bench/agent.py: it cost
    ~20 ms per turn): shared or not, it must still refuse a server whose certificate nobody trusts."""
    import http.server
    import ssl
    import subprocess

    from orchestrator.llm import client as llm_client

    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    served = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # never reached: the handshake fails first
            served.append(self.path)
            self.send_response(500)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        class SelfSigned:
            base_url = f"https://127.0.0.1:{server.server_address[1]}/v1"

        first, second = make_client(SelfSigned, max_attempts=1), make_client(SelfSigned, max_attempts=1)
        for client in (first, second):
            with pytest.raises(LLMUnavailable) as failure:
                client.chat(ask("hello over TLS"))
            assert "CERTIFICATE_VERIFY_FAILED" in str(failure.value)
        assert served == []  # no request got through
        assert llm_client._tls_context().verify_mode == ssl.CERT_REQUIRED and llm_client._tls_context().check_hostname
        assert first._openai._client is not second._openai._client  # each its own connection pool
    finally:
        server.shutdown()
        server.server_close()
