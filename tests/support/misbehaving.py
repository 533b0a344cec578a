"""Real servers that misbehave the ways production servers do, for the outcome-class tests
and the soak: an SMTP server (aiosmtpd) whose behaviour can be switched per message, an
HTTP server that reads a request and never answers, an HTTP API whose answers are
scripted request by request (ScriptedHttpServer), and a listener whose connect times out
(UnreachableListener)."""
import asyncio
import json
import socket
import struct
import threading
import time
import urllib.parse
from email import message_from_bytes
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from aiosmtpd.controller import Controller
from aiosmtpd.smtp import SMTP


class SmtpServer:
    """`mode` decides what happens to the next messages:
    - "ok": take it, answer 250;
    - "drop_after_data": take it (it is logged as received), then drop the connection
      before the final reply;
    - "reply_late": take it, answer 250 only after `late_seconds` (past the client's timeout);
    - "refuse_rcpt": answer 550 to RCPT TO (nothing is taken);
    - "refuse_mail", "refuse_data": answer `refusal` to MAIL FROM, or to the DATA command
      (instead of 354), so nothing is taken;
    - "refuse_message": read the message, then answer `refusal` as the final reply (not taken).
    `refusal` is the reply of the refuse_* modes ("550 ..." or a 4xx "try again later");
    refuse_rcpt keeps its own 550 unless `refusal` is set.
    `received` is the server's log: every message it took, in order; `commands` counts the
    MAIL FROM commands it answered (each attempt to send)."""

    def __init__(self, port: int):
        self.port = port
        self.mode = "ok"
        self.late_seconds = 3.0
        self.refusal: str | None = None
        self.received = []
        self.commands = 0
        self.lock = threading.Lock()
        self.controller = _RefusingController(self, hostname="127.0.0.1", port=port)

    def start(self):
        self.controller.start()
        return self

    def stop(self):
        self.controller.stop()

    def keys(self) -> list[str]:
        with self.lock:
            return [m["X-Idempotency-Key"] for m in self.received]

    async def handle_MAIL(self, server, session, envelope, address, mail_options):
        with self.lock:
            self.commands += 1
        if self.mode == "refuse_mail":
            return self.refusal or "550 5.7.1 sender refused"
        envelope.mail_from = address
        envelope.mail_options.extend(mail_options)
        return "250 OK"

    async def handle_RCPT(self, server, session, envelope, address, rcpt_options):
        if self.mode == "refuse_rcpt":
            return self.refusal or "550 5.1.1 <%s>: recipient unknown" % address
        envelope.rcpt_tos.append(address)
        return "250 OK"

    async def handle_DATA(self, server, session, envelope):
        if self.mode == "refuse_message":
            return self.refusal or "554 5.6.0 message refused"
        with self.lock:
            self.received.append(message_from_bytes(envelope.content))
        if self.mode == "drop_after_data":
            server.transport.abort()
            return "250 OK"  # never reaches the client
        if self.mode == "reply_late":
            await asyncio.sleep(self.late_seconds)
        return "250 OK"


class _RefusingSmtp(SMTP):
    """aiosmtpd has no hook for the DATA command itself (only for the message after it)."""

    async def smtp_DATA(self, arg):
        if self.event_handler.mode == "refuse_data" and self.envelope is not None and self.envelope.rcpt_tos:
            await self.push(self.event_handler.refusal or "554 5.3.0 no DATA now")
            return
        await super().smtp_DATA(arg)


class _RefusingController(Controller):
    def factory(self):
        return _RefusingSmtp(self.handler, **self.SMTP_kwargs)


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


class UnreachableListener:
    """A port whose connect times out: a listener with a backlog of 0 whose one queued
    connection is never accepted, so the kernel drops every further SYN (as a host behind a
    firewall that drops packets, or a server whose accept queue is full)."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(0)
        self.filler = socket.create_connection(self.sock.getsockname(), timeout=5)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}/charges"

    def stop(self):
        self.filler.close()
        self.sock.close()


class ScriptedHttpServer(ThreadingHTTPServer):
    """An order API whose answers to POSTs are scripted, one per request (`answers`, then
    `default`); each answer is a dict:
      {"status": 502, "acts": True, "headers": {...}}: the server records the request first
      (it acted; a keyed request is recorded once per Idempotency-Key, as a payment API does,
      an unkeyed one by its JSON body's "order")
      and then answers `status`; "acts": False answers without recording anything;
      {"reset": True, "acts": True}: it reads the request (acting on it or not) and resets
      the connection (RST) instead of answering.
    GET /status/<key> is the status lookup by idempotency key (or order): 200 if it acted on
    that key, else `status_missing` (404, or 410 for "gone").
    `requests` logs every request: (monotonic time, method, path, headers, body)."""

    daemon_threads = True

    def __init__(self, answers: list[dict] | None = None, default: dict | None = None, status_missing: int = 404):
        super().__init__(("127.0.0.1", 0), _ScriptedHandler)
        self.answers = list(answers or [])
        self.default = default or {"status": 200, "acts": True}
        self.status_missing = status_missing
        self.requests: list[tuple[float, str, str, dict, bytes]] = []
        self.acted: list[str] = []  # the key (or body) of every request it acted on, in order
        self.lock = threading.Lock()
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def url(self, path: str = "/orders") -> str:
        return f"http://127.0.0.1:{self.server_address[1]}{path}"

    def posts(self) -> list[tuple[float, str, str, dict, bytes]]:
        with self.lock:
            return [r for r in self.requests if r[1] == "POST"]

    def handle_error(self, request, client_address):
        pass  # a reset connection is the point, not a failure of the server

    def stop(self):
        self.shutdown()
        self.server_close()


def _order(body: bytes) -> str:
    """What an unkeyed request is recorded by: its JSON body's "order", else the body."""
    try:
        return str(json.loads(body)["order"])
    except (ValueError, KeyError, TypeError):
        return body.decode(errors="replace")


class _ScriptedHandler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _record(self, body: bytes) -> None:
        with self.server.lock:
            self.server.requests.append((time.monotonic(), self.command, self.path, dict(self.headers), body))

    def _answer(self, status: int, payload, headers: dict | None = None) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._record(body)
        key = self.headers.get("Idempotency-Key")
        with self.server.lock:
            answer = self.server.answers.pop(0) if self.server.answers else self.server.default
            if answer.get("acts", True) and not (key and key in self.server.acted):
                self.server.acted.append(key or _order(body))
        if answer.get("reset"):
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()  # an RST, not an answer
            self.close_connection = True
            return
        status = answer["status"]
        self._answer(status, {"order": key} if status < 400 else {"error": f"status {status}"}, answer.get("headers"))

    def do_GET(self):
        self._record(b"")
        key = urllib.parse.unquote(self.path.rsplit("/", 1)[-1])
        with self.server.lock:
            known = key in self.server.acted
        if known:
            self._answer(200, {"order": key, "state": "accepted"})
        else:
            self._answer(self.server.status_missing, {"error": "no such request"})
