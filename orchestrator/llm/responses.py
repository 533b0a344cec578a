"""The Responses API's `background` mode, for servers that keep a response after the client
went away (OpenAI's; a profile says so with `background_responses`). The server answers a
background request with the response's id in its first event (`response.created`) and goes on
generating whatever happens to the connection; a client that died mid-stream retrieves the
finished response by that id (`GET /responses/{id}`) instead of paying for the turn again.

The harness keeps its dialog in the Chat Completions shape (agent/history.py); this module
translates a chat request into a Responses request (`request_of`), assembles the streamed
events into the same `Completion` a chat stream gives (`EventAssembly`), and reads a retrieved
response (`completion_of`). Only what the agent sends is translated: system, user and
assistant text, function calls and their outputs, function tools.
"""
from __future__ import annotations

import json
from typing import Any

from .results import Completion, ToolCall, Usage, estimate_prompt_tokens, estimate_tokens

# A retrieved response still being generated: poll again (status values of the Responses API).
UNFINISHED = ("queued", "in_progress")


def _text(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # chat content parts
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return "" if content is None else json.dumps(content, ensure_ascii=False)


def input_of(messages: list[dict]) -> tuple[str, list[dict]]:
    """(instructions, input items) for a Chat Completions dialog: system messages become the
    instructions; a tool call and its result become `function_call` / `function_call_output`
    items joined by their call id."""
    instructions: list[str] = []
    items: list[dict] = []
    for message in messages:
        role = message.get("role")
        if role in ("system", "developer"):
            instructions.append(_text(message.get("content")))
        elif role == "tool":
            items.append({"type": "function_call_output", "call_id": message.get("tool_call_id", ""),
                          "output": _text(message.get("content"))})
        elif role == "assistant":
            if _text(message.get("content")):
                items.append({"role": "assistant", "content": _text(message.get("content"))})
            for call in message.get("tool_calls") or []:
                function = call.get("function") or {}
                items.append({"type": "function_call", "call_id": call.get("id", ""),
                              "name": function.get("name", ""), "arguments": function.get("arguments") or "{}"})
        else:
            items.append({"role": "user", "content": _text(message.get("content"))})
    return "\n\n".join(instructions), items


def tools_of(tools: list[dict] | None) -> list[dict]:
    """Chat function tools ({"type": "function", "function": {...}}) in the Responses shape (flat)."""
    flat = []
    for tool in tools or []:
        function = tool.get("function") or {}
        flat.append({"type": "function", "name": function.get("name", ""),
                     "description": function.get("description", ""),
                     "parameters": function.get("parameters") or {"type": "object", "properties": {}}})
    return flat


def request_of(chat_request: dict, max_tokens_cap: int | None) -> dict[str, Any]:
    """The Responses request for a chat request (`model`, `messages`, `tools`, `temperature`),
    asked in background mode and stored, streamed."""
    instructions, items = input_of(chat_request["messages"])
    request: dict[str, Any] = {"model": chat_request["model"], "input": items, "background": True, "store": True,
                               "stream": True}
    if instructions:
        request["instructions"] = instructions
    if chat_request.get("tools"):
        request["tools"] = tools_of(chat_request["tools"])
    if chat_request.get("tool_choice") is not None:
        request["tool_choice"] = chat_request["tool_choice"]
    if chat_request.get("temperature") is not None:
        request["temperature"] = chat_request["temperature"]
    if max_tokens_cap is not None:
        request["max_output_tokens"] = max_tokens_cap
    return request


def _usage_of(usage) -> Usage | None:
    if usage is None:
        return None
    details = getattr(usage, "input_tokens_details", None)
    prompt, completion = getattr(usage, "input_tokens", 0) or 0, getattr(usage, "output_tokens", 0) or 0
    return Usage(prompt, completion, getattr(usage, "total_tokens", None) or prompt + completion,
                 cached_tokens=getattr(details, "cached_tokens", None) or 0)


def _finish_of(response, calls: list) -> str | None:
    status = getattr(response, "status", None)
    if status == "incomplete":
        reason = getattr(getattr(response, "incomplete_details", None), "reason", "") or ""
        return "length" if reason == "max_output_tokens" else (reason or "length")
    if status == "completed":
        return "tool_calls" if calls else "stop"
    return None


class EventAssembly:
    """Accumulates a background response's stream events into a Completion (the same
    interface as client._Assembly). `on_response_id(id)` is called once, with the id of
    `response.created`, before any token: the caller records it where a process that
    replaces this one will find it."""

    def __init__(self, request: dict, on_response_id=None):
        self.request = request
        self.model = request["model"]
        self.on_response_id = on_response_id
        self.response_id: str | None = None
        self.content_parts: list[str] = []
        self.reasoning_parts: list[str] = []
        self.calls: dict[str, dict] = {}  # by output item id, in order
        self.finish_reason: str | None = None
        self.usage: Usage | None = None
        self.received_anything = False
        self.error: str = ""

    def add(self, event, on_token, on_reasoning=None) -> None:
        kind = getattr(event, "type", "")
        response = getattr(event, "response", None)
        if response is not None and getattr(response, "id", None) and self.response_id is None:
            self.response_id = response.id
            self.model = getattr(response, "model", None) or self.model
            if self.on_response_id is not None:
                self.on_response_id(response.id)
        if kind == "response.output_text.delta":
            self.received_anything = True
            self.content_parts.append(event.delta)
            if on_token is not None:
                on_token(event.delta)
        elif kind in ("response.reasoning_text.delta", "response.reasoning_summary_text.delta"):
            self.received_anything = True
            self.reasoning_parts.append(event.delta)
            if on_reasoning is not None:
                on_reasoning(event.delta)
        elif kind == "response.output_item.added" and getattr(event.item, "type", "") == "function_call":
            self.received_anything = True
            item = event.item
            self.calls[item.id or str(len(self.calls))] = {"id": item.call_id, "name": item.name, "arguments": []}
        elif kind == "response.function_call_arguments.delta":
            self.received_anything = True
            call = self.calls.get(event.item_id)
            if call is not None:
                call["arguments"].append(event.delta)
        elif kind in ("response.completed", "response.incomplete"):
            self.usage = _usage_of(getattr(response, "usage", None))
            self.finish_reason = _finish_of(response, list(self.calls))
        elif kind in ("response.failed", "error"):
            error = getattr(response, "error", None) if response is not None else event
            self.error = getattr(error, "message", "") or kind

    def completion(self, *, stream_cut: bool = False, cancelled: bool = False) -> Completion:
        content = "".join(self.content_parts)
        calls = [ToolCall(id=c["id"], name=c["name"], arguments="".join(c["arguments"])) for c in self.calls.values()]
        dropped: list[ToolCall] = []
        if stream_cut or cancelled:
            dropped = [call for call in calls if not call.arguments_are_complete() or not call.name]
            calls = [call for call in calls if call not in dropped]
        reasoning = "".join(self.reasoning_parts)
        usage = self.usage or _estimate(self.request, content + reasoning, calls + dropped)
        return Completion(content=content, tool_calls=calls, finish_reason=self.finish_reason, usage=usage,
                          model=self.model, response_id=self.response_id, stream_cut=stream_cut, cancelled=cancelled,
                          dropped_tool_calls=dropped, reasoning=reasoning)


def _estimate(request: dict, content: str, calls: list[ToolCall]) -> Usage:
    prompt = estimate_prompt_tokens(request["messages"], request.get("tools"))
    completion = estimate_tokens(len(content) + sum(len(c.name) + len(c.arguments) for c in calls))
    return Usage(prompt, completion, prompt + completion, estimated=True)


def completion_of(response, model: str) -> Completion:
    """A retrieved, finished response as a Completion (its usage as the server billed it)."""
    content: list[str] = []
    reasoning: list[str] = []
    calls: list[ToolCall] = []
    for item in getattr(response, "output", None) or []:
        kind = getattr(item, "type", "")
        if kind == "message":
            content.extend(getattr(part, "text", "") or "" for part in item.content or []
                           if getattr(part, "type", "") == "output_text")
        elif kind == "function_call":
            calls.append(ToolCall(id=item.call_id, name=item.name, arguments=item.arguments or "{}"))
        elif kind == "reasoning":
            reasoning.extend(getattr(part, "text", "") or "" for part in getattr(item, "content", None) or [])
    text = "".join(content)
    usage = _usage_of(getattr(response, "usage", None))
    if usage is None:
        completion_tokens = estimate_tokens(len(text) + sum(len(c.name) + len(c.arguments) for c in calls))
        usage = Usage(0, completion_tokens, completion_tokens, estimated=True)
    return Completion(content=text, tool_calls=calls, finish_reason=_finish_of(response, calls), usage=usage,
                      model=getattr(response, "model", None) or model, response_id=getattr(response, "id", None),
                      reasoning="".join(reasoning))
