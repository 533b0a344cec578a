"""Django for a benchmark script: DATABASE_URL if set, else a throwaway SQLite file; the
bench-only task types registered; the schema migrated."""
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def setup(name: str, **env: str) -> None:
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "orchestrator.settings")
    if "DATABASE_URL" not in os.environ:
        os.environ["DATABASE_URL"] = f"sqlite:///{tempfile.mkdtemp()}/{name}.sqlite3"
    os.environ.setdefault("ORCH_LOG_LEVEL", "WARNING")
    # As in production: DEBUG off (Django then keeps no per-query log).
    os.environ.setdefault("DEBUG", "false")
    os.environ.setdefault("SECRET_KEY", "bench-" + os.urandom(16).hex())
    os.environ.setdefault("ORCH_EXTRA_TASK_TYPES", "bench.benchtypes")
    os.environ.update(env)
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0)


def database_label() -> str:
    return "postgresql" if os.environ["DATABASE_URL"].startswith("postgres") else "sqlite"
