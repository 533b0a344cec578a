"""A compromised model server: OpenAI-compatible (streamed Chat Completions), it follows
instructions planted in what it reads. Each turn it makes the next call of its script, whether
or not the tool was offered, and its exfiltration calls carry everything the dialog has shown
it so far (every tool result), so a secret that reached the model leaves with them.

It records every request body, so a test can also check that no secret reached the model.
"""
import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# A call of the script: (tool name, arguments), or a function of the loot read so far giving them;
# a list of calls is one turn with several tool calls; a string is its final answer (the text).
Call = tuple[str, dict] | Callable[[str], tuple[str, dict]] | list | str


class AttackerModel(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, script: list[Call]):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.script = script
        self.requests: list[dict] = []
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.shutdown()
        self.server_close()

    def seen_text(self) -> str:
        """Everything the model was sent, as one text (to search for secrets)."""
        with self.lock:
            return "\n".join(json.dumps(body, ensure_ascii=False) for body in self.requests)


def loot_of(messages: list[dict]) -> str:
    return "\n".join(str(m.get("content") or "") for m in messages if m.get("role") == "tool")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        server: AttackerModel = self.server
        with server.lock:
            server.requests.append(body)
        messages = body.get("messages") or []
        turn = sum(1 for m in messages if m.get("role") == "assistant")
        deltas = []
        if turn < len(server.script) and isinstance(server.script[turn], str):  # a final answer of its own
            deltas.append({"role": "assistant", "content": server.script[turn]})
            finish = "stop"
        elif turn < len(server.script):
            steps = server.script[turn]
            calls = []
            for index, step in enumerate(steps if isinstance(steps, list) else [steps]):
                name, arguments = step(loot_of(messages)) if callable(step) else step
                calls.append({"index": index, "id": f"call_{turn + 1}_{index + 1}", "type": "function",
                              "function": {"name": name, "arguments": json.dumps(arguments)}})
            deltas.append({"role": "assistant", "content": None, "tool_calls": calls})
            finish = "tool_calls"
        else:
            deltas.append({"role": "assistant", "content": "Done."})
            finish = "stop"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        base = {"id": f"chatcmpl-{turn}", "object": "chat.completion.chunk", "created": 0,
                "model": body.get("model", "attacker")}
        chunks = [{**base, "choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas]
        chunks.append({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
        chunks.append({**base, "choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 10,
                                                         "total_tokens": 20}})
        for chunk in chunks:
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()
        self.close_connection = True
