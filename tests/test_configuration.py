"""One settings table (orchestrator/conf.py) and the start-up checks (orchestrator/checks.py)."""
import re
import subprocess
import sys

import pytest
from django.core import checks

from orchestrator.conf import TABLE, from_environment
from tests.conftest import ROOT


def test_every_orch_setting_is_declared_once_and_documented_in_the_configuration_page():
    declared = [s.name for s in TABLE]
    assert len(declared) == len(set(declared))
    used = set()
    for path in [*(ROOT / "orchestrator").rglob("*.py"), *(ROOT / "review").rglob("*.py")]:
        used |= set(re.findall(r"\bORCH_[A-Z_]+[A-Z]\b", path.read_text()))
    passed_to_commands = {"ORCH_IDEMPOTENCY_KEY"}  # what shell.run gives its commands, not a setting
    assert used - set(declared) - passed_to_commands == set(), "ORCH_* names used in the code but not in conf.TABLE"
    configuration = (ROOT / "docs" / "configuration.md").read_text()
    undocumented = [name for name in declared if f"`{name}`" not in configuration]
    assert undocumented == [], "declared settings missing from docs/configuration.md"


def test_defaults_follow_other_settings_and_bad_values_are_refused_with_the_variable_named():
    assert from_environment({"ORCH_HEARTBEAT_SECONDS": "1"})["ORCH_STALE_AFTER_SECONDS"] == 3.0
    assert from_environment({})["ORCH_LIVE_POLL_SECONDS"] == 0.1
    assert from_environment({"REDIS_URL": "redis://x"})["ORCH_LIVE_POLL_SECONDS"] == 1.0
    assert from_environment({"ORCH_ISOLATE_EXECUTION": "no"})["ORCH_ISOLATE_EXECUTION"] is False
    out = subprocess.run([sys.executable, str(ROOT / "manage.py"), "check"], cwd=ROOT, capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "ORCH_WORKERS": "two", "HOME": "/tmp"})
    assert out.returncode != 0
    assert "ORCH_WORKERS='two' is not a whole number" in out.stderr and "worker processes per" in out.stderr


def ids(*, deploy: bool = False) -> set[str]:
    return {m.id for m in checks.run_checks(tags=["orchestrator"], include_deployment_checks=deploy)}


def test_each_check_names_its_problem_by_id(settings):
    assert ids() == set()
    settings.ORCH_STALE_AFTER_SECONDS = settings.ORCH_HEARTBEAT_SECONDS
    settings.ORCH_REQUEUE_AFTER_SECONDS = settings.ORCH_HEARTBEAT_SECONDS
    settings.ORCH_RECOVERY_TIMEOUT_SECONDS = 1
    assert {"orchestrator.W002", "orchestrator.W004", "orchestrator.W005"} <= ids()
    settings.Q_CLUSTER = {**settings.Q_CLUSTER, "retry": settings.Q_CLUSTER["timeout"]}
    assert "orchestrator.W001" in ids()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the isolation check passes only on Linux")
def test_deploy_checks_run_only_with_deploy(settings):
    settings.SECRET_KEY = settings.DEV_SECRET_KEY
    settings.ORCH_PUBLIC_URL = "http://127.0.0.1:8000"
    settings.DEBUG = False
    assert not {"orchestrator.E011", "orchestrator.W012"} & ids()
    found = ids(deploy=True)
    assert {"orchestrator.E011", "orchestrator.W012"} <= found
    assert ("orchestrator.W010" in found) == settings.DATABASES["default"]["ENGINE"].endswith("sqlite3")
    settings.SECRET_KEY, settings.ORCH_PUBLIC_URL = "x" * 60, "https://orchestrator.example.com"
    assert not {"orchestrator.E011", "orchestrator.W012"} & ids(deploy=True)
