"""The test suite's settings: the harness's own, with a fast password hasher — a real
PBKDF2 hash costs about half a second, and most tests make a user or two. The processes a
test starts (web, workers) get these settings too (tests/conftest.py `process_env`), so a
password set here logs in there."""
import os

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
