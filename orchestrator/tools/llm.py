"""LLM token streaming from an OpenAI-compatible endpoint (`stream: true`, server-sent
events). A cancelled token closes the stream at once; each streamed chunk counts as one
token against the task's max_tokens."""
import json
from collections.abc import Callable, Iterator

from .http import iter_response, open_request


def stream_completion(url: str, payload: dict, *, token, on_token: Callable[[int], None] | None = None,
                      timeout: float = 60) -> Iterator[str]:
    with token.track("llm", f"stream {url}"):
        response = open_request({"method": "POST", "url": url, "json": {**payload, "stream": True},
                                 "timeout": timeout}, token=token)
        for raw in iter_response(response, token=token, url=url, lines=True):
            line = raw.decode("utf-8", errors="replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return
            try:
                delta = json.loads(data)["choices"][0].get("delta", {}).get("content") or ""
            except (ValueError, KeyError, IndexError):
                continue
            if on_token:
                on_token(1)
            yield delta
