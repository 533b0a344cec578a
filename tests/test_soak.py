"""The soak's short mode (bench/soak.py --short): >= 20 faults of every kind — executors,
workers and whole clusters killed, SMTP dropped after DATA or answering too late, broker
messages purged, PostgreSQL and Redis restarted, an operator's Stop and Force-terminate while
an email or a POST is in flight, an upstream that acted and answered 502, a POST held past its
step's timeout — on real worker clusters; nothing lost, nothing duplicated, no stray process,
no stuck task, no effect of unknown outcome left without a reviewer's decision.

The soak brings its own PostgreSQL cluster, Redis and SMTP server, so it would run the same in
the SQLite and the PostgreSQL runs of the suite: it runs in the SQLite one. It runs as a subprocess: it makes itself a
child subreaper and sets up Django for its private database."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [
    pytest.mark.workers,
    pytest.mark.timeout(240),
    pytest.mark.skipif(not (shutil.which("redis-server") and list(Path("/usr/lib/postgresql").glob("*/bin/initdb"))),
                       reason="needs redis-server and PostgreSQL's initdb/pg_ctl"),
    # The same run whatever DATABASE_URL says (the soak strips it and brings its own
    # PostgreSQL): CI's SQLite run runs it, its PostgreSQL run would repeat it (85 s of 20 min).
    pytest.mark.skipif(os.environ.get("DATABASE_URL", "").startswith(("postgres", "pgsql")),
                       reason="the soak brings its own PostgreSQL and runs the same in the SQLite run "
                              "(make test without DATABASE_URL)"),
]


def test_short_soak_loses_duplicates_leaves_and_sticks_nothing(tmp_path):
    summary = tmp_path / "soak.json"
    env = {k: v for k, v in os.environ.items()
           if k not in ("DATABASE_URL", "REDIS_URL", "ORCH_FAULTS", "DJANGO_SETTINGS_MODULE")}
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "soak.py"), "--short", "--json", str(summary)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=220)
    report = done.stdout + "\n" + done.stderr[-5000:]
    verdict = json.loads(summary.read_text())
    assert verdict, report
    assert verdict["faults_total"] >= 20, report
    assert all(verdict["faults"].get(kind) for kind in (
        "kill_executor", "kill_worker", "kill_cluster", "smtp_drop_after_data", "smtp_reply_late",
        "broker_purge", "pg_restart", "redis_restart",
        # an operator's Stop / Force-terminate while an email or a POST is in flight, an upstream
        # that acted and answered 502, a POST held past its step's timeout
        "stop_mid_send", "force_mid_send", "stop_mid_post", "force_mid_post", "upstream_502_after_acting",
        "step_timeout")), report
    assert verdict["stopped_by_soak"] and verdict["terminated_by_soak"], report
    assert (verdict["lost"], verdict["duplicated"], verdict["stray"], verdict["stuck"], verdict["unreviewed"]) == \
        (0, 0, 0, 0, 0), report
    assert done.returncode == 0, report
