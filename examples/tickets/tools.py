"""The ticket tracker's tools, one per effect class worth showing.

What a failure means is the tool's to say, and the harness acts on it:
- NotPerformed (ToolError): nothing reached the tracker, or it refused (a 4xx): safe to retry;
- OutcomeUnknown: the request left and no answer came (a timeout or a reset after sending, a 5xx):
  a keyed call is replayed with the same key, a non-idempotent one goes to a reviewer;
- Cancelled before sending (call.raise_if_cancelled()): not performed either.
"""
import http.client
import json
import os
import socket
from urllib.parse import quote, urlencode, urlsplit

from pydantic import BaseModel, ConfigDict, Field

from orchestrator.sdk import (KEYED, NON_IDEMPOTENT, READ_ONLY, NotPerformed, OutcomeUnknown, ProbeResult, ToolCall,
                              tool)

DEFAULT_URL = "http://127.0.0.1:8765"
CLIENT_TIMEOUT_SECONDS = 10.0  # when the call has no deadline of its own


def tracker_url() -> str:
    return os.environ.get("TICKETS_URL", DEFAULT_URL).rstrip("/")


def request(method: str, path: str, call: ToolCall, *, body: dict | None = None,
            key: str | None = None) -> tuple[int, dict]:
    """(status, JSON answer) of one request to the tracker. Cancelling the call closes the
    connection at once; a failure is sorted by whether the request can have been taken."""
    url = urlsplit(tracker_url())
    timeout = call.seconds_left() or CLIENT_TIMEOUT_SECONDS
    connection = http.client.HTTPConnection(url.hostname, url.port or 80, timeout=timeout)
    forget = call.token.on_cancel(lambda reason: _shut(connection))
    sent = False
    try:
        call.raise_if_cancelled()
        try:
            connection.connect()
        except OSError as exc:
            raise NotPerformed(f"the tracker at {tracker_url()} cannot be reached: {exc}") from None
        headers = {"Content-Type": "application/json"}
        if key:
            headers["Idempotency-Key"] = key
        connection.request(method, path, body=None if body is None else json.dumps(body), headers=headers)
        sent = True
        response = connection.getresponse()
        status, text = response.status, response.read()
    except (OSError, http.client.HTTPException) as exc:
        if not sent:  # a request the server did not get whole is not acted on
            call.raise_if_cancelled()
            raise NotPerformed(f"{method} {path}: the request could not be sent: {exc}") from None
        why = "cancelled" if call.token.cancelled else type(exc).__name__
        raise OutcomeUnknown(f"{method} {path}: no answer from the tracker ({why}: {exc})",
                             evidence={"phase": "request sent, no answer", "error": str(exc)}) from None
    finally:
        forget()
        connection.close()
    try:
        answer = json.loads(text or b"{}")
    except ValueError:
        answer = {"text": text[:500].decode(errors="replace")}
    return status, answer


def _shut(connection: http.client.HTTPConnection) -> None:
    if connection.sock is not None:
        try:
            connection.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def expect_ok(method: str, path: str, status: int, answer: dict) -> dict:
    if 200 <= status < 300:
        return answer
    if status >= 500:  # the tracker may have acted before it failed
        raise OutcomeUnknown(f"{method} {path}: the tracker answered {status}", evidence={"status": status,
                                                                                         "answer": answer})
    raise NotPerformed(f"{method} {path}: the tracker refused it ({status}: {answer.get('error', answer)})")


class SearchArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    query: str = Field(..., min_length=1, max_length=200,
                       description="words that must all appear in a ticket's title or body")


@tool("tickets_search", effect=READ_ONLY, timeout=10,
      description="Search the ticket tracker: the tickets whose title or body holds every word (20 at most).")
def search(args: SearchArgs, call: ToolCall) -> dict:
    path = "/tickets?" + urlencode({"q": args.query})
    return expect_ok("GET", "/tickets", *request("GET", path, call))


class CreateArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    title: str = Field(..., min_length=1, max_length=200, description="the ticket's title")
    body: str = Field("", max_length=20_000, description="what happened, and what is expected")


def find_created(args: CreateArgs, call: ToolCall) -> ProbeResult:
    """Ask the tracker for the ticket made with this call's key: it happened, or it did not."""
    path = f"/tickets/by-key/{quote(call.key or '', safe='')}"
    status, answer = request("GET", path, call)
    if status == 200:
        return ProbeResult.done(answer, f"GET {path}: 200, ticket #{answer.get('id')}")
    if status == 404:
        return ProbeResult.not_done(f"GET {path}: 404, no ticket was made with this key")
    return ProbeResult.unknown(f"GET {path}: {status}")


@tool("tickets_create", effect=KEYED, timeout=10, probe=find_created,
      description="Open a ticket in the tracker (a repeat of the same call does not open a second one).")
def create(args: CreateArgs, call: ToolCall) -> dict:
    # The idempotency key travels to the tracker, which answers a repeat with the first ticket.
    return expect_ok("POST", "/tickets", *request("POST", "/tickets", call, body=args.model_dump(), key=call.key))


class CommentArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ticket: int = Field(..., ge=1, description="the ticket's number")
    text: str = Field(..., min_length=1, max_length=20_000, description="the comment")


@tool("tickets_comment", effect=NON_IDEMPOTENT, timeout=10,
      description="Add a comment to a ticket (everyone watching it is notified; it cannot be taken back).")
def comment(args: CommentArgs, call: ToolCall) -> dict:
    # The tracker has no key for comments: a repeat would comment twice. NON_IDEMPOTENT says so:
    # an agent's call waits for a reviewer, and an unknown outcome goes to one.
    path = f"/tickets/{args.ticket}/comments"
    return expect_ok("POST", path, *request("POST", path, call, body={"text": args.text}))
