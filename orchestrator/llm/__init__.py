"""Talking to a language model: `client` (one streamed Chat Completions call through the
official `openai` package, with retries, cancellation, usage and clear errors) and `standin`
(a rule-based stand-in model server speaking the same protocol, for offline runs and tests).

A sibling of orchestrator.tools in the import layers: it knows nothing of the engine; the
engine and the task types call it.
"""
from .client import (
    Completion,
    LLMBadResponse,
    LLMCancelled,
    LLMClient,
    LLMContextExceeded,
    LLMError,
    LLMRequestRejected,
    LLMResponseGone,
    LLMStreamCut,
    LLMUnavailable,
    RetryPolicy,
    ToolCall,
    Usage,
    chat,
    client_from_settings,
    function_tool,
    tool_result_message,
)

__all__ = [
    "Completion", "LLMBadResponse", "LLMCancelled", "LLMClient", "LLMContextExceeded", "LLMError", "LLMRequestRejected",
    "LLMResponseGone", "LLMStreamCut", "LLMUnavailable", "RetryPolicy", "ToolCall", "Usage", "chat", "client_from_settings",
    "function_tool", "tool_result_message",
]
