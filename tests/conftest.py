import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from django.conf import settings
from django.contrib.auth.models import Group, User
from django.db import connection

ROOT = Path(__file__).resolve().parent.parent

from tests.support import fast_flush  # noqa: E402

fast_flush.install()  # PostgreSQL: the flush after each transactional test empties only what holds rows


def wait_for(condition, *, timeout: float = 30.0, interval: float = 0.05, message: str = "condition"):
    """Poll `condition` until it returns something truthy; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {message}")
        time.sleep(interval)


# What a failing test shows of the processes it started (workers, sweepers, web servers log
# to files under its tmp_path): a flake seen only in CI is otherwise a bare timeout.
PROCESS_LOG_TAIL_LINES = 60


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    tmp_path = getattr(item, "funcargs", {}).get("tmp_path")
    if report.failed and call.when == "call" and tmp_path is not None:
        for log_path in sorted(Path(tmp_path).glob("*.log"))[:6]:
            lines = log_path.read_text(errors="replace").splitlines()
            report.sections.append((f"{log_path.name}: last {PROCESS_LOG_TAIL_LINES} of {len(lines)} lines",
                                    "\n".join(lines[-PROCESS_LOG_TAIL_LINES:])))
    return report


@pytest.fixture(autouse=True)
def extra_task_types(request):
    """`@pytest.mark.task_types("tests.support.testtypes", ...)` on a test, or as a module's
    `pytestmark`: ORCH_EXTRA_TASK_TYPES is exactly those modules, in that order, for the test
    (through pytest-django's `settings`, restored after it). Unmarked tests are left alone.
    Worker processes a test starts still need the setting in their environment."""
    marker = request.node.get_closest_marker("task_types")
    if marker is not None:
        request.getfixturevalue("settings").ORCH_EXTRA_TASK_TYPES = list(marker.args)


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def database_url() -> str:
    """The URL of the test database, for processes started by a test."""
    db = connection.settings_dict
    if db["ENGINE"].endswith("sqlite3"):
        return f"sqlite:///{db['NAME']}"
    return f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}"


def ensure_groups():
    for name in ("viewer", "operator", "reviewer"):
        Group.objects.get_or_create(name=name)


@pytest.fixture
def make_user(db):
    def make(username: str, *roles: str, superuser: bool = False) -> User:
        ensure_groups()
        if superuser:
            return User.objects.create_superuser(username, f"{username}@example.org", "pw")
        user = User.objects.create_user(username, f"{username}@example.org", "pw")
        user.groups.set(Group.objects.filter(name__in=roles))
        return user

    return make


@pytest.fixture
def viewer(make_user):
    return make_user("vera", "viewer")


@pytest.fixture
def operator(make_user):
    return make_user("otto", "operator")


@pytest.fixture
def reviewer(make_user):
    return make_user("rita", "reviewer")


class ManagedProcess:
    """A real `manage.py <command>` in its own process group, its output in a log file."""

    command: tuple[str, ...] = ()

    def __init__(self, env: dict, log_path: Path, *command: str):
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "manage.py"), *(command or self.command)], cwd=ROOT,
                                     env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def freeze(self) -> None:
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        os.killpg(self.proc.pid, signal.SIGCONT)

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text()

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)
        self.log.close()


class WorkerCluster(ManagedProcess):
    """A real `manage.py qcluster` (django-q2) in its own process group."""

    command = ("qcluster",)

    def worker_pids(self) -> list[int]:
        """The cluster's worker processes (children of its sentinel)."""
        out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(self.proc.pid)], capture_output=True, text=True).stdout
        sentinels = [int(p) for p in out.split()]
        pids = []
        for sentinel in sentinels:
            kids = subprocess.run(["ps", "-o", "pid=", "--ppid", str(sentinel)], capture_output=True, text=True).stdout
            pids += [int(p) for p in kids.split()]
        return pids


def process_env(**overrides) -> dict:
    """The environment of a process a test starts: the test database, fast heartbeats."""
    return {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.support.settings",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")])),
            "DATABASE_URL": database_url(), "ORCH_HEARTBEAT_SECONDS": "0.5",
            "ORCH_STALE_AFTER_SECONDS": "2", "ORCH_VAR_DIR": str(settings.VAR_DIR), "PYTHONUNBUFFERED": "1",
            **{k: str(v) for k, v in overrides.items()}}


# The model settings a test gives its workers are the installation's: the test process, which
# resumes tasks and previews them as the web would, reads the same (a resume compares the model
# a task ran on with the one configured now: engine/compat.py).
SHARED_MODEL_SETTINGS = ("LLM_BASE_URL", "LLM_API_KEY", "LLM_MODEL")


def share_model_settings(settings, env: dict) -> None:
    for name in SHARED_MODEL_SETTINGS:
        if name in env:
            setattr(settings, name, str(env[name]))


@pytest.fixture
def start_workers(transactional_db, tmp_path, settings):
    """Start real worker clusters against the test database: start_workers(**env)."""
    clusters = []

    def start(count: int = 2, **env_overrides) -> WorkerCluster:
        share_model_settings(settings, env_overrides)
        cluster = WorkerCluster(process_env(ORCH_WORKERS=count, **env_overrides), tmp_path / f"cluster-{len(clusters)}.log")
        clusters.append(cluster)
        return cluster

    yield start
    for cluster in clusters:
        cluster.stop()


@pytest.fixture
def start_sweeper(transactional_db, tmp_path):
    """Start a real sweeper (`manage.py recover --loop`): start_sweeper(**env)."""
    sweepers = []

    def start(interval: float = 0.3, **env_overrides) -> ManagedProcess:
        sweeper = ManagedProcess(process_env(**env_overrides), tmp_path / f"sweeper-{len(sweepers)}.log",
                                 "recover", "--loop", "--interval", str(interval))
        sweepers.append(sweeper)
        return sweeper

    yield start
    for sweeper in sweepers:
        sweeper.stop()


@pytest.fixture
def start_web(transactional_db, tmp_path):
    """Start a real web server (daphne through `runserver`, so websockets work): start_web(**env)
    returns (process, port)."""
    servers = []

    def start(**env_overrides):
        from tests.support.services import wait_port

        port = free_port()
        server = ManagedProcess(process_env(PORT=port, ORCH_LIVE_POLL_SECONDS=0.2, **env_overrides),
                                tmp_path / f"web-{len(servers)}.log", "runserver", f"127.0.0.1:{port}", "--noreload")
        servers.append(server)
        wait_port(port, open_=True, timeout=30)
        return server, port

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def standin_server():
    """The stand-in model server (orchestrator/llm/standin.py) on a free port, streaming a token
    every 0.5 ms, for worker processes to talk to (give them its base_url)."""
    from orchestrator.llm.standin import StandinServer

    with StandinServer(token_seconds=0.0005) as server:
        yield server


@pytest.fixture
def model(settings):
    """The stand-in model server, which this process's agents (drive_inline) talk to; `requests`
    is what it got. A module needing other settings defines its own `model`."""
    from tests.support.helpers import standin_for_this_process

    with standin_for_this_process(settings, LLM_MAX_ATTEMPTS=3, ORCH_AGENT_EMAIL_ALLOW=["*@example.org"]) as server:
        yield server


@pytest.fixture
def private_redis(tmp_path):
    """A Redis server of the test's own, which it may kill and restart."""
    from tests.support.services import RedisServer

    server = RedisServer(free_port(), tmp_path / "redis.log").start()
    yield server
    server.stop()


@pytest.fixture
def smtp_server():
    """A real SMTP server (aiosmtpd) that keeps every message it receives."""
    from aiosmtpd.controller import Controller

    class Inbox:
        def __init__(self):
            self.messages = []

        def effects(self):
            """The messages tasks sent, without the notifications to reviewers: a worker emails
            a reviewer the test creates while the notice is on its way (after the item's commit)."""
            return [m for m in self.messages if not str(m["Subject"] or "").startswith("[orchestrator] ")]

        async def handle_DATA(self, server, session, envelope):
            from email import message_from_bytes

            self.messages.append(message_from_bytes(envelope.content))
            return "250 OK"

    inbox = Inbox()
    inbox.port = free_port()
    controller = Controller(inbox, hostname="127.0.0.1", port=inbox.port)
    controller.start()
    yield inbox
    controller.stop()


@pytest.fixture
def misbehaving_smtp():
    """A real SMTP server whose behaviour the test switches (tests/support/misbehaving.py)."""
    from tests.support.misbehaving import SmtpServer

    server = SmtpServer(free_port()).start()
    yield server
    server.stop()


@pytest.fixture
def silent_http():
    """An HTTP server that reads each request and never answers."""
    from tests.support.misbehaving import SilentHttpServer

    server = SilentHttpServer()
    yield server
    server.stop()


@pytest.fixture
def smtp(misbehaving_smtp, settings):
    """The misbehaving SMTP server (mode "ok" until the test switches it), used by this
    process's email.send (inline runs), with a short client timeout."""
    settings.EMAIL_HOST, settings.EMAIL_PORT, settings.EMAIL_TIMEOUT = "127.0.0.1", misbehaving_smtp.port, 1.0
    return misbehaving_smtp
