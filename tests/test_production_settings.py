"""Production rules enforced at start-up, and secrets on disk readable by their owner only."""
import os
import stat
import subprocess
import sys

import pytest
from django.conf import settings

from tests.conftest import ROOT

CONNECT_AND_WRITE = """
import os, django
django.setup()
from django.conf import settings
from django.db import connection
with connection.cursor() as cursor:
    cursor.execute("CREATE TABLE IF NOT EXISTS probe (x integer)")
    cursor.execute("INSERT INTO probe VALUES (1)")
    name = settings.DATABASES["default"]["NAME"]
    for path in (name, name + "-wal", name + "-shm"):
        if os.path.exists(path):
            print(path, oct(os.stat(path).st_mode & 0o777))
"""


def run(args, **env_overrides):
    env = {k: v for k, v in os.environ.items() if k not in ("SECRET_KEY", "DEBUG", "DATABASE_URL")}
    env.update({"DJANGO_SETTINGS_MODULE": "orchestrator.settings", **env_overrides})
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


def test_debug_false_without_secret_key_refuses_to_start(tmp_path):
    result = run(["manage.py", "check"], DEBUG="false", ORCH_VAR_DIR=str(tmp_path))
    assert result.returncode != 0
    assert "ImproperlyConfigured" in result.stderr
    assert "SECRET_KEY is not set" in result.stderr and "DEBUG=false" in result.stderr


def test_debug_false_with_the_public_dev_key_refuses_to_start(tmp_path):
    result = run(["manage.py", "check"], DEBUG="false", SECRET_KEY=settings.DEV_SECRET_KEY,
                 ORCH_VAR_DIR=str(tmp_path))
    assert result.returncode != 0 and "SECRET_KEY" in result.stderr


def test_debug_false_with_a_secret_key_starts(tmp_path):
    result = run(["manage.py", "check"], DEBUG="false", SECRET_KEY="x" * 50, ORCH_VAR_DIR=str(tmp_path))
    assert result.returncode == 0, result.stderr


def test_debug_true_without_secret_key_uses_the_dev_key(tmp_path):
    result = run(["-c", "import django; django.setup(); from django.conf import settings; "
                        "print(settings.SECRET_KEY == settings.DEV_SECRET_KEY)"], DEBUG="true",
                 ORCH_VAR_DIR=str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"


def test_the_sqlite_database_and_its_wal_files_are_owner_only(tmp_path):
    result = run(["-c", CONNECT_AND_WRITE], DEBUG="true", ORCH_VAR_DIR=str(tmp_path))
    assert result.returncode == 0, result.stderr
    modes = dict(line.split() for line in result.stdout.splitlines())
    assert str(tmp_path / "orchestrator.sqlite3") in modes
    assert set(modes.values()) == {"0o600"}, modes


def test_an_existing_world_readable_sqlite_file_is_made_owner_only(tmp_path):
    database = tmp_path / "orchestrator.sqlite3"
    database.touch()
    database.chmod(0o644)
    result = run(["-c", CONNECT_AND_WRITE], DEBUG="true", ORCH_VAR_DIR=str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert stat.S_IMODE(database.stat().st_mode) == 0o600


@pytest.mark.django_db
def test_the_admin_credentials_file_is_owner_only(tmp_path, settings, monkeypatch):
    from orchestrator.management.commands.runstack import Command

    settings.VAR_DIR = tmp_path
    credentials = tmp_path / "admin-credentials.txt"
    credentials.write_text("old")
    credentials.chmod(0o644)  # left over from an older version
    monkeypatch.delenv("ADMIN_PASSWORD", raising=False)
    Command().ensure_admin()
    assert stat.S_IMODE(credentials.stat().st_mode) == 0o600
    assert credentials.read_text().startswith("username: admin\npassword: ")
