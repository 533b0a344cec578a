"""Real servers that misbehave the ways production servers do, for the outcome-class tests
and the soak: an SMTP server (aiosmtpd) whose behaviour can be switched per message, and
an HTTP server that reads a request and never answers."""
import asyncio
import socket
import threading
from email import message_from_bytes

from aiosmtpd.controller import Controller


class SmtpServer:
    """`mode` decides what happens to the next messages:
    - "ok": take it, answer 250;
    - "drop_after_data": take it (it is logged as received), then drop the connection
      before the final reply;
    - "reply_late": take it, answer 250 only after `late_seconds` (past the client's timeout);
    - "refuse_rcpt": answer 550 to RCPT TO (nothing is taken).
    `received` is the server's log: every message it took, in order."""

    def __init__(self, port: int):
        self.port = port
        self.mode = "ok"
        self.late_seconds = 3.0
        self.received = []
        self.lock = threading.Lock()
        self.controller = Controller(self, hostname="127.0.0.1", port=port)

    def start(self):
        self.controller.start()
        return self

    def stop(self):
        self.controller.stop()

    def keys(self) -> list[str]:
        with self.lock:
            return [m["X-Idempotency-Key"] for m in self.received]

    async def handle_RCPT(self, server, session, envelope, address, rcpt_options):
        if self.mode == "refuse_rcpt":
            return "550 5.1.1 <%s>: recipient unknown" % address
        envelope.rcpt_tos.append(address)
        return "250 OK"

    async def handle_DATA(self, server, session, envelope):
        with self.lock:
            self.received.append(message_from_bytes(envelope.content))
        if self.mode == "drop_after_data":
            server.transport.abort()
            return "250 OK"  # never reaches the client
        if self.mode == "reply_late":
            await asyncio.sleep(self.late_seconds)
        return "250 OK"


class SilentHttpServer:
    """Accepts connections, reads each request (headers and a Content-Length body), counts it,
    and never answers; connections stay open until the server stops."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.requests: list[bytes] = []
        self.lock = threading.Lock()
        self.held: list[socket.socket] = []
        self.stopped = threading.Event()
        threading.Thread(target=self.serve, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}/charges"

    def serve(self):
        while not self.stopped.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self.read_request, args=(conn,), daemon=True).start()

    def read_request(self, conn):
        self.held.append(conn)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                return
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        while len(body) < length:
            chunk = conn.recv(65536)
            if not chunk:
                break
            body += chunk
        with self.lock:
            self.requests.append(head + b"\r\n\r\n" + body)

    def stop(self):
        self.stopped.set()
        self.sock.close()
        for conn in self.held:
            conn.close()
