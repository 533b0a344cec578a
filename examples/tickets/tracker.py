"""A small ticket tracker over HTTP (JSON), kept in memory: what the example tools talk to.

    GET  /tickets?q=words              tickets whose title or body holds every word (20 at most)
    GET  /tickets/<id>                 one ticket, with its comments
    POST /tickets                      {"title", "body"}; an Idempotency-Key header makes a repeat
                                       answer the ticket it made the first time (200, not 201)
    GET  /tickets/by-key/<key>         the ticket made with that key (404: none)
    POST /tickets/<id>/comments        {"text"}: a new comment each time (no key: not idempotent)

Run it: `python -m examples.tickets.tracker --port 8765`. Tests start it on a free port and may
set `after_write` (called after a write is applied, before the answer): to hold the answer
back, or to count.
"""
import argparse
import json
import sys
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit


class TicketTracker(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        super().__init__((host, port), _Handler)
        self.lock = threading.Lock()
        self.tickets: dict[int, dict] = {}
        self.by_key: dict[str, int] = {}
        self.requests: list[tuple[str, str]] = []  # (method, path) of every request, in order
        self.after_write: Callable[[str], None] | None = None
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.server_address[0]}:{self.server_address[1]}"

    def start(self) -> "TicketTracker":
        self.thread = threading.Thread(target=self.serve_forever, name="ticket-tracker", daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        self.shutdown()
        self.server_close()

    def handle_error(self, request, client_address) -> None:
        # A client that went away before its answer (a worker killed mid-call) is no error of ours.
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            super().handle_error(request, client_address)

    def comments(self) -> list[dict]:
        with self.lock:
            return [c for t in self.tickets.values() for c in t["comments"]]


class _Handler(BaseHTTPRequestHandler):
    server: TicketTracker
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _answer(self, status: int, payload) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> dict:
        length = int(self.headers.get("Content-Length") or 0)
        try:
            value = json.loads(self.rfile.read(length) or b"{}")
        except ValueError:
            return {}
        return value if isinstance(value, dict) else {}

    def _written(self, what: str) -> None:
        if self.server.after_write is not None:
            self.server.after_write(what)

    def do_GET(self):
        url = urlsplit(self.path)
        parts = [unquote(p) for p in url.path.strip("/").split("/")]
        tracker = self.server
        with tracker.lock:
            tracker.requests.append(("GET", url.path))
            if parts == ["tickets"]:
                words = " ".join(parse_qs(url.query).get("q", [""])).lower().split()
                found = [_summary(t) for t in tracker.tickets.values()
                         if all(w in f"{t['title']} {t['body']}".lower() for w in words)]
                return self._answer(200, {"tickets": found[:20]})
            if len(parts) == 3 and parts[:2] == ["tickets", "by-key"]:
                number = tracker.by_key.get(parts[2])
                if number is None:
                    return self._answer(404, {"error": f"no ticket was made with key {parts[2]!r}"})
                return self._answer(200, _summary(tracker.tickets[number]))
            if len(parts) == 2 and parts[0] == "tickets" and parts[1].isdigit() and int(parts[1]) in tracker.tickets:
                return self._answer(200, tracker.tickets[int(parts[1])])
        self._answer(404, {"error": f"nothing at {url.path}"})

    def do_POST(self):
        url = urlsplit(self.path)
        parts = url.path.strip("/").split("/")
        body = self._body()
        tracker = self.server
        with tracker.lock:
            tracker.requests.append(("POST", url.path))
            if parts == ["tickets"]:
                title = str(body.get("title") or "").strip()
                if not title:
                    return self._answer(422, {"error": "a ticket needs a title"})
                key = self.headers.get("Idempotency-Key") or ""
                if key and key in tracker.by_key:
                    return self._answer(200, _summary(tracker.tickets[tracker.by_key[key]]))
                number = len(tracker.tickets) + 1
                tracker.tickets[number] = {"id": number, "title": title, "body": str(body.get("body") or ""),
                                           "key": key, "comments": []}
                if key:
                    tracker.by_key[key] = number
                answer, status, what = _summary(tracker.tickets[number]), 201, f"ticket {number}"
            elif len(parts) == 3 and parts[0] == "tickets" and parts[2] == "comments" and parts[1].isdigit():
                ticket = tracker.tickets.get(int(parts[1]))
                if ticket is None:
                    return self._answer(404, {"error": f"there is no ticket {parts[1]}"})
                text = str(body.get("text") or "").strip()
                if not text:
                    return self._answer(422, {"error": "a comment needs text"})
                comment = {"ticket": ticket["id"], "number": len(ticket["comments"]) + 1, "text": text}
                ticket["comments"].append(comment)
                answer, status, what = comment, 201, f"comment {comment['number']} on ticket {ticket['id']}"
            else:
                return self._answer(404, {"error": f"nothing at {url.path}"})
        self._written(what)  # outside the lock: a held answer must not hold the tracker
        self._answer(status, answer)


def _summary(ticket: dict) -> dict:
    return {"id": ticket["id"], "title": ticket["title"], "body": ticket["body"],
            "comments": len(ticket["comments"])}


def main() -> None:
    parser = argparse.ArgumentParser(description="A small in-memory ticket tracker (examples/tickets).")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765)
    options = parser.parse_args()
    tracker = TicketTracker(options.host, options.port)
    print(f"ticket tracker on {tracker.url} (Ctrl-C stops it)")
    try:
        tracker.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
