"""The stand-in model server on the wire (raw HTTP, as any client sees it) and its rules."""
import json
import time
import urllib.error
import urllib.request

import pytest

from orchestrator.llm.standin import STANDIN_MODEL, parse_model, plan_next

from .helpers import contract_tools, requests_for

GOAL = "Parse the 3 contracts and email a summary to boss@example.org"


def post(server, body: dict, *, timeout: float = 5):
    request = urllib.request.Request(server.base_url + "/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    return urllib.request.urlopen(request, timeout=timeout)


def sse_events(response) -> list:
    """The `data:` payloads of a stream, in order ([DONE] as the string)."""
    events = []
    for raw in response:
        line = raw.decode().strip()
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_models_lists_the_standin(standin):
    with urllib.request.urlopen(standin.base_url + "/models", timeout=5) as response:
        assert [m["id"] for m in json.load(response)["data"]] == [STANDIN_MODEL]


def test_stream_is_sse_chunks_then_finish_then_usage_then_done(standin):
    body = {"model": STANDIN_MODEL, "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "Tell me something about the weather"}]}
    with post(standin, body) as response:
        assert response.headers["Content-Type"] == "text/event-stream"
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert "direct answer" in text and "weather" in text
    assert len([c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]) > 5
    finish = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert [c["choices"][0]["finish_reason"] for c in finish] == ["stop"]
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] > 5
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + usage["usage"]["completion_tokens"]


def test_stream_is_flushed_chunk_by_chunk(standin):
    """The first chunk arrives while the rest is still being made (not all at the end)."""
    body = {"model": STANDIN_MODEL + "+slow=0.03", "stream": True,
            "messages": [{"role": "user", "content": "Say a few words about flushing streams please"}]}
    started = time.monotonic()
    with post(standin, body) as response:
        first_content_at = None
        for raw in response:
            line = raw.decode()
            if first_content_at is None and '"content": "' in line and '"content": ""' not in line:
                first_content_at = time.monotonic() - started
        total = time.monotonic() - started
    assert first_content_at is not None
    assert total > 0.3  # ~15 tokens at 30 ms
    assert first_content_at < total / 3


def test_tool_call_fragments_carry_id_and_name_first_then_argument_pieces(standin):
    body = {"model": STANDIN_MODEL, "stream": True, "tools": contract_tools(),
            "messages": [{"role": "user", "content": GOAL}]}
    with post(standin, body) as response:
        chunks = [e for e in sse_events(response) if e != "[DONE]"]
    fragments = [f for c in chunks if c["choices"] for f in c["choices"][0]["delta"].get("tool_calls") or []]
    first, rest = fragments[0], fragments[1:]
    assert first["id"].startswith("call_") and first["function"]["name"] == "contracts.list"
    assert len(rest) >= 2 and all("id" not in f and "name" not in f["function"] for f in rest)
    assert json.loads("".join(f["function"]["arguments"] for f in rest)) == {"limit": 3}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # No stream_options.include_usage: no usage chunk.
    assert all("usage" not in c for c in chunks)


def test_non_streaming_answer_is_one_json_body(standin):
    body = {"model": STANDIN_MODEL, "tools": contract_tools(), "messages": [{"role": "user", "content": GOAL}]}
    with post(standin, body) as response:
        answer = json.load(response)
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "contracts.list", "arguments": '{"limit": 3}'}
    assert answer["usage"]["completion_tokens"] >= 1


def test_the_same_conversation_gets_the_same_answer(standin):
    body = {"model": STANDIN_MODEL, "tools": contract_tools(), "messages": [{"role": "user", "content": GOAL}]}
    answers = []
    for _ in range(2):
        with post(standin, body) as response:
            answers.append(json.load(response)["choices"])
    assert answers[0] == answers[1]


def test_a_tool_call_without_its_tool_message_is_refused_like_openai(standin):
    messages = [{"role": "user", "content": GOAL},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "contracts.list", "arguments": "{}"}}]},
                {"role": "user", "content": "hurry up"}]
    with pytest.raises(urllib.error.HTTPError) as failure:
        post(standin, {"model": STANDIN_MODEL, "messages": messages, "tools": contract_tools()})
    assert failure.value.code == 400
    assert "call_1" in json.load(failure.value)["error"]["message"]


def test_an_unknown_fault_mode_is_refused_with_the_known_ones(standin):
    with pytest.raises(urllib.error.HTTPError) as failure:
        post(standin, {"model": STANDIN_MODEL + "+explode", "messages": [{"role": "user", "content": "x"}]})
    assert failure.value.code == 400
    message = json.load(failure.value)["error"]["message"]
    assert "explode" in message and "no-usage" in message and "unknown-tool" in message


def test_a_fault_at_n_happens_only_on_the_nth_arrival_of_that_request(standin):
    model = STANDIN_MODEL + "+429=0.5@2"
    body = {"model": model, "messages": [{"role": "user", "content": "count my arrivals"}]}
    post(standin, body).close()
    with pytest.raises(urllib.error.HTTPError) as failure:
        post(standin, body)
    assert failure.value.code == 429 and failure.value.headers["Retry-After"] == "0.5"
    post(standin, body).close()
    assert [r.status for r in requests_for(standin, model)] == [200, 429, 200]
    assert parse_model("standin-planner+slow=0.2+cut@3")[1]["cut"].on_request == 3


def test_the_token_cap_ends_the_answer_with_finish_reason_length(standin):
    body = {"model": STANDIN_MODEL, "max_completion_tokens": 4,
            "messages": [{"role": "user", "content": "Write a long answer about nothing in particular"}]}
    with post(standin, body) as response:
        answer = json.load(response)
    assert answer["choices"][0]["finish_reason"] == "length"
    assert len(answer["choices"][0]["message"]["content"].split()) == 4
    assert answer["usage"]["completion_tokens"] == 4


# --- the rules -------------------------------------------------------------------------

def tool(name, properties=None, required=()):
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": properties or {}, "required": list(required)}}}


def test_the_contract_plan_follows_whatever_names_the_tools_have():
    tools = [tool("read_contract", {"document_id": {"type": "integer"}}, ["document_id"]),
             tool("send_email", {"recipients": {"type": "array", "items": {"type": "string"}},
                                 "subject": {"type": "string"}, "text": {"type": "string"}})]
    goal = [{"role": "user", "content": "Please parse the two contracts and email a summary to cfo@example.com."}]
    plan = plan_next(goal, tools)
    # No list tool: contracts 1..N, read in one turn.
    assert [(c.name, c.arguments) for c in plan.tool_calls] == [
        ("read_contract", {"document_id": 1}), ("read_contract", {"document_id": 2})]
    history = goal + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": f"c{i}", "type": "function", "function": {"name": "read_contract",
                                                         "arguments": json.dumps({"document_id": i})}}
        for i in (1, 2)]}]
    history += [{"role": "tool", "tool_call_id": "c1", "content": "Fee: EUR 1,000.50 and USD 20"},
                {"role": "tool", "tool_call_id": "c2", "content": '{"amount": 99.5, "currency": "eur"}'}]
    email = plan_next(history, tools).tool_calls
    assert [c.name for c in email] == ["send_email"]
    assert email[0].arguments["recipients"] == ["cfo@example.com"]
    assert "EUR 1,100.00" in email[0].arguments["text"] and "USD 20.00" in email[0].arguments["text"]


def test_without_a_matching_tool_the_standin_answers_and_never_invents_one():
    tools = [tool("calendar.create_event", {"title": {"type": "string"}}, ["title"])]
    plan = plan_next([{"role": "user", "content": "What is the capital of France?"}], tools)
    assert plan.tool_calls == [] and "capital of France" in plan.content
    # A contracts goal without a tool that reads contracts falls back to the same rule.
    plan = plan_next([{"role": "user", "content": "Parse 3 contracts"}], tools)
    assert plan.tool_calls == []


def test_a_tool_named_like_a_word_of_the_goal_is_called_then_its_result_answered():
    tools = [tool("weather.lookup", {"city": {"type": "string"}}, ["city"])]
    goal = [{"role": "user", "content": "What's the weather like in Oslo?"}]
    plan = plan_next(goal, tools)
    assert [(c.name, c.arguments) for c in plan.tool_calls] == [("weather.lookup", {"city": goal[0]["content"]})]
    history = goal + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "w1", "type": "function", "function": {"name": "weather.lookup", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "w1", "content": "Oslo: 3 °C, snow"}]
    answer = plan_next(history, tools)
    assert answer.tool_calls == [] and "3 °C, snow" in answer.content


# --- how it is started -----------------------------------------------------------------

def test_make_run_starts_the_standin_only_while_the_settings_point_at_it():
    from orchestrator.management.commands.runstack import standin_port_to_start

    assert standin_port_to_start("http://127.0.0.1:8011/v1", "standin-planner") == 8011
    assert standin_port_to_start("http://localhost:9000/v1", "standin-planner+slow") == 9000
    assert standin_port_to_start("https://api.openai.com/v1", "gpt-4.1-mini") is None
    assert standin_port_to_start("http://127.0.0.1:11434/v1", "llama3.2") is None  # Ollama on this host


def test_the_standin_llm_command_serves_until_sigterm(tmp_path):
    import signal
    import subprocess
    import sys

    from tests.conftest import ROOT, free_port, wait_for

    port = free_port()
    process = subprocess.Popen([sys.executable, "manage.py", "standin_llm", "--port", str(port)], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        def models():
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=1) as response:
                    return json.load(response)
            except OSError:
                return None

        # What is tested is that it serves and stops, not how fast Django starts on a busy machine.
        try:
            answer = wait_for(lambda: models() or process.poll() is not None, timeout=60,
                              message="the stand-in to answer")
        except AssertionError:
            process.kill()
            raise AssertionError(f"the stand-in did not answer in 60 s; it said:\n{process.communicate()[0][-3000:]}")
        assert answer is not True, f"the stand-in exited ({process.returncode}):\n{process.communicate()[0][-3000:]}"
        assert answer["data"][0]["id"] == STANDIN_MODEL
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=10)
        assert process.returncode == 0
        assert "rules, not a real model" in output and "stopped" in output
    finally:
        if process.poll() is None:
            process.kill()
