"""A frozen process holding the database's write lock (issue 20, item 9), with real processes.

SQLite has one write lock: a worker stopped (SIGSTOP, a paused VM) in the middle of a write
blocks every writer. The web must not hang for the workers' 30 s busy timeout: it answers 503
with Retry-After within a few seconds, and succeeds once the holder is gone. PostgreSQL locks
rows: the same frozen holder does not stop task creation at all. And the engine never holds
a write transaction across a slow call (a sleep, a model stream, an HTTP request in flight)."""
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from django.db import connection

from orchestrator.auth import token_issue
from orchestrator.engine import services
from orchestrator.models import Task
from tests.conftest import database_url, wait_for
from tests.support.streaming_server import StreamingServer

pytestmark = pytest.mark.django_db(transaction=True)

TEST_TYPES = "tests.support.testtypes"

# A process that takes the write lock, writes, says so, and freezes itself with the lock held.
HOLD_SQLITE = """
import os, signal, sqlite3, sys
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("BEGIN IMMEDIATE")
db.execute("UPDATE auth_user SET last_name = last_name")
print("holding", flush=True)
os.kill(os.getpid(), signal.SIGSTOP)
"""
# The same on PostgreSQL: a transaction that has written one task's row, then frozen.
HOLD_POSTGRESQL = """
import os, signal, sys, psycopg
db = psycopg.connect(sys.argv[1])
db.execute("UPDATE orchestrator_task SET title = title WHERE id = %s", (int(sys.argv[2]),))
print("holding", flush=True)
os.kill(os.getpid(), signal.SIGSTOP)
"""


def is_sqlite() -> bool:
    return connection.vendor == "sqlite"


class FrozenLockHolder:
    """A real process that holds a write lock and is stopped (state T) until killed."""

    def __init__(self, *extra: str):
        script = HOLD_SQLITE if is_sqlite() else HOLD_POSTGRESQL
        target = connection.settings_dict["NAME"] if is_sqlite() else database_url()
        self.proc = subprocess.Popen([sys.executable, "-c", script, target, *extra], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        line = self.proc.stdout.readline()
        assert line.strip() == "holding", line + self.proc.stdout.read()
        wait_for(lambda: process_state(self.proc.pid) == "T", timeout=10, message="the lock holder to be stopped")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # SIGKILL ends a stopped process too; SQLite/PostgreSQL drop its lock
        self.proc.wait(timeout=10)
        self.proc.stdout.close()


def process_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]


@pytest.fixture
def frozen_lock_holder():
    holders = []

    def start(*extra: str) -> FrozenLockHolder:
        holders.append(FrozenLockHolder(*extra))
        return holders[-1]

    yield start
    for holder in holders:
        holder.kill()


def post_task(port: int, token: str) -> tuple[int, dict, dict, float]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/api/tasks", method="POST",
                                     data=json.dumps({"type": "demo.pipeline"}).encode(),
                                     headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    began = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, dict(response.headers), json.loads(response.read()), time.monotonic() - began
    except urllib.error.HTTPError as exc:
        body = exc.read()
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = {"raw": body.decode(errors="replace")[:2000]}
        return exc.code, dict(exc.headers), parsed, time.monotonic() - began


def sqlite_write_within(seconds: float) -> float:
    """Take SQLite's write lock from a connection of our own, write, commit: how long it took
    (sqlite3.OperationalError "database is locked" when another process held it for `seconds`)."""
    db = sqlite3.connect(connection.settings_dict["NAME"], timeout=seconds, isolation_level=None)
    try:
        began = time.monotonic()
        db.execute("BEGIN IMMEDIATE")
        db.execute("UPDATE auth_user SET last_name = last_name")
        db.execute("COMMIT")
        return time.monotonic() - began
    finally:
        db.close()


def test_api_answers_503_with_retry_after_within_seconds_while_a_frozen_process_holds_the_lock(
        start_web, make_user, frozen_lock_holder):
    token = token_issue(user=make_user("olga", "operator"))
    other = services.task_create(type="demo.pipeline", params={})  # the PostgreSQL holder's row
    _, port = start_web()
    assert post_task(port, token)[0] == 201  # the server is up and the request is right

    holder = frozen_lock_holder(str(other.pk))
    status, headers, body, took = post_task(port, token)
    if is_sqlite():
        # Before: the request hung for the whole 30 s busy timeout, then a 500 (a traceback with DEBUG).
        assert status == 503, (status, body)
        assert took < 6, f"the 503 took {took:.1f} s"
        assert 1 <= int(headers["Retry-After"]) <= 10
        assert "database is busy" in body["detail"] and "Try again in" in body["detail"], body
        assert "kill" in body["detail"] and "PostgreSQL" in body["detail"]  # what a person can do about it
        assert body["errors"] == []
    else:
        # Row locks: a frozen transaction holding another task's row does not block task creation.
        assert status == 201 and took < 6, (status, body, took)

    holder.kill()
    status, _, body, took = post_task(port, token)
    assert status == 201, (status, body)
    assert Task.objects.filter(pk=body["id"]).exists()


@pytest.mark.skipif("os.environ.get('DATABASE_URL', '').startswith('postgres')",
                    reason="SQLite's single write lock; PostgreSQL locks rows")
def test_page_post_answers_a_busy_page_and_the_connection_gets_the_workers_timeout_back(
        client, operator, frozen_lock_holder):
    client.force_login(operator)
    holder = frozen_lock_holder()
    began = time.monotonic()
    response = client.post("/tasks/new/", {"type": "demo.pipeline"})
    took = time.monotonic() - began
    assert response.status_code == 503 and took < 6, (response.status_code, took)
    assert response["Retry-After"] == "5"
    page = response.content.decode()
    assert "Database busy." in page and "Try again in 5 s" in page and "Database unreachable" not in page
    # The request's shorter wait ended with it: this process's other work waits like a worker.
    with connection.cursor() as cursor:
        cursor.execute("PRAGMA busy_timeout")
        assert cursor.fetchone()[0] == 30_000
    holder.kill()
    response = client.post("/tasks/new/", {"type": "demo.pipeline"})
    assert response.status_code == 302, response.status_code


@pytest.mark.skipif("os.environ.get('DATABASE_URL', '').startswith('postgres')",
                    reason="probes SQLite's single write lock")
def test_the_probe_sees_a_held_write_lock(frozen_lock_holder):
    """The check the engine test below relies on can fail: a held lock refuses its write."""
    assert sqlite_write_within(1.0) < 1.0
    holder = frozen_lock_holder()
    with pytest.raises(sqlite3.OperationalError, match="database is locked"):
        sqlite_write_within(0.5)
    holder.kill()
    assert sqlite_write_within(1.0) < 1.0


@pytest.mark.workers
@pytest.mark.skipif("os.environ.get('DATABASE_URL', '').startswith('postgres')",
                    reason="probes SQLite's single write lock")
def test_no_engine_write_transaction_spans_a_sleep_a_model_stream_or_an_http_request_in_flight(
        start_workers, silent_http, settings):
    settings.ORCH_EXTRA_TASK_TYPES = [TEST_TYPES]
    stream = StreamingServer()
    try:
        silent = silent_http.url.split("/")[2]
        start_workers(3, ORCH_EXTRA_TASK_TYPES=TEST_TYPES, ORCH_HTTP_ALLOW=silent)
        sleeping = services.task_create(type="test.interruptible", params={"mode": "sleep", "seconds": 60, "steps": 1})
        streaming = services.task_create(type="test.interruptible", params={
            "mode": "llm_stream", "url": stream.url + "/v1/chat/completions", "steps": 1})
        posting = services.task_create(type="test.effects", params={"kind": "post", "url": silent_http.url,
                                                                    "timeout": 60})
        wait_for(lambda: stream.open_streams == 1, timeout=30, message="the model stream to be in flight")
        wait_for(lambda: len(silent_http.requests) == 1, timeout=30, message="the POST to be in flight")
        wait_for(lambda: Task.objects.filter(pk__in=[sleeping.pk, streaming.pk, posting.pk], status="running",
                                             worker_pid__isnull=False).count() == 3,
                 timeout=30, message="the three tasks to run")
        # While all three slow calls are in flight, another process writes at once, again and again.
        # (A lock held across any of them would refuse these writes for the call's whole minute.)
        waits = []
        for _ in range(10):
            waits.append(sqlite_write_within(2.0))
            time.sleep(0.1)
        assert max(waits) < 2.0, waits
        assert stream.open_streams == 1 and len(silent_http.requests) == 1  # still in flight
        assert Task.objects.get(pk=sleeping.pk).status == "running"
    finally:
        stream.stop()


@pytest.mark.parametrize("debug", [True, False])
def test_api_tells_a_busy_database_from_an_unreachable_one(client, operator, monkeypatch, settings, debug):
    """A lock held elsewhere is "busy, try again"; any other database error stays the outage's 503
    (with DEBUG on, ninja used to answer both with a 500 and a traceback)."""
    from django.db import OperationalError

    from tests.support.helpers import bearer

    settings.DEBUG = debug
    headers = bearer(operator)
    for error, expected in (("database is locked", "database is busy"),
                            ("server closed the connection unexpectedly", "database is unreachable")):
        def refuse(**kwargs):
            raise OperationalError(error)

        monkeypatch.setattr(services, "task_create", refuse)
        response = client.post("/api/tasks", {"type": "demo.pipeline"}, content_type="application/json", **headers)
        assert response.status_code == 503 and response["Retry-After"] == "5", response.content[:300]
        assert expected in response.json()["detail"], response.json()
