"""What a model call gives back, whatever the wire (Chat Completions in client.py, the
Responses API's background mode in responses.py): the Completion with its tool calls and usage,
the messages that answer it, and the offline token estimate (no tokenizer download)."""
from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..primitives import storable

# The usual rule of thumb when no tokenizer is at hand (one that needs a download is not
# available offline): about four characters per token.
CHARACTERS_PER_TOKEN = 4


# --- results ---------------------------------------------------------------------------

@dataclass(frozen=True)
class ToolCall:
    """A tool call as the model sent it; `arguments` is the raw JSON text, unparsed."""
    id: str
    name: str
    arguments: str

    def parsed_arguments(self) -> dict:
        """The arguments as a dict; ValueError (with a message fit to send back to the model
        as the tool result) when they are not a JSON object."""
        try:
            value = json.loads(self.arguments or "{}")
        except ValueError as exc:
            raise ValueError(f"The arguments of {self.name} are not valid JSON ({exc}): "
                             f"{self.arguments[:200]!r}") from None
        if not isinstance(value, dict):
            raise ValueError(f"The arguments of {self.name} must be a JSON object, got {type(value).__name__}")
        return value

    def arguments_are_complete(self) -> bool:
        try:
            json.loads(self.arguments or "{}")
        except ValueError:
            return False
        return True

    def wire_format(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # True when the server sent no usage (an interrupted stream, or a server that does not
    # report it) and these numbers are characters / 4.
    estimated: bool = False
    # Of prompt_tokens, those the server served from its prompt cache (usage.prompt_tokens_details).
    cached_tokens: int = 0


@dataclass(frozen=True)
class FailedAttempt:
    """One attempt of a call that failed (and was retried, or was the last): what the server
    said, and the prompt tokens it read (estimated; 0 when it refused unread: 429, 503, no
    connection)."""
    reason: str
    status_code: int | None
    prompt_tokens: int


@dataclass
class Completion:
    content: str
    tool_calls: list[ToolCall]
    finish_reason: str | None  # "stop", "tool_calls", "length", ...; None if the stream ended early
    usage: Usage
    model: str
    response_id: str | None = None
    stream_cut: bool = False   # the stream ended before the server finished the message
    cancelled: bool = False    # the caller's cancel hook ended it
    # Tool calls of a partial answer whose arguments were incomplete JSON (not in tool_calls).
    dropped_tool_calls: list[ToolCall] = field(default_factory=list)
    attempts: int = 1
    # Prompt tokens (estimated) of the earlier attempts of this call that the server took in
    # before failing (see _Retry.spent): a budget counts every attempt, not only the last.
    retry_tokens: int = 0
    # Each earlier attempt of this call that failed and was retried, as the ledger records it.
    failed_attempts: list["FailedAttempt"] = field(default_factory=list)
    # The model's reasoning (reasoning_content / reasoning deltas), apart from `content`.
    reasoning: str = ""

    def __post_init__(self):
        # A model's answer is untrusted text (a document it read can make it emit NUL), and is
        # stored: the dialog, the WAL's arguments, the step's result. PostgreSQL stores no NUL.
        self.content = storable.text(self.content) if self.content else self.content
        self.reasoning = storable.text(self.reasoning) if self.reasoning else self.reasoning
        self.tool_calls = [_storable_call(call) for call in self.tool_calls]
        self.dropped_tool_calls = [_storable_call(call) for call in self.dropped_tool_calls]

    @property
    def partial(self) -> bool:
        return self.stream_cut or self.cancelled

    def assistant_message(self, *, include_reasoning: bool = False) -> dict:
        """The assistant message to append to the history (wire format). Every tool call in
        it must be answered by one `tool` message (`tool_result_message`) before the next
        call, or servers refuse the conversation. The reasoning goes back (as
        `reasoning_content`) only with `include_reasoning`: some servers reject the field."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content or None}
        if include_reasoning and self.reasoning:
            message["reasoning_content"] = self.reasoning
        if self.tool_calls:
            message["tool_calls"] = [call.wire_format() for call in self.tool_calls]
        return message


def _storable_call(call: ToolCall) -> ToolCall:
    """The call with no NUL in its id, name or arguments (raw, or escaped in the JSON text)."""
    return ToolCall(storable.text(call.id or ""), storable.text(call.name or ""),
                    storable.json_text(call.arguments or ""))


def tool_result_message(tool_call_id: str, content: str | dict | list) -> dict:
    """The `tool` message answering one tool call (non-string content is sent as JSON)."""
    text = content if isinstance(content, str) else json.dumps(content, ensure_ascii=False)
    return {"role": "tool", "tool_call_id": tool_call_id, "content": text}


def function_tool(name: str, description: str, parameters: dict | None = None) -> dict:
    """A tool offered to the model, in the Chat Completions `tools` format."""
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": parameters or {"type": "object", "properties": {}}}}


# --- errors ----------------------------------------------------------------------------


def estimate_tokens(characters: int) -> int:
    return math.ceil(characters / CHARACTERS_PER_TOKEN) if characters > 0 else 0


def estimate_prompt_tokens(messages: Sequence[dict], tools: Sequence[dict] | None = None) -> int:
    """A request's prompt in tokens, estimated before it is sent (characters / 4): what a
    budget must have room for besides the completion."""
    return estimate_tokens(len(json.dumps(list(messages), ensure_ascii=False))
                           + len(json.dumps(list(tools or []), ensure_ascii=False)))
