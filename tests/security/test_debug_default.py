"""DEBUG is off unless asked for (issue 19, item 8): a process started without DEBUG runs
with production behaviour (and so refuses to start without a SECRET_KEY); `make run` — the
zero-config development stack — turns it on for itself and for everything it starts."""
import os
import subprocess
import sys

from tests.conftest import ROOT


def run(args, **env_overrides):
    env = {k: v for k, v in os.environ.items() if k not in ("SECRET_KEY", "DEBUG", "DATABASE_URL")}
    env.update({"DJANGO_SETTINGS_MODULE": "orchestrator.settings", **env_overrides})
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


PRINT_DEBUG = "import django; django.setup(); from django.conf import settings; print(settings.DEBUG)"


def test_without_debug_in_the_environment_debug_is_off(tmp_path):
    result = run(["-c", PRINT_DEBUG], SECRET_KEY="k" * 50, ORCH_VAR_DIR=str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_without_debug_and_without_a_secret_key_nothing_starts(tmp_path):
    result = run(["manage.py", "check"], ORCH_VAR_DIR=str(tmp_path))
    assert result.returncode != 0
    assert "SECRET_KEY is not set" in result.stderr and "DEBUG=true" in result.stderr


def test_make_run_turns_debug_on_for_migrate_and_the_stack(tmp_path):
    """`make run` with nothing set: its commands (migrate, runstack) get DEBUG=true. The
    Python is a stand-in that records the DEBUG each command saw."""
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / ".installed").touch()  # newer than pyproject.toml: no install step
    seen = tmp_path / "seen"
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\necho "$* DEBUG=${{DEBUG-unset}}" >> {seen}\n')
    python.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("SECRET_KEY", "DEBUG", "MAKEFLAGS", "MFLAGS")}
    result = subprocess.run(["make", "-s", "run", f"VENV={venv}", f"PY={python}"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert seen.read_text().splitlines() == ["manage.py migrate --noinput DEBUG=true", "manage.py runstack DEBUG=true"]
    # DEBUG=false given to make is kept (a production-like local run).
    seen.unlink()
    subprocess.run(["make", "-s", "run", f"VENV={venv}", f"PY={python}"], cwd=ROOT, env={**env, "DEBUG": "false"},
                   capture_output=True, text=True, timeout=60, check=True)
    assert seen.read_text().splitlines()[-1] == "manage.py runstack DEBUG=false"


def test_runstack_gives_its_children_its_debug(monkeypatch, settings):
    from orchestrator.management.commands import runstack

    started = []

    class Started(Exception):
        pass

    def popen(argv, **kwargs):
        started.append(kwargs.get("env") or {})
        raise Started

    monkeypatch.delenv("DEBUG", raising=False)
    monkeypatch.setattr(runstack.subprocess, "Popen", popen)
    monkeypatch.setattr(runstack.Command, "ensure_admin", lambda self: None)
    settings.DEBUG = True
    try:
        runstack.Command().handle(host="127.0.0.1", port=0)
    except Started:
        pass
    assert started and started[0].get("DEBUG") == "true"
