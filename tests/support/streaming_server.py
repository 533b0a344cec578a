"""A local HTTP server with endless slow responses: a plain stream and an OpenAI-style
token stream. It counts open connections, so a test can see a client abort."""
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class StreamingServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), Handler)
        self.open_streams = 0
        self.streams_started = 0
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def stop(self):
        self.shutdown()
        self.server_close()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def stream(self, chunks):
        server = self.server
        with server.lock:
            server.open_streams += 1
            server.streams_started += 1
        try:
            for chunk in chunks:
                data = chunk.encode()
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError, OSError):
            pass  # the client went away: that is what the tests wait for
        finally:
            with server.lock:
                server.open_streams -= 1

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def forever():
            i = 0
            while True:
                time.sleep(0.05)
                i += 1
                yield f"line {i}\n"

        self.stream(forever())

    def do_POST(self):
        payload = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        limit = payload.get("max_tokens")
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def tokens():
            i = 0
            while limit is None or i < limit:
                time.sleep(0.02 if limit else 0.05)
                i += 1
                yield "data: " + json.dumps({"choices": [{"delta": {"content": f"t{i} "}}]}) + "\n\n"
            yield "data: [DONE]\n\n"

        self.stream(tokens())
