"""What the soak's new faults (bench/soak.py: Stop/Force with POSTs in flight, upstream 502s
after acting, step timeouts) found in the engine, each against a real HTTP server (and, for
the step timeout during an outage, real workers and a private PostgreSQL stopped mid-step).

The task type is the soak's own (bench/soak_types.py, `soak.post`): a step POSTs through the WAL
and returns the answer's status, as a step that reads its answer does."""
import json
import select
import socket
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from orchestrator.engine import services
from orchestrator.engine.worker import drive_inline
from orchestrator.models import Step, Task, WalEntry
from review.models import ReviewItem
from review.services import review_decide
from tests.conftest import process_env, wait_for
from tests.engine.test_outages import create_tasks, private_postgres, query, statuses  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.task_types("bench.soak_types")]


class ActsThenAnswers502:
    """Records each POST (it acted on it), then answers 502 Bad Gateway: the upstream acted, the
    answer says it failed. After `failures` such answers it answers 200."""

    def __init__(self):
        server = self
        self.received: list[dict] = []
        self.keys: list[str | None] = []
        self.failures = 1_000_000

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                server.received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                server.keys.append(self.headers.get("Idempotency-Key"))
                status = 502 if len(server.received) <= server.failures else 200
                self.send_response(status)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/charges"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def upstream_502():
    server = ActsThenAnswers502()
    yield server
    server.stop()


def test_a_post_a_reviewer_confirmed_gives_the_step_the_answer_shape_it_reads(upstream_502, reviewer):
    """A 502 after the upstream acted is an unknown outcome: review. The reviewer confirms it
    happened without typing a result: the step gets http.request's own shape (status unknown),
    not a bare {"confirmed_by_reviewer": true} it cannot read (the soak saw soak.post fail twice
    on KeyError 'status' and wait for a human)."""
    task = services.task_create(type="soak.post", params={"url": upstream_502.url, "requests": 1, "pause": 0})
    drive_inline(task.pk)
    task.refresh_from_db()
    assert task.status == "awaiting_review", task.status_reason
    item = ReviewItem.objects.get(task=task, status="open")
    assert "502" in item.reason and len(upstream_502.received) == 1

    review_decide(item_id=item.pk, decision="happened", note="in the upstream's log", actor=reviewer)
    drive_inline(task.pk)
    task.refresh_from_db()
    assert task.status == "completed", task.status_reason
    entry = WalEntry.objects.get(task=task)
    assert entry.result == {"status": None, "body": "", "truncated": False, "confirmed_by_reviewer": True}
    assert Step.objects.get(task=task, step_id="post-01").result == {"status": None}
    assert len(upstream_502.received) == 1  # acted on once: never sent again


class HoldingUpstream:
    """Acts on each keyed POST (records its Idempotency-Key) and holds the answer until the
    client goes away; GET /status/<key> answers 200 with the record for a key it acted on, 404
    otherwise (what http.request's probe asks)."""

    def __init__(self):
        server = self
        self.acted: dict[str, dict] = {}
        self.arrived = threading.Event()
        self.release = threading.Event()

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.acted[self.headers["Idempotency-Key"]] = body
                server.arrived.set()
                server.release.wait(30)  # the client is cut off meanwhile

            def do_GET(self):
                key = urllib.parse.unquote(self.path.rpartition("/status/")[2])
                found = server.acted.get(key)
                data = json.dumps(found).encode()
                self.send_response(200 if found is not None else 404)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        base = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.url, self.status_url = f"{base}/charges", f"{base}/status/{{key}}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self):
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def holding_upstream():
    server = HoldingUpstream()
    yield server
    server.stop()


def stop_in_flight(task: Task, upstream: HoldingUpstream, operator) -> Task:
    from tests.support.helpers import drive_and_close

    runner = threading.Thread(target=drive_and_close, args=(task.pk,))
    runner.start()
    assert upstream.arrived.wait(30), "the POST never reached the upstream"
    services.task_stop(task_id=task.pk, actor=operator)  # cancels the request in flight
    runner.join(timeout=30)
    assert not runner.is_alive()
    return Task.objects.get(pk=task.pk)


def test_a_keyed_post_cut_by_stop_is_not_recorded_as_not_performed(holding_upstream, operator):
    """A keyed (idempotent) POST whose answer never came is retried with its key while the task
    goes on; but Stop ends the task, nothing retries it, and the upstream did act. Its WAL row
    must not say `failed` ("did not happen") with nobody asked: like any effect in doubt on an
    ended task it goes to a reviewer (the soak's `unreviewed unknown effects` counted it)."""
    task = services.task_create(type="soak.post", params={"url": holding_upstream.url, "requests": 1, "pause": 0,
                                                          "keyed": True})
    task = stop_in_flight(task, holding_upstream, operator)
    assert task.status == "stopped", task.status_reason
    entry = WalEntry.objects.get(task=task)
    assert entry.status == "pending" and "outcome unknown" in entry.error, (entry.status, entry.error)
    item = ReviewItem.objects.get(task=task, status="open")
    assert item.wal_entry == entry and "1 side effect(s) in doubt" in task.status_reason
    assert list(holding_upstream.acted) == [entry.idempotency_key]


def test_a_keyed_post_cut_by_stop_is_settled_by_its_probe_when_it_names_a_status_url(holding_upstream, operator):
    """The same, with a status_url: the probe asks the upstream, which acted on the key, so the
    effect is recorded done (settled_by probe) and no reviewer is asked."""
    task = services.task_create(type="soak.post", params={
        "url": holding_upstream.url, "status_url": holding_upstream.status_url, "requests": 1, "pause": 0,
        "keyed": True})
    task = stop_in_flight(task, holding_upstream, operator)
    assert task.status == "stopped", task.status_reason
    entry = WalEntry.objects.get(task=task)
    assert (entry.status, entry.settled_by) == ("done", "probe"), (entry.status, entry.error)
    assert entry.result["recorded"] == {"ref": f"t{task.pk}:post-01"}
    assert not ReviewItem.objects.filter(task=task).exists()


def test_a_keyed_post_in_doubt_while_the_task_goes_on_is_replayed_with_its_key(upstream_502):
    """Unchanged by keeping the row pending: a keyed POST answered 502 is retried with the same
    key (the upstream dedupes by it), and the row ends done."""
    upstream_502.failures = 1
    task = services.task_create(type="soak.post", params={"url": upstream_502.url, "requests": 1, "pause": 0,
                                                          "keyed": True})
    drive_inline(task.pk)
    task.refresh_from_db()
    assert task.status == "completed", task.status_reason
    entry = WalEntry.objects.get(task=task)
    assert (entry.status, entry.error) == ("done", "") and entry.result["status"] == 200
    assert upstream_502.keys == [entry.idempotency_key] * 2


def test_a_keyed_post_that_keeps_failing_waits_for_a_human_with_its_outcome_unknown(upstream_502, operator):
    """Every answer is 502: after two attempts the step waits for a human, and its row says
    what is known — pending (unknown), not failed (did not happen): the upstream acted twice.
    A Stop then puts it before a reviewer, as any effect in doubt on an ended task."""
    task = services.task_create(type="soak.post", params={"url": upstream_502.url, "requests": 1, "pause": 0,
                                                          "keyed": True})
    drive_inline(task.pk)
    task.refresh_from_db()
    assert task.status == "needs_human", task.status_reason
    assert len(upstream_502.received) == 2
    entry = WalEntry.objects.get(task=task)
    assert entry.status == "pending" and "502" in entry.error
    services.task_stop(task_id=task.pk, actor=operator)
    assert Task.objects.get(pk=task.pk).status == "stopped"
    assert ReviewItem.objects.get(task=task, status="open").wal_entry == entry


class HoldsAndWatches:
    """Takes a POST, then holds the answer for `hold` seconds while watching the connection:
    `gone_after` is how long after the request arrived the client closed it (None: it waited
    for the answer)."""

    def __init__(self, hold: float):
        server = self
        self.arrived = threading.Event()
        self.gone_after: float | None = None
        self.answered = threading.Event()

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                arrived = time.monotonic()
                server.arrived.set()
                while time.monotonic() - arrived < hold:
                    readable, _, _ = select.select([self.connection], [], [], 0.02)
                    if readable and not self.connection.recv(1, socket.MSG_PEEK):
                        server.gone_after = time.monotonic() - arrived
                        return
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")
                server.answered.set()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/charges"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.mark.workers
def test_a_step_timeout_cuts_the_step_while_the_database_is_down(private_postgres, start_workers):
    """The step's timeout needs no database: it cuts a POST held past it while PostgreSQL is
    down (before, the supervisor checked timeouts only after a successful poll of the task's
    row, so a hung step ran on for the whole outage: the soak's step_timeout faults that met a
    pg_restart were answered 6 s later and committed as if nothing had happened)."""
    upstream = HoldsAndWatches(hold=15)
    try:
        env = {"DATABASE_URL": private_postgres.url, "ORCH_EXTRA_TASK_TYPES": "bench.soak_types"}
        start_workers(1, **env)
        [task_id] = create_tasks(process_env(**env), "soak.post",
                                 {"url": upstream.url, "requests": 1, "pause": 0, "step_timeout": 1.0}, 1)
        assert upstream.arrived.wait(60), "the POST never reached the upstream"
        private_postgres.stop()
        try:
            # Down for longer than the timeout and the margin: the cut cannot wait for it.
            wait_for(lambda: upstream.gone_after is not None, timeout=6,
                     message="the step's timeout to cut the POST while the database is down")
        finally:
            private_postgres.start()
        assert upstream.gone_after < 4, upstream.gone_after
        # Once the database is back: the POST's outcome is unknown (it was cut in flight): review.
        wait_for(lambda: statuses(private_postgres, [task_id])[task_id] == "awaiting_review", timeout=60,
                 message="the task to wait for a review")
        assert query(private_postgres, "SELECT status FROM orchestrator_walentry") == [("pending",)]
        assert query(private_postgres, "SELECT count(*) FROM review_reviewitem WHERE status = 'open'") == [(1,)]
        assert not upstream.answered.is_set()
    finally:
        upstream.stop()
