"""The stand-in's server dialects (vLLM, Ollama, llama.cpp: the shapes of the chunks they
stream) on the wire, and the client against each: tool calls assembled however they come,
reasoning kept apart from the answer, usage read wherever it is and estimated when absent."""
import json
import re

import pytest

from orchestrator.llm import LLMRequestRejected, tool_result_message
from orchestrator.llm.standin import STANDIN_MODEL

from .helpers import contract_tools
from .test_standin import post, sse_events

GOAL = "Parse the 3 contracts and email a summary to boss@example.org"
DIALECTS = ("vllm", "ollama", "llamacpp")
REASONING_FIELD = {"vllm": "reasoning", "ollama": "reasoning", "llamacpp": "reasoning_content",
                   "reasoning": "reasoning_content"}


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def after_the_list() -> list[dict]:
    """The goal, the model's contracts.list call and its result: the next answer reads all three."""
    return ask(GOAL) + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "l1", "type": "function", "function": {"name": "contracts.list", "arguments": '{"limit": 3}'}}]},
        tool_result_message("l1", ["c-01", "c-02", "c-03"])]


def stream_of(server, mode: str, messages: list[dict], *, include_usage: bool = True) -> list[dict]:
    body = {"model": f"{STANDIN_MODEL}+{mode}", "stream": True, "tools": contract_tools(), "messages": messages}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    with post(server, body) as response:
        return [e for e in sse_events(response) if e != "[DONE]"]


def deltas(chunks: list[dict]) -> list[dict]:
    return [c["choices"][0]["delta"] for c in chunks if c["choices"]]


def tool_fragments(chunks: list[dict]) -> list[list[dict]]:
    """The tool_calls list of each delta that has one."""
    return [d["tool_calls"] for d in deltas(chunks) if d.get("tool_calls")]


# --- on the wire ------------------------------------------------------------------------

@pytest.mark.parametrize("mode", DIALECTS + ("reasoning",))
def test_reasoning_comes_as_deltas_of_the_dialect_s_field_before_the_answer(standin, mode):
    chunks = stream_of(standin, mode, ask("Tell me something about the weather"))
    field, other = REASONING_FIELD[mode], {"reasoning", "reasoning_content"} - {REASONING_FIELD[mode]}
    pieces = [d[field] for d in deltas(chunks) if d.get(field)]
    assert len(pieces) > 3 and "".join(pieces).startswith("Thinking:")
    assert not any(d.get(name) for d in deltas(chunks) for name in other)
    # All of it before the first piece of the answer, which never contains it.
    positions = [i for i, d in enumerate(deltas(chunks)) if d.get(field)]
    answer = [i for i, d in enumerate(deltas(chunks)) if d.get("content")]
    assert answer and max(positions) < min(answer)
    assert "Thinking" not in "".join(d.get("content") or "" for d in deltas(chunks))


def test_plain_openai_shape_has_no_reasoning(standin):
    chunks = stream_of(standin, "no-usage", ask("Tell me something about the weather"))
    assert not any("reasoning" in d or "reasoning_content" in d for d in deltas(chunks))


def test_vllm_streams_tool_calls_in_pieces_with_its_ids_and_choice_fields(standin):
    chunks = stream_of(standin, "vllm", after_the_list())
    fragments = [f for calls in tool_fragments(chunks) for f in calls]
    heads = [f for f in fragments if "id" in f]
    assert len(heads) == 3 and all(re.fullmatch(r"chatcmpl-tool-[0-9a-f]{12}", f["id"]) for f in heads)
    assert all("arguments" not in f["function"] for f in heads)  # the name alone, arguments after
    assert len(fragments) > 2 * len(heads)  # arguments in several pieces each
    assert all({"logprobs", "stop_reason"} <= set(c["choices"][0]) for c in chunks if c["choices"])
    # Usage in a chunk of its own, as asked.
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0


def test_vllm_sends_no_usage_unless_asked(standin):
    chunks = stream_of(standin, "vllm", ask("Tell me something about the weather"), include_usage=False)
    assert all("usage" not in c for c in chunks)


def test_ollama_sends_every_tool_call_complete_in_one_chunk_and_never_usage(standin):
    chunks = stream_of(standin, "ollama", after_the_list())
    [calls] = tool_fragments(chunks)
    assert [c["index"] for c in calls] == [0, 1, 2]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"contract_id": f"c-0{i}"} for i in (1, 2, 3)]
    assert all(c["id"].startswith("call_") and c["function"]["name"] == "contracts.read" for c in calls)
    # Every delta names the role; the finish chunk too; no usage although it was asked for.
    assert all(d.get("role") == "assistant" for d in deltas(chunks))
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert all("usage" not in c for c in chunks) and all(c["system_fingerprint"] == "fp_ollama" for c in chunks)


def test_llamacpp_sends_each_call_whole_and_usage_inside_the_finish_chunk(standin):
    chunks = stream_of(standin, "llamacpp", after_the_list(), include_usage=False)
    fragments = tool_fragments(chunks)
    assert len(fragments) == 3 and all(len(calls) == 1 for calls in fragments)
    assert all(json.loads(calls[0]["function"]["arguments"]) for calls in fragments)
    assert deltas(chunks)[0] == {"role": "assistant", "content": None}
    finish = chunks[-1]
    assert finish["choices"][0]["finish_reason"] == "tool_calls"
    assert finish["usage"]["completion_tokens"] > 0 and "timings" in finish  # sent unasked, in the same chunk
    assert sum(1 for c in chunks if "usage" in c) == 1


def test_a_second_dialect_is_refused(standin):
    body = {"model": f"{STANDIN_MODEL}+vllm+ollama", "stream": True, "messages": ask("hello there")}
    with pytest.raises(Exception) as refused:
        post(standin, body)
    assert refused.value.code == 400 and "several dialects" in refused.value.read().decode()


# --- the client against each ------------------------------------------------------------

@pytest.mark.parametrize("mode", DIALECTS)
def test_a_tool_call_turn_completes_under_each_dialect_with_the_reasoning_apart(make_client, mode):
    reasoning = []
    completion = make_client(model=f"{STANDIN_MODEL}+{mode}").chat(after_the_list(), tools=contract_tools(),
                                                                   on_reasoning=reasoning.append)
    assert completion.finish_reason == "tool_calls" and not completion.partial
    assert [(c.name, c.parsed_arguments()) for c in completion.tool_calls] == [
        ("contracts.read", {"contract_id": f"c-0{i}"}) for i in (1, 2, 3)]
    assert len({c.id for c in completion.tool_calls}) == 3
    assert completion.reasoning.startswith("Thinking:") and "".join(reasoning) == completion.reasoning
    assert "Thinking" not in completion.content
    # Not sent back unless asked (some servers reject the field); sent back when asked.
    assert "reasoning_content" not in completion.assistant_message()
    assert completion.assistant_message(include_reasoning=True)["reasoning_content"] == completion.reasoning


@pytest.mark.parametrize("mode", DIALECTS)
def test_a_final_answer_completes_under_each_dialect(make_client, mode):
    tokens = []
    completion = make_client(model=f"{STANDIN_MODEL}+{mode}").chat(ask("Tell me something about the weather"),
                                                                   on_token=tokens.append)
    assert completion.finish_reason == "stop" and "weather" in completion.content
    assert "".join(tokens) == completion.content and completion.reasoning


def test_usage_is_estimated_when_the_server_sends_none_ollama(make_client):
    completion = make_client(model=f"{STANDIN_MODEL}+ollama").chat(after_the_list(), tools=contract_tools())
    usage = completion.usage
    assert usage.estimated and usage.prompt_tokens > 0
    # The estimate counts the reasoning too (the server bills it as completion tokens).
    answer_only = sum(len(c.name) + len(c.arguments) for c in completion.tool_calls)
    assert usage.completion_tokens * 4 >= answer_only + len(completion.reasoning)


def test_usage_inside_the_finish_chunk_is_read_llamacpp(make_client):
    completion = make_client(model=f"{STANDIN_MODEL}+llamacpp").chat(after_the_list(), tools=contract_tools())
    assert not completion.usage.estimated and completion.usage.completion_tokens > 0


def test_usage_chunk_is_read_vllm(make_client):
    completion = make_client(model=f"{STANDIN_MODEL}+vllm").chat(after_the_list(), tools=contract_tools())
    assert not completion.usage.estimated and completion.usage.total_tokens == (
        completion.usage.prompt_tokens + completion.usage.completion_tokens)


def test_a_server_that_refuses_stream_options_is_served_without_them(standin, make_client):
    model = f"{STANDIN_MODEL}+no-stream-options"
    with pytest.raises(LLMRequestRejected, match="stream_options"):
        make_client(model=model).chat(ask("Tell me something about the weather"))
    client = make_client(model=model)
    client.include_usage = False
    completion = client.chat(ask("Tell me something about the weather"))
    assert completion.finish_reason == "stop" and completion.usage.estimated
    assert "stream_options" not in standin.requests[-1].body


def test_a_cut_stream_keeps_the_reasoning_that_had_arrived(make_client):
    from orchestrator.llm import LLMStreamCut

    with pytest.raises(LLMStreamCut) as cut:
        make_client(model=f"{STANDIN_MODEL}+vllm+cut").chat(after_the_list(), tools=contract_tools())
    partial = cut.value.partial
    assert partial.reasoning.startswith("Thinking") and partial.usage.estimated
