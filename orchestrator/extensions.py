"""ORCH_EXTENSIONS: an installation's own modules (tools and task types written against
orchestrator.sdk; docs/extending.md), imported in every process at start-up (apps.py) and before
the registries answer (tasktypes, the agent's tools).

A module that cannot be imported stops the start with its name: it is recorded, not raised, so
that `manage.py check` (which runserver, qcluster and `recover` run first) reports it as the
system check orchestrator.E030 (checks.py); daphne, which runs no checks, refuses to start
(asgi.py, `require`). Recorded once per process: a module that failed is not imported again
(importing it runs its code again)."""
import importlib
import sys
import threading
import traceback

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

_failures: dict[str, str] = {}  # module -> why it could not be imported
_lock = threading.RLock()


# The demo app (demo/): an extension like any other, offered unless ORCH_DEMO is off. Named, not
# imported: the core never imports it (import-linter).
DEMO_MODULES = ("demo.tasktypes", "demo.tools")


def modules() -> list[str]:
    return [*(DEMO_MODULES if settings.ORCH_DEMO else ()), *settings.ORCH_EXTENSIONS]


def load() -> dict[str, str]:
    """Import the configured modules not imported yet; the ones that failed, with why."""
    wanted = modules()
    with _lock:
        for module in wanted:
            if module in sys.modules or module in _failures:
                continue
            try:
                importlib.import_module(module)
            except Exception as exc:
                _failures[module] = _why(module, exc)
        return {m: _failures[m] for m in wanted if m in _failures}


def _why(module: str, exc: Exception) -> str:
    if isinstance(exc, ModuleNotFoundError) and exc.name and (module == exc.name or module.startswith(exc.name + ".")):
        return f"no module named {exc.name!r}"
    # Where it broke: the innermost frame (the module's own line, or the library it called).
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" ({frames[-1].filename}, line {frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


def require() -> None:
    """Raise ImproperlyConfigured naming every configured module that cannot be imported."""
    failed = load()
    if failed:
        raise ImproperlyConfigured("ORCH_EXTENSIONS: " + "; ".join(f"{m!r} cannot be imported: {why}"
                                                                   for m, why in failed.items()))


def configured(module: str) -> bool:
    """Whether `module` is (or is inside) a module configured now: ORCH_EXTENSIONS, or
    ORCH_EXTRA_TASK_TYPES (plug-ins and tests). What an unconfigured module defined is not offered."""
    return any(module == m or module.startswith(m + ".")
               for m in [*modules(), *settings.ORCH_EXTRA_TASK_TYPES])
