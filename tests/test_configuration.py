"""One settings table (orchestrator/conf.py) and the start-up checks (orchestrator/checks.py)."""
import re
import subprocess
import sys

import pytest
from django.core import checks
from django.core.exceptions import ImproperlyConfigured

from orchestrator import conf
from orchestrator.conf import TABLE, boolean, env_bool, from_environment
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


def test_the_configuration_page_holds_the_table_generated_from_conf_TABLE():
    """docs/configuration.md's ORCH_* table is conf.TABLE's, word for word: a setting added,
    renamed or re-described in orchestrator/conf.py needs the page regenerated."""
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert page.count(conf.TABLE_BEGIN) == 1 and page.count(conf.TABLE_END) == 1, \
        f"docs/configuration.md must hold the markers {conf.TABLE_BEGIN!r} and {conf.TABLE_END!r} once each"
    assert page == conf.with_generated_table(page), (
        f"the ORCH_* table of docs/configuration.md differs from orchestrator/conf.py TABLE: regenerate it with "
        f"`{conf.REGENERATE}` (and edit the settings' wording in conf.py, not in the page)")
    generated = [line for line in conf.markdown_table().splitlines() if line.startswith("| `")]
    assert len(generated) == len(TABLE)
    # Outside the markers: only the settings that are not the harness's (Django's, email, the model...).
    outside = page.replace(page[page.index(conf.TABLE_BEGIN):page.index(conf.TABLE_END)], "")
    assert not [line for line in outside.splitlines() if line.startswith("| `ORCH_")]


def test_true_or_false_has_one_parser_for_table_settings_and_django_settings():
    for word in ("1", "true", "YES", " on "):
        assert boolean(word) is True and env_bool("DEBUG", False, {"DEBUG": word}) is True
    for word in ("0", "False", "no", "off"):
        assert boolean(word) is False and env_bool("DEBUG", True, {"DEBUG": word}) is False
    assert env_bool("DEBUG", True, {}) is True and env_bool("DEBUG", False, {"DEBUG": ""}) is False
    # An unknown word is refused (it used to be read as false by settings.env_bool), naming the variable.
    with pytest.raises(ImproperlyConfigured, match="DEBUG='maybe' is not true or false"):
        env_bool("DEBUG", False, {"DEBUG": "maybe"})
    with pytest.raises(ImproperlyConfigured, match="ORCH_DEMO='maybe' is not true or false .*it sets: offer the demo"):
        from_environment({"ORCH_DEMO": "maybe"})


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


def test_the_executor_poll_intervals_are_settings_and_must_be_positive(settings):
    values = from_environment({})
    assert (values["ORCH_EXECUTOR_WATCH_SECONDS"], values["ORCH_EXECUTOR_CONTROL_POLL_SECONDS"]) == (0.05, 0.1)
    from orchestrator.conf import harness

    settings.ORCH_EXECUTOR_WATCH_SECONDS, settings.ORCH_EXECUTOR_CONTROL_POLL_SECONDS = 0.2, 0.3
    assert (harness.executor_watch_seconds, harness.executor_control_poll_seconds) == (0.2, 0.3)
    assert "orchestrator.E007" not in ids()
    for name in ("ORCH_EXECUTOR_WATCH_SECONDS", "ORCH_EXECUTOR_CONTROL_POLL_SECONDS", "ORCH_CONTROL_POLL_SECONDS"):
        setattr(settings, name, 0)
        found = [m for m in checks.run_checks(tags=["orchestrator"]) if m.id == "orchestrator.E007"]
        assert [m.msg.split(" ")[0] for m in found] == [name]
        setattr(settings, name, 0.05)


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
