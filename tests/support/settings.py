"""The test suite's settings: the harness's own, with a fast password hasher — a real
PBKDF2 hash costs about half a second, and most tests make a user or two. The processes a
test starts (web, workers) get these settings too (tests/conftest.py `process_env`), so a
password set here logs in there."""
import os
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

# `make test` runs the suite in several pytest processes (pytest-xdist). Each has its own test
# database already (pytest-django); what they would otherwise share is split here, before the
# harness's settings read it: the Redis database (a worker cluster started by one process would
# take the broker messages of the other's tasks, whose ids mean other tasks in its database) and
# the var directory (fault markers, the pipeline's stage scripts, keyed by task id). The
# processes a test starts inherit the split environment, and the marker keeps them from
# splitting it again.
_XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if _XDIST_WORKER and os.environ.get("ORCH_TEST_SPLIT_FOR") != _XDIST_WORKER:
    os.environ["ORCH_TEST_SPLIT_FOR"] = _XDIST_WORKER
    _index = int(_XDIST_WORKER.removeprefix("gw"))
    if os.environ.get("REDIS_URL"):
        _redis = urlsplit(os.environ["REDIS_URL"])
        _base = int(_redis.path.strip("/") or 0)
        os.environ["REDIS_URL"] = urlunsplit(_redis._replace(path=f"/{(_base + 1 + _index) % 16}"))
    _var = Path(os.environ.get("ORCH_VAR_DIR") or Path(__file__).resolve().parents[2] / "var")
    os.environ["ORCH_VAR_DIR"] = str(_var / f"test-{_XDIST_WORKER}")

# DEBUG is off by default (orchestrator/settings.py); the suite runs as `make run` does, and
# so do the processes it starts (they inherit this environment).
os.environ.setdefault("DEBUG", "true")

from orchestrator.settings import *  # noqa: E402,F401,F403

PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]

# The webhook rate limiter counts in the test database's cache table even when REDIS_URL is
# set: a test's counts are rolled back with its transaction, instead of lingering in Redis
# for the next test (or the next run) from the same address.
CACHES = {**CACHES, "ratelimit": {"BACKEND": "django.core.cache.backends.db.DatabaseCache",  # noqa: F405
                                  "LOCATION": "orchestrator_ratelimit_cache"}}
