"""Outcomes no longer guessed "not performed", and probes that settle an outcome in doubt by
asking the other side (issue 20, item 3), against real servers: an HTTP API that acts and
then answers 502 (or refuses with 503 + Retry-After), a payment-like API that dedupes by
Idempotency-Key and answers a status lookup by key (tests/support/keyed_server.py), a real
subprocess, and a real IMAP server (dovecot) holding the sending account's Sent folder."""
import json
import shutil
import sys
import threading
import urllib.parse
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from django.db import transaction
from django.urls import reverse
from django.utils import timezone

from orchestrator.engine import services
from orchestrator.engine.recovery import recover_task
from orchestrator.engine.worker import drive_inline
from orchestrator.models import Task, WalEntry
from orchestrator.primitives.cancellation import CancellationToken
from orchestrator.tools.base import OutcomeUnknown, ToolError
from orchestrator.tools.catalog import get_tool
from orchestrator.tools.email import message_id
from review.models import ReviewItem
from review.services import review_open
from tests.support import dovecot as dovecot_support
from tests.support.helpers import one_effect
from tests.support.keyed_server import KeyedServer, _Handler as KeyedHandler

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.task_types("tests.support.probe_types")]


# --- servers ------------------------------------------------------------------------------

class ActingServer(ThreadingHTTPServer):
    """An order API behind a proxy. POST /orders records the order (by the body's "order")
    and then answers `status` (a 502 is the proxy losing the upstream's answer after it
    acted); `refusals` POSTs first are refused with 503 + Retry-After and not recorded.
    GET /orders/<id> is the status lookup: 200 with the order, or 404."""

    daemon_threads = True

    def __init__(self, status: int = 200, refusals: int = 0):
        super().__init__(("127.0.0.1", 0), _ActingHandler)
        self.status, self.refusals = status, refusals
        self.orders: dict[str, int] = {}  # order -> times recorded
        self.posts = 0
        self.lock = threading.Lock()
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def url(self, path: str = "/orders") -> str:
        return f"http://127.0.0.1:{self.server_address[1]}{path}"

    def stop(self):
        self.shutdown()
        self.server_close()


class _ActingHandler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _answer(self, status: int, payload: dict, headers: dict | None = None):
        body = json.dumps(payload).encode()
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        order = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))["order"]
        with self.server.lock:
            self.server.posts += 1
            if self.server.refusals:
                self.server.refusals -= 1
                refused = True
            else:
                refused = False
                self.server.orders[order] = self.server.orders.get(order, 0) + 1
        if refused:
            return self._answer(503, {"error": "busy"}, {"Retry-After": "0"})
        self._answer(self.server.status, {"order": order} if self.server.status < 400 else {"error": "bad gateway"})

    def do_GET(self):
        order = self.path.rsplit("/", 1)[-1]
        with self.server.lock:
            known = order in self.server.orders
        self._answer(200, {"order": order, "state": "accepted"}) if known else self._answer(404, {"error": "none"})


class _KeyedStatusHandler(KeyedHandler):
    """keyed_server's API plus its status lookup: GET /charges/<key> answers the stored
    charge (200) or 404 for a key it never executed."""

    def do_GET(self):
        key = urllib.parse.unquote(self.path.rsplit("/", 1)[-1])
        with self.server.lock:
            known = key in self.server.executed
        body = json.dumps({"charge": key} if known else {"error": "no such key"}).encode()
        self.send_response(200 if known else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class KeyedStatusServer(KeyedServer):
    def __init__(self):
        ThreadingHTTPServer.__init__(self, ("127.0.0.1", 0), _KeyedStatusHandler)
        self.executed, self.requests, self.lock = {}, 0, threading.Lock()
        threading.Thread(target=self.serve_forever, daemon=True).start()


@pytest.fixture
def acting():
    servers = []

    def start(**kwargs) -> ActingServer:
        servers.append(ActingServer(**kwargs))
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def keyed_status():
    server = KeyedStatusServer()
    yield server
    server.stop()


@pytest.fixture
def imap(settings):
    if not dovecot_support.available():
        pytest.skip("dovecot is not installed (apt-get install -y dovecot-imapd; .ci/run installs it)")
    server = dovecot_support.Dovecot()
    server.settings(settings)
    yield server
    server.stop()


# --- helpers ------------------------------------------------------------------------------

def open_items(task: Task) -> list[ReviewItem]:
    return list(ReviewItem.objects.filter(task=task, status="open"))


def stranded(tool: str, args: dict, *, status: str = "running", idempotent: bool = False) -> tuple[Task, WalEntry]:
    """A task whose worker died (stale heartbeat) with `tool`'s intent written and its
    outcome never recorded, exactly as after a kill -9 between the two."""
    task = services.task_create(type="test.one_effect", params={"tool": tool, "args": args})
    Task.objects.filter(pk=task.pk).update(status=status, lease_owner="host:1", lease_epoch=1,
                                           heartbeat_at=timezone.now() - timedelta(hours=1))
    entry = WalEntry.objects.create(task=task, step_id="effect", call_index=0, tool=tool,
                                    args=get_tool(tool).wal_args(args), idempotency_key=f"t{task.pk}:effect:0",
                                    idempotent=idempotent, lease_epoch=1, worker="host:1")
    return task, entry


# --- HTTP status classes ------------------------------------------------------------------

@pytest.mark.parametrize("status", [500, 502, 504])
def test_a_post_answered_5xx_after_the_server_recorded_it_goes_to_review(acting, status):
    server = acting(status=status)
    task = one_effect("http.request", {"method": "POST", "url": server.url(), "json": {"order": "o-1"}})
    assert task.status == "awaiting_review", task.status_reason
    [item] = open_items(task)
    assert item.evidence["status"] == status and item.evidence["phase"] == "answered with an error status"
    assert "names no status_url" in item.evidence["probe"]  # the probe ran and could not tell
    assert server.orders == {"o-1": 1}  # acted once, never repeated blindly


def test_a_post_answered_502_with_a_status_url_is_settled_done_by_its_probe(acting):
    server = acting(status=502)
    task = one_effect("http.request", {"method": "POST", "url": server.url(), "json": {"order": "o-2"},
                                       "status_url": server.url("/orders/o-2")})
    assert task.status == "completed", task.status_reason
    assert not ReviewItem.objects.filter(task=task).exists()
    entry = WalEntry.objects.get(task=task)
    assert entry.status == "done" and entry.settled_by == "probe"
    assert entry.result["recorded"] == {"order": "o-2", "state": "accepted"}
    assert server.orders == {"o-2": 1} and server.posts == 1


def test_a_post_refused_with_503_and_retry_after_is_not_performed_and_retried(acting):
    server = acting(status=200, refusals=1)
    task = one_effect("http.request", {"method": "POST", "url": server.url(), "json": {"order": "o-3"}})
    assert task.status == "completed", task.status_reason
    assert not ReviewItem.objects.filter(task=task).exists()
    assert task.steps.get(step_id="effect").attempts == 2
    assert server.posts == 2 and server.orders == {"o-3": 1}


def test_a_post_refused_with_a_4xx_stays_not_performed(acting):
    server = acting(status=422)
    task = one_effect("http.request", {"method": "POST", "url": server.url(), "json": {"order": "o-4"}},
                      on_failure="fail")
    assert task.status == "failed" and not ReviewItem.objects.filter(task=task).exists()
    assert WalEntry.objects.get(task=task).status == "failed"


# --- shell.run exit codes -----------------------------------------------------------------

def appends_then_fails(path) -> list[str]:
    return [sys.executable, "-c", f"open({str(path)!r}, 'a').write('x'); raise SystemExit(1)"]


def test_shell_run_that_exits_1_did_unknown_work_and_goes_to_review(tmp_path):
    marker = tmp_path / "written"
    task = one_effect("shell.run", {"argv": appends_then_fails(marker)})
    assert task.status == "awaiting_review", task.status_reason
    [item] = open_items(task)
    assert item.evidence["returncode"] == 1 and item.evidence["phase"] == "exited non-zero"
    assert marker.read_text() == "x"  # ran once: not repeated as if nothing had happened


def test_shell_run_that_declares_a_nonzero_exit_does_nothing_is_retried(tmp_path):
    marker = tmp_path / "written"
    task = one_effect("shell.run", {"argv": appends_then_fails(marker), "nonzero_means_not_performed": True},
                      on_failure="fail")
    assert task.status == "failed" and not ReviewItem.objects.filter(task=task).exists()
    entry = WalEntry.objects.get(task=task)
    assert entry.status == "failed" and "non-zero exit means nothing was done" in entry.error
    assert len(marker.read_text()) == task.steps.get(step_id="effect").attempts >= 2


def test_shell_run_exit_classes_at_the_tool():
    tool, token = get_tool("shell.run"), CancellationToken()
    with pytest.raises(OutcomeUnknown):
        tool.perform({"argv": [sys.executable, "-c", "raise SystemExit(3)"]}, key="k1", token=token)
    with pytest.raises(ToolError):
        tool.perform({"argv": [sys.executable, "-c", "raise SystemExit(3)"], "nonzero_means_not_performed": True},
                     key="k2", token=token)


@pytest.mark.skipif(shutil.which("bwrap") is None,
                    reason="sandbox test skipped: no bwrap (enable it with `apt-get install bubblewrap`)")
def test_a_sandboxed_command_that_exits_non_zero_is_not_performed():
    # Whatever it did stayed in its scratch directory, removed after: nothing to review.
    with pytest.raises(ToolError) as refused:
        get_tool("shell.run").perform({"argv": ["/bin/sh", "-c", "echo x > f; exit 4"], "sandbox": True}, key="k3",
                                      token=CancellationToken())
    assert not isinstance(refused.value, OutcomeUnknown) and "exited with 4" in str(refused.value)


# --- probes in recovery and in the review queue ---------------------------------------------

def test_recovery_of_a_stopped_tasks_pending_keyed_call_is_settled_by_its_probe(keyed_status):
    args = {"method": "POST", "url": keyed_status.url, "json": {"amount": 42}, "idempotency_key": True,
            "status_url": keyed_status.url + "/{key}"}
    task, entry = stranded("http.request", args, status="stopping", idempotent=True)
    token = CancellationToken()
    get_tool("http.request").perform(args, key=entry.idempotency_key, token=token)  # the dead worker's call
    assert recover_task(task.pk)
    task.refresh_from_db()
    entry.refresh_from_db()
    assert task.status == "stopped"
    assert not ReviewItem.objects.filter(task=task).exists()  # before the probe: a review item
    assert entry.status == "done" and entry.settled_by == "probe"
    assert entry.result["recorded"] == {"charge": entry.idempotency_key}
    assert keyed_status.executed == {entry.idempotency_key: 1} and keyed_status.requests == 1  # asked, not replayed


def test_recovery_of_a_keyed_call_the_server_never_saw_is_settled_not_done_and_never_replayed(keyed_status):
    args = {"method": "POST", "url": keyed_status.url, "json": {"amount": 42}, "idempotency_key": True,
            "status_url": keyed_status.url + "/{key}"}
    task, entry = stranded("http.request", args, status="stopping", idempotent=True)
    assert recover_task(task.pk)
    entry.refresh_from_db()
    assert entry.status == "failed" and entry.settled_by == "probe" and "answered 404" in entry.error
    assert not ReviewItem.objects.filter(task=task).exists()
    assert keyed_status.requests == 0  # the task ended: nothing was performed


def test_a_probe_that_cannot_reach_the_server_leaves_the_effect_to_a_reviewer(acting):
    server = acting()
    args = {"method": "POST", "url": server.url(), "json": {"order": "o-5"}, "status_url": server.url("/x")}
    server.stop()  # gone: the probe cannot ask
    task, entry = stranded("http.request", args)
    assert recover_task(task.pk)
    [item] = open_items(task)
    assert "cannot tell" in item.evidence["probe"]
    entry.refresh_from_db()
    assert entry.status == "pending" and entry.settled_by == ""


def test_review_open_runs_the_probe_first_and_a_task_left_awaiting_continues(acting):
    server = acting(status=200)
    args = {"method": "POST", "url": server.url(), "json": {"order": "o-6"}, "status_url": server.url("/orders/o-6")}
    get_tool("http.request").perform(args, key="any", token=CancellationToken())  # the server has it
    task, entry = stranded("http.request", args, status="awaiting_review")
    Task.objects.filter(pk=task.pk).update(lease_owner="")
    with transaction.atomic():
        assert review_open(entry=entry, reason="worker host:1 died") is None
    entry.refresh_from_db()
    task.refresh_from_db()
    assert entry.status == "done" and entry.settled_by == "probe"
    assert task.status == "queued", task.status_reason  # nothing left to review: it goes on
    drive_inline(task.pk)
    assert Task.objects.get(pk=task.pk).status == "completed"
    assert server.orders == {"o-6": 1}


# --- email.send: the Sent folder over IMAP (dovecot) ---------------------------------------

def email_args(to="ann@example.org") -> dict:
    return {"to": to, "subject": "invoice", "body": "hello"}


def test_the_imap_probe_finds_a_sent_message_by_message_id(smtp, imap):
    tool, args = get_tool("email.send"), email_args()
    tool.perform(args, key="t1:send:0", token=CancellationToken())
    assert smtp.keys() == ["t1:send:0"]
    found = tool.probe(tool.wal_args(args), key="t1:send:0")
    assert found.state == "done", found.how
    assert found.result["message_id"] == message_id("t1:send:0")
    never = tool.probe(tool.wal_args(args), key="t1:send:1")
    assert never.state == "not_done", never.how


def test_the_imap_probe_cannot_tell_a_send_cut_after_data_nor_one_from_before_copies(smtp, imap):
    tool, args = get_tool("email.send"), email_args()
    smtp.mode = "drop_after_data"
    with pytest.raises(OutcomeUnknown):
        tool.perform(args, key="t2:send:0", token=CancellationToken())
    cut = tool.probe(tool.wal_args(args), key="t2:send:0")
    assert cut.state == "unknown" and "never marked sent" in cut.how
    # An intent written before the account was configured: a missing copy proves nothing.
    assert tool.probe(args, key="t2:send:9").state == "unknown"


def test_a_refused_email_leaves_no_copy_that_counts(smtp, imap):
    tool, args = get_tool("email.send"), email_args()
    smtp.mode = "refuse_rcpt"
    with pytest.raises(ToolError):
        tool.perform(args, key="t3:send:0", token=CancellationToken())
    assert tool.probe(tool.wal_args(args), key="t3:send:0").state == "not_done"


def test_a_send_whose_copy_cannot_be_filed_is_not_performed(smtp, imap, settings):
    settings.EMAIL_IMAP_PASSWORD = "wrong"
    with pytest.raises(ToolError, match="could not file a copy"):
        get_tool("email.send").perform(email_args(), key="t4:send:0", token=CancellationToken())
    assert smtp.received == []


def test_recovery_settles_an_email_the_dead_worker_sent_by_the_sent_folder(smtp, imap):
    task, entry = stranded("email.send", email_args())
    get_tool("email.send").perform(email_args(), key=entry.idempotency_key, token=CancellationToken())
    assert recover_task(task.pk)
    entry.refresh_from_db()
    assert entry.status == "done" and entry.settled_by == "probe"
    assert not ReviewItem.objects.filter(task=task).exists()
    drive_inline(task.pk)
    assert Task.objects.get(pk=task.pk).status == "completed"
    assert smtp.keys() == [entry.idempotency_key]  # once


def test_recovery_settles_an_email_never_begun_as_not_done_and_sends_it_once(smtp, imap):
    task, entry = stranded("email.send", email_args())
    assert recover_task(task.pk)
    entry.refresh_from_db()
    assert entry.status == "failed" and entry.settled_by == "probe"
    assert not ReviewItem.objects.filter(task=task).exists()
    drive_inline(task.pk)
    assert Task.objects.get(pk=task.pk).status == "completed"
    assert smtp.keys() == [entry.idempotency_key]


# --- the share settled by probes --------------------------------------------------------------

def test_the_review_queue_shows_the_share_of_unknowns_settled_by_probes(acting, keyed_status, reviewer, client):
    client.force_login(reviewer)
    assert "No side effect has been in doubt yet" in client.get(reverse("review:queue")).content.decode()
    server = acting(status=502)
    one_effect("http.request", {"method": "POST", "url": server.url(), "json": {"order": "o-7"},
                                "status_url": server.url("/orders/o-7")})  # settled by its probe
    one_effect("http.request", {"method": "POST", "url": server.url(), "json": {"order": "o-8"}})  # review
    page = client.get(reverse("review:queue")).content.decode()
    assert "without a reviewer: 1 of 2 effects in doubt (50 %)" in page
