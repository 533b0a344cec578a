"""A worker keeps its PostgreSQL session while its executor runs a task (engine/executor.py):
the executor, forked from it, opens its own and never touches the worker's — not even to close
it, which would end the worker's session (psycopg says goodbye on the shared socket). A new
session per task was ~10 ms before each claim and one PostgreSQL backend started per task.

A real process plays the worker (claim, fork the executor, watch it), so that the test process
is nobody's parent."""
import json
import subprocess
import sys

import pytest
from django.db import connection

from orchestrator.engine import services
from orchestrator.models import Step, Task
from tests.conftest import ROOT, process_env

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.task_types("tests.support.testtypes")]

WORKER = """
import json, sys
import django
django.setup()
from django.db import connection
from orchestrator.engine.executor import run_isolated
from orchestrator.engine.lease import claim

def session():
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        return cursor.fetchone()[0]

before = session()
outcome = run_isolated(claim(int(sys.argv[1])))
print(json.dumps({"before": before, "outcome": outcome, "after": session()}))
"""


def test_the_worker_keeps_its_session_across_its_executor_which_has_its_own():
    if connection.vendor != "postgresql":
        pytest.skip("SQLite's connections are closed before the fork, as before (no session to keep)")
    task = services.task_create(type="test.session", params={})
    done = subprocess.run([sys.executable, "-c", WORKER, str(task.pk)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env=process_env(ORCH_EXTRA_TASK_TYPES="tests.support.testtypes"))
    assert done.returncode == 0, done.stderr[-3000:]
    worker = json.loads(done.stdout.strip().splitlines()[-1])
    executor_session = Step.objects.get(task=task, step_id="session").result["backend"]
    assert worker["outcome"] == "executor finished"
    assert Task.objects.get(pk=task.pk).status == "completed"
    assert worker["after"] == worker["before"], "the worker connected again: its session did not survive the fork"
    assert executor_session not in (None, worker["before"]), "the executor used the worker's session"
