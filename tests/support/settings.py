"""The test suite's settings: the harness's own, with a fast password hasher — a real
PBKDF2 hash costs about half a second, and most tests make a user or two. The processes a
test starts (web, workers) get these settings too (tests/conftest.py `process_env`), so a
password set here logs in there."""
from orchestrator.settings import *  # noqa: F401,F403

PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
