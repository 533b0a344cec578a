"""The web server's database connections (settings.WEB_DATABASE): daphne, started as in
production (`daphne orchestrator.asgi:application`), serves its requests on a pool of
PostgreSQL connections instead of opening one per request, a pooled connection the server
killed is replaced, not used, and a request that finds the pool empty for 5 s answers 503.
PostgreSQL only: SQLite has no connections to pool."""
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from django.db import connection, transaction

from orchestrator.auth import token_issue
from orchestrator.models import Task
from tests.conftest import ROOT, free_port, process_env, wait_for
from tests.support.services import wait_port

pytestmark = [pytest.mark.django_db(transaction=True),
              pytest.mark.skipif(connection.vendor != "postgresql", reason="pools PostgreSQL connections only")]


@pytest.fixture
def daphne(tmp_path):
    """start(**env) -> base URL of a real `python -m daphne orchestrator.asgi:application`."""
    procs = []

    def start(**env):
        port = free_port()
        log = open(tmp_path / f"daphne-{len(procs)}.log", "w")
        proc = subprocess.Popen([sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port),
                                 "orchestrator.asgi:application"], cwd=ROOT, env=process_env(**env),
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        procs.append((proc, log))
        wait_port(port, open_=True, timeout=30)
        return f"http://127.0.0.1:{port}"

    yield start
    for proc, log in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)
        log.close()


def sessions_opened() -> int:
    """Sessions PostgreSQL has counted on the test database (a backend reports its own when
    idle or at its exit)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute("SELECT sessions FROM pg_stat_database WHERE datname = current_database()")
        return cursor.fetchone()[0]


def list_tasks(base: str, token: str, times: int) -> list[int]:
    def one(_):
        return requests.get(f"{base}/api/tasks", headers={"Authorization": f"Bearer {token}"}, timeout=30).status_code

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, range(times)))


def test_forty_requests_are_served_on_a_pool_of_four_connections_and_on_forty_new_ones_without_it(daphne, admin_user):
    token = token_issue(user=admin_user, expires_in_days=1)
    pooled = daphne(ORCH_WEB_DB_POOL_SIZE=4)
    before = sessions_opened()
    assert list_tasks(pooled, token, 40) == [200] * 40
    # The pool's connections are still open; whatever of them PostgreSQL has counted is at most four.
    assert sessions_opened() - before <= 4

    unpooled = daphne(ORCH_WEB_DB_POOL_SIZE=0)
    before = sessions_opened()
    assert list_tasks(unpooled, token, 40) == [200] * 40
    # Each request's connection was closed at its end, so each was counted: the same test fails
    # on a server that opens a connection per request.
    wait_for(lambda: sessions_opened() - before >= 40, timeout=15, message="forty sessions counted")


def test_a_pooled_connection_the_database_killed_is_replaced_before_a_request_uses_it(daphne, admin_user):
    token = token_issue(user=admin_user, expires_in_days=1)
    base = daphne(ORCH_WEB_DB_POOL_SIZE=2)
    assert list_tasks(base, token, 10) == [200] * 10
    with connection.cursor() as cursor:  # as a database restart would, for every connection but ours
        cursor.execute("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                       "WHERE datname = current_database() AND pid <> pg_backend_pid()")
        assert cursor.fetchone()[0] >= 1
    assert list_tasks(base, token, 10) == [200] * 10


def test_a_request_that_waits_five_seconds_for_a_pooled_connection_answers_503_and_the_held_one_completes(
        daphne, admin_user):
    token = token_issue(user=admin_user, expires_in_days=1)
    base = daphne(ORCH_WEB_DB_POOL_SIZE=1)
    headers = {"Authorization": f"Bearer {token}"}
    assert requests.get(f"{base}/api/tasks", headers=headers, timeout=30).status_code == 200
    with ThreadPoolExecutor(1) as pool:
        with transaction.atomic():
            with connection.cursor() as cursor:  # the first request blocks on this, holding the only connection
                cursor.execute(f"LOCK TABLE {Task._meta.db_table} IN ACCESS EXCLUSIVE MODE")
            held = pool.submit(requests.get, f"{base}/api/tasks", headers=headers, timeout=60)
            wait_for(lambda: waiting_on_the_lock() >= 1, timeout=15, message="the first request waiting on the lock")
            started = time.monotonic()
            refused = requests.get(f"{base}/api/tasks", headers=headers, timeout=30)
            waited = time.monotonic() - started
        assert refused.status_code == 503, refused.text
        assert "database" in refused.json()["detail"] and refused.headers.get("Retry-After")
        assert 4.5 <= waited < 15, waited
        assert held.result().status_code == 200  # the lock gone, the held request completes


def waiting_on_the_lock() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                       "AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()")
        return cursor.fetchone()[0]
