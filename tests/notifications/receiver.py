"""A webhook receiver of the tests' own: a real threaded HTTP server that verifies every request
with standardwebhooks' Webhook.verify (as a receiver written from the spec would) and answers
from a script: a status code, or "hang" (no answer for `hang_seconds`), then the last entry
for every request after the script ran out."""
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from standardwebhooks.webhooks import Webhook, WebhookVerificationError


@dataclass
class Received:
    at: float  # time.monotonic() when the request arrived
    headers: dict
    body: bytes
    payload: dict | None  # what Webhook.verify returned; None when it refused the request
    refusal: str = ""
    answer: object = None


@dataclass
class Receiver:
    secret: str
    script: list = field(default_factory=lambda: [200])
    hang_seconds: float = 10.0

    def __post_init__(self):
        self.received: list[Received] = []
        self.lock = threading.Lock()
        self.released = threading.Event()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                headers = {k.lower(): v for k, v in self.headers.items()}
                try:
                    payload, refusal = Webhook(receiver.secret).verify(body, headers), ""
                except WebhookVerificationError as exc:
                    payload, refusal = None, str(exc)
                with receiver.lock:
                    answer = receiver.script[min(len(receiver.received), len(receiver.script) - 1)]
                    receiver.received.append(Received(time.monotonic(), headers, body, payload, refusal, answer))
                if answer == "hang":
                    receiver.released.wait(receiver.hang_seconds)
                    return
                reply = b"refused by the test receiver" if answer >= 300 else b"ok"
                self.send_response(answer)
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/hooks/orchestrator"

    def requests(self) -> list[Received]:
        with self.lock:
            return list(self.received)

    def stop(self) -> None:
        self.released.set()
        self.server.shutdown()
        self.server.server_close()
