"""A local HTTP endpoint that honours Idempotency-Key, like a payment API: a repeated key
returns the stored answer and does not execute again."""
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class KeyedServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.executed: dict[str, int] = {}  # key -> times really executed
        self.requests = 0
        self.lock = threading.Lock()
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/charges"

    def stop(self):
        self.shutdown()
        self.server_close()


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        key = self.headers.get("Idempotency-Key", "")
        with self.server.lock:
            self.server.requests += 1
            if key not in self.server.executed:
                self.server.executed[key] = 1
        body = json.dumps({"charge": key}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
