"""Browser tests: a real daphne + real workers against the test database, driven by the
system Chromium through Playwright's sync API (no browser is ever downloaded).

Without Chromium (CHROMIUM_PATH, default /usr/bin/chromium) every test here is skipped by one
guard (`pytest_runtest_setup` below), with one line saying how to enable them; a module whose tests need no
browser says `NEEDS_CHROMIUM = False`.

Two traps: Playwright's sync API runs an event loop in the test
thread, so Django refuses ORM calls there unless DJANGO_ALLOW_ASYNC_UNSAFE is set, and
`async_to_sync` refuses to run there at all: create database objects before starting the
browser, or in another thread (`in_thread`). And that loop stays marked as running on the main
thread until Playwright is stopped: a Playwright left running (a launch that failed, a close
that raised) would make every later database test of the session raise
SynchronousOnlyOperation. `chromium()` always stops it, and `no_event_loop_left_behind` checks it
after every test here.
"""
import asyncio
import contextlib
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from django.conf import settings

from tests.conftest import SHARED_MODEL_SETTINGS, database_url, free_port

ROOT = Path(__file__).resolve().parents[2]  # the repository root (where manage.py lives)
CHROMIUM = os.environ.get("CHROMIUM_PATH") or "/usr/bin/chromium"


def chromium_missing() -> str | None:
    """Why the browser tests cannot run here, as one line saying how to enable them; None if they can."""
    if Path(CHROMIUM).is_file() and os.access(CHROMIUM, os.X_OK):
        return None
    return (f"browser tests skipped: no Chromium at {CHROMIUM} "
            "(enable them with `apt-get install chromium`, or set CHROMIUM_PATH to a Chromium binary)")


def pytest_runtest_setup(item):
    """The one guard of every browser test, run before any fixture (no database, no daphne):
    skip when there is no Chromium to drive. Raised here, every skip has this one location, so
    pytest's summary shows them as one line."""
    reason = chromium_missing()
    if reason and getattr(getattr(item, "module", None), "NEEDS_CHROMIUM", True):
        pytest.skip(reason)


@pytest.fixture(autouse=True)
def no_event_loop_left_behind():
    """After every test here: no asyncio loop may be left running on the main thread (Playwright
    not stopped). If one is, it is cleared, so the rest of the session still works, and the
    test that left it fails."""
    yield
    if asyncio._get_running_loop() is not None:  # what Django's SynchronousOnlyOperation check reads
        asyncio._set_running_loop(None)
        pytest.fail("an asyncio loop was left running on the main thread (a Playwright not stopped?): "
                    "start the browser through the `browser` fixture or `chromium()`, which always stop it")


@pytest.fixture(autouse=True)
def allow_async_unsafe(monkeypatch):
    """Playwright's loop in the test thread trips Django's SynchronousOnlyOperation check.

    Set for the browser tests only (Django reads it at each call): set at import time, it
    would switch the check off for every test in the session."""
    monkeypatch.setitem(os.environ, "DJANGO_ALLOW_ASYNC_UNSAFE", "true")

# Environment variables that must not reach the servers started here.
NOT_FOR_SERVERS = {"DJANGO_ALLOW_ASYNC_UNSAFE"}


@contextlib.contextmanager
def chromium(executable_path: str | None = None):
    """Playwright and the system Chromium; Playwright is stopped whatever happens (a failed
    launch included), so its loop never outlives the block."""
    from playwright.sync_api import sync_playwright

    playwright = sync_playwright().start()  # stops itself if it fails to start
    try:
        browser = playwright.chromium.launch(executable_path=executable_path or CHROMIUM)
        try:
            yield browser
        finally:
            browser.close()
    finally:
        playwright.stop()


def in_thread(fn, *args, **kwargs):
    """Run `fn` in another thread (its own DB connection, no event loop) and return its result."""
    from django.db import connection

    result, error = [], []

    def run():
        try:
            result.append(fn(*args, **kwargs))
        except BaseException as exc:  # re-raised in the caller
            error.append(exc)
        finally:
            connection.close()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(90)
    if error:
        raise error[0]
    if not result and thread.is_alive():
        raise AssertionError(f"{fn!r} did not return within 90 s")
    return result[0]


def header_badge(page):
    """The status badge in a task page's header."""
    return page.get_by_test_id("task-header").get_by_test_id("task-status")


class Server:
    """`python -m daphne orchestrator.asgi:application` on a free port."""

    def __init__(self, log_path: Path, **env_overrides):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.env = {k: v for k, v in os.environ.items() if k not in NOT_FOR_SERVERS}
        self.env.update({
            "DATABASE_URL": database_url(),
            "ALLOWED_HOSTS": "127.0.0.1,localhost",
            "ORCH_LIVE_POLL_SECONDS": "0.1",
            "ORCH_VAR_DIR": str(settings.VAR_DIR),
            "PORT": str(self.port),
            "PYTHONUNBUFFERED": "1",
            # The test types the workers of browser tests run (test_controls): the web knows them too.
            "ORCH_EXTRA_TASK_TYPES": "tests.support.testtypes",
            **{k: str(v) for k, v in env_overrides.items()},
        })
        self.proc = None
        self.start()

    def start(self) -> None:
        self.log = open(self.log_path, "a")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(self.port), "orchestrator.asgi:application"],
            cwd=ROOT, env=self.env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.wait_until_up()

    def output(self) -> str:
        self.log.flush()
        return self.log_path.read_text()

    def wait_until_up(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"daphne exited with {self.proc.returncode}:\n{self.output()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + "/accounts/login/", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"daphne did not answer on {self.url} within {timeout}s:\n{self.output()[-3000:]}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None
        self.log.close()


class Stack:
    def __init__(self, server: Server, start_workers):
        self.server = server
        self.url = server.url
        self._start_workers = start_workers
        self.clusters = []

    def start_workers(self, count: int = 1, **env):
        # One installation, one configuration: the web server gets the model settings its workers
        # get (a resume compares the model a task ran on with the one configured now). Give them
        # before a page opens: the server restarts to take them.
        shared = {k: str(v) for k, v in env.items() if k in SHARED_MODEL_SETTINGS}
        if any(self.server.env.get(k) != v for k, v in shared.items()):
            self.server.stop()
            self.server.env.update(shared)
            self.server.start()
        cluster = self._start_workers(count, **env)
        self.clusters.append(cluster)
        return cluster


@pytest.fixture
def stack(transactional_db, start_workers, tmp_path):
    """The real stack on the test database: daphne now, workers when the test asks
    (`stack.start_workers()`), so a test can load a page before any work happens."""
    server = Server(tmp_path / "daphne.log")
    try:
        yield Stack(server, start_workers)
    finally:
        server.stop()


@pytest.fixture
def browser():
    """Chromium, started lazily: `browser()` — after the test made its database objects."""
    with contextlib.ExitStack() as cleanup:
        started = []

        def start():
            if not started:
                started.append(cleanup.enter_context(chromium()))
            return started[0]

        yield start


@pytest.fixture
def new_page(browser, stack):
    """A logged-in page: new_page(username) (every test user's password is "pw")."""
    from playwright.sync_api import expect

    def make(username: str, password: str = "pw"):
        context = browser().new_context(base_url=stack.url, viewport={"width": 1280, "height": 720})
        context.set_default_timeout(15_000)
        page = context.new_page()
        page.goto("/accounts/login/")
        page.fill("#id_username", username)
        page.fill("#id_password", password)
        page.get_by_test_id("btn-login").click()
        try:
            expect(page.get_by_test_id("user-name")).to_have_text(username)
        except AssertionError:
            raise AssertionError(f"login as {username!r} failed: {page.url} shows {page.title()!r}\n"
                                 f"daphne log:\n{stack.server.output()[-3000:]}") from None
        return page

    return make
