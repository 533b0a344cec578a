"""Database and broker outages: PostgreSQL (a private cluster this test starts itself, so
the shared server is untouched) and Redis restarted while tasks run. Web, workers and
sweeper reconnect; every task completes; no step result is lost or doubled; nothing logs
a traceback per poll."""
import json
import re
import subprocess
import sys

import psycopg
import pytest

from tests.conftest import ROOT, free_port, process_env, wait_for
from tests.support.services import PostgresCluster

pytestmark = [pytest.mark.workers, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def private_postgres():
    cluster = PostgresCluster(free_port()).init()
    cluster.start()
    with psycopg.connect(f"host=127.0.0.1 port={cluster.port} user=postgres dbname=postgres", autocommit=True) as conn:
        conn.execute("CREATE DATABASE orch_outage")
    cluster.url = f"postgres://postgres@127.0.0.1:{cluster.port}/orch_outage"
    subprocess.run([sys.executable, str(ROOT / "manage.py"), "migrate", "--noinput"], cwd=ROOT, check=True,
                   env=process_env(DATABASE_URL=cluster.url), capture_output=True)
    yield cluster
    cluster.destroy()


def query(cluster, sql: str, *args):
    with psycopg.connect(cluster.url.replace("postgres://", "postgresql://")) as conn:
        return conn.execute(sql, args).fetchall()


def create_tasks(env: dict, type_: str, params: dict, count: int) -> list[int]:
    script = ("from orchestrator.engine import services\n"
              f"print(*[services.task_create(type={type_!r}, params={params!r}).pk for _ in range({count})])")
    out = subprocess.run([sys.executable, str(ROOT / "manage.py"), "shell", "-c", script], cwd=ROOT, env=env,
                         capture_output=True, text=True, check=True).stdout
    return [int(i) for i in out.strip().splitlines()[-1].split()]


def statuses(cluster, ids) -> dict:
    return dict(query(cluster, "SELECT id, status FROM orchestrator_task WHERE id = ANY(%s)", list(ids)))


def tracebacks(text: str) -> int:
    return text.count("Traceback (most recent call last)") + text.count('"exc_info"')


def traceback_excerpts(text: str) -> str:
    """Each traceback with the line before it (what a failure of the count must show)."""
    found = re.finditer(r'[^\n]{0,300}(Traceback \(most recent call last\)|"exc_info")[\s\S]{0,1200}', text)
    return "\n---\n".join(match.group(0) for match in found)[-8000:]


def session_cookie(env: dict) -> str:
    """A logged-in operator's session in the private database (as the login page would make it)."""
    script = ("from django.contrib.auth import BACKEND_SESSION_KEY, HASH_SESSION_KEY, SESSION_KEY\n"
              "from django.contrib.auth.models import Group, User\n"
              "from django.contrib.sessions.backends.db import SessionStore\n"
              "from django.conf import settings\n"
              "user = User.objects.create_user('otto', 'otto@example.org', 'pw')\n"
              "user.groups.add(Group.objects.get_or_create(name='operator')[0])\n"
              "s = SessionStore(); s[SESSION_KEY] = str(user.pk)\n"
              "s[BACKEND_SESSION_KEY] = 'django.contrib.auth.backends.ModelBackend'\n"
              "s[HASH_SESSION_KEY] = user.get_session_auth_hash(); s.create(); print(s.session_key)")
    out = subprocess.run([sys.executable, str(ROOT / "manage.py"), "shell", "-c", script], cwd=ROOT, env=env,
                         capture_output=True, text=True, check=True).stdout
    return out.strip().splitlines()[-1]


class WebClient:
    """A browser's two channels to daphne: page loads, and the task list's websocket."""

    def __init__(self, port: int, session: str):
        self.port, self.cookie = port, f"sessionid={session}"

    def get(self, path: str):
        import urllib.error
        import urllib.request

        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", headers={"Cookie": self.cookie})
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def websocket(self):
        from websockets.sync.client import connect

        return connect(f"ws://127.0.0.1:{self.port}/ws/tasks/", open_timeout=10,
                       additional_headers={"Cookie": self.cookie, "Origin": f"http://127.0.0.1:{self.port}"})


def next_outage_message(socket, timeout: float = 30) -> dict:
    import time

    deadline = time.monotonic() + timeout
    while True:
        message = json.loads(socket.recv(timeout=max(0.1, deadline - time.monotonic())))
        if message.get("type") == "outage":
            return message


def test_postgresql_restarted_while_tasks_run_every_task_completes(private_postgres, private_redis, start_workers,
                                                                   start_sweeper, start_web):
    env = {"DATABASE_URL": private_postgres.url, "REDIS_URL": private_redis.url, "ORCH_REQUEUE_AFTER_SECONDS": 2}
    clusters = [start_workers(2, **env)]
    sweeper = start_sweeper(**env)
    web, port = start_web(**env)
    client = WebClient(port, session_cookie(process_env(**env)))
    assert client.get("/")[0] == 200
    with client.websocket() as socket:
        assert json.loads(socket.recv(timeout=10))["type"] == "state"
        ids = create_tasks(process_env(**env), "demo.migrate_rows", {"rows": 3000, "batch_size": 250, "rate": 1.0}, 4)
        # Long enough to still run once the command that creates them has returned, on a loaded
        # machine too (the migrations can be done by then: CI saw every task finished first).
        ids += create_tasks(process_env(**env), "demo.pipeline", {"stages": 3, "seconds_per_stage": 4}, 2)
        wait_for(lambda: "running" in statuses(private_postgres, ids).values(), timeout=60, message="a task running")
        private_postgres.stop()  # immediate: every connection is cut, in-flight transactions are lost
        # Down until the sweeper and a running task's supervisor have both noticed (longer than
        # ORCH_STALE_AFTER_SECONDS: no heartbeat got through meanwhile).
        wait_for(lambda: "sweeper: database unreachable" in sweeper.output()
                 and "supervisor of task" in clusters[0].output(), timeout=30, message="the outage noticed")
        # The dashboard shows it: live pages get the banner; a page load is a 503 that says why.
        assert next_outage_message(socket) == {"type": "outage", "database": "unreachable"}
        status, page = client.get("/")
        assert status == 503 and "Database unreachable" in page and "Nothing was lost" in page
        private_postgres.start()
        assert next_outage_message(socket) == {"type": "outage", "database": "reachable"}
        assert client.get("/")[0] == 200
    wait_for(lambda: set(statuses(private_postgres, ids).values()) == {"completed"}, timeout=120,
             message="every task to complete")
    # No step result lost or doubled: each step committed exactly once (one step_done event
    # each), and the migrated rows are all there.
    done_events = query(private_postgres, "SELECT task_id, count(*), count(DISTINCT payload->>'step') "
                                          "FROM orchestrator_taskevent WHERE kind = 'step_done' AND task_id = ANY(%s) "
                                          "GROUP BY task_id", ids)
    totals = dict(query(private_postgres, "SELECT id, steps_total FROM orchestrator_task WHERE id = ANY(%s)", ids))
    assert {task_id: (n, distinct) for task_id, n, distinct in done_events} == {
        task_id: (total, total) for task_id, total in totals.items()}
    assert query(private_postgres, "SELECT count(*) FROM demo_destination")[0][0] == 3000
    logs = "".join(c.output() for c in clusters) + sweeper.output() + web.output()
    assert tracebacks(logs) == 0, logs[-5000:]
    assert "sweeper: database reachable again" in logs


def followed_to_completion(client: WebClient, task_id: int, timeout: float) -> bool:
    """What the task list's script does: (re)connect until a live message says `task_id` completed."""
    import time

    from websockets.exceptions import ConnectionClosed, InvalidHandshake

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with client.websocket() as socket:
                while time.monotonic() < deadline:
                    message = json.loads(socket.recv(timeout=max(0.1, deadline - time.monotonic())))
                    tasks = message.get("tasks", []) if message.get("type") == "state" else [message]
                    if any(t.get("id") == task_id and t.get("status") == "completed" for t in tasks):
                        return True
        # A handshake daphne cut (InvalidMessage, seen right after the restart) or refused: the page's
        # script sees a close and reconnects, as here.
        except (ConnectionClosed, InvalidHandshake, OSError, TimeoutError):
            time.sleep(0.2)
    return False


def test_redis_restarted_while_tasks_run_and_pages_watch(private_redis, start_workers, start_sweeper, start_web,
                                                          make_user):
    from django.test import Client

    from orchestrator.models import Task

    env = {"REDIS_URL": private_redis.url, "ORCH_REQUEUE_AFTER_SECONDS": 1}
    clusters = [start_workers(2, **env)]
    sweeper = start_sweeper(**env)
    web, port = start_web(**env)
    browser = Client()
    browser.force_login(make_user("otto", "operator"))
    client = WebClient(port, browser.cookies["sessionid"].value)
    with client.websocket() as socket:
        assert json.loads(socket.recv(timeout=10))["type"] == "state"
        ids = create_tasks(process_env(**env), "demo.pipeline", {"stages": 3, "seconds_per_stage": 0.3}, 8)
        wait_for(lambda: Task.objects.filter(pk__in=ids, status="running").exists(), timeout=60,
                 message="a task running")
        private_redis.restart()  # kill -9: queued messages and every channel-layer connection are gone
    wait_for(lambda: Task.objects.filter(pk__in=ids, status="completed").count() == len(ids), timeout=120,
             message="every task to complete")
    # The page reconnects (as its script does, as often as it takes) and live updates flow
    # again through the new Redis: a task created now is followed to its end.
    [new] = create_tasks(process_env(**env), "demo.pipeline", {"stages": 2, "seconds_per_stage": 0.3}, 1)
    logs = lambda: "".join(c.output() for c in clusters) + sweeper.output() + web.output()  # noqa: E731
    assert followed_to_completion(client, new, timeout=60), (
        f"task {new} is {Task.objects.get(pk=new).status}; the logs end:\n{logs()[-6000:]}")
    logs = logs()
    assert tracebacks(logs) <= 2, traceback_excerpts(logs)
