"""Start-up checks (Django's system checks, tag `orchestrator`): configurations that
silently break durability, one function per concern, each with a stable id.

`manage.py check` runs the everyday ones; `manage.py check --deploy` adds the
production-only ones (deploy=True)."""
import sys

from django.conf import settings
from django.core.checks import Error, Warning, register

from . import extensions
from .conf import TABLE

TAG = "orchestrator"


@register(TAG)
def check_worker_redelivery(app_configs, **kwargs):
    q = settings.Q_CLUSTER
    if q.get("timeout") and q.get("retry", 0) <= q["timeout"]:
        return [Warning("Q_CLUSTER retry must exceed timeout, or django-q2 delivers a running job again.",
                        hint="Raise Q_CLUSTER['retry'] above the job timeout plus queue wait.",
                        id="orchestrator.W001")]
    return []


@register(TAG)
def check_lease_timing(app_configs, **kwargs):
    problems = []
    if settings.ORCH_STALE_AFTER_SECONDS <= settings.ORCH_HEARTBEAT_SECONDS:
        problems.append(Warning(
            "ORCH_STALE_AFTER_SECONDS must be larger than ORCH_HEARTBEAT_SECONDS, or live tasks look dead.",
            hint="Use at least 3 heartbeat intervals.", id="orchestrator.W002"))
    if settings.ORCH_REQUEUE_AFTER_SECONDS <= settings.ORCH_HEARTBEAT_SECONDS:
        problems.append(Warning(
            "ORCH_REQUEUE_AFTER_SECONDS is not longer than a heartbeat: queued tasks are re-sent to the broker "
            "before a worker had a fair chance to claim them.",
            hint="Use several seconds (the default is 30).", id="orchestrator.W004"))
    if settings.ORCH_RECOVERY_TIMEOUT_SECONDS <= settings.ORCH_STALE_AFTER_SECONDS:
        problems.append(Warning(
            "ORCH_RECOVERY_TIMEOUT_SECONDS is not longer than ORCH_STALE_AFTER_SECONDS: recoveries are given up "
            "before a worker can take them.", hint="Use minutes (the default is 300).", id="orchestrator.W005"))
    return problems


POLL_INTERVALS = ("ORCH_CONTROL_POLL_SECONDS", "ORCH_EXECUTOR_WATCH_SECONDS", "ORCH_EXECUTOR_CONTROL_POLL_SECONDS")


@register(TAG)
def check_poll_intervals(app_configs, **kwargs):
    """A poll interval of 0 spins a CPU (and the control polls query the database without
    pause); a negative one spins as well, or stops the worker's watchdog (time.sleep refuses it)."""
    defaults = {setting.name: setting.default for setting in TABLE}
    return [Error(f"{name} is {getattr(settings, name)!r}: a poll interval must be more than 0 seconds.",
                  hint=f"Unset {name} for its default ({defaults[name]:g} s), or set a small positive number.",
                  id="orchestrator.E007")
            for name in POLL_INTERVALS if not getattr(settings, name) > 0]


@register(TAG)
def check_sqlite_concurrency(app_configs, **kwargs):
    db = settings.DATABASES["default"]
    if db["ENGINE"].endswith("sqlite3"):
        opts = db.get("OPTIONS", {})
        if opts.get("transaction_mode") != "IMMEDIATE" or "journal_mode=WAL" not in opts.get("init_command", ""):
            return [Warning("SQLite without IMMEDIATE transactions and WAL mode fails with 'database is locked' "
                            "under workers.", id="orchestrator.W003")]
    return []


@register(TAG)
def check_process_isolation(app_configs, **kwargs):
    if settings.ORCH_ISOLATE_EXECUTION and not sys.platform.startswith("linux"):
        return [Error("ORCH_ISOLATE_EXECUTION needs Linux (fork, prctl child subreaper, /proc): Force-terminate "
                      f"could not kill a task's process tree on {sys.platform}.",
                      hint="Run workers on Linux, or set ORCH_ISOLATE_EXECUTION=false (Force-terminate then waits "
                           "for steps to honour cancellation).", id="orchestrator.E006")]
    return []


@register(TAG, deploy=True)
def check_production_database(app_configs, **kwargs):
    if settings.DATABASES["default"]["ENGINE"].endswith("sqlite3") and not settings.DEBUG:
        return [Warning("DEBUG is false but the database is SQLite: one file on one machine, and writers queue "
                        "behind each other.", hint="Set DATABASE_URL=postgres://... for production.",
                        id="orchestrator.W010")]
    return []


@register(TAG, deploy=True)
def check_secret_key(app_configs, **kwargs):
    if settings.SECRET_KEY == settings.DEV_SECRET_KEY:
        return [Error("SECRET_KEY is the public development key: sessions and API tokens can be forged.",
                      hint="Set SECRET_KEY to a long random value (the same on every web and worker host).",
                      id="orchestrator.E011")]
    return []


@register(TAG, deploy=True)
def check_public_url(app_configs, **kwargs):
    if "127.0.0.1" in settings.ORCH_PUBLIC_URL or "localhost" in settings.ORCH_PUBLIC_URL:
        return [Warning(f"ORCH_PUBLIC_URL is {settings.ORCH_PUBLIC_URL}: the links in emails to operators "
                        f"(a task needs a human) point at this machine only.",
                        hint="Set ORCH_PUBLIC_URL to the dashboard's public address.", id="orchestrator.W012")]
    return []


@register(TAG)
def check_agent_db_tables(app_configs, **kwargs):
    from .tools.dbread import denied_in_setting

    denied = denied_in_setting()
    if denied:
        return [Error(f"ORCH_AGENT_DB_TABLES names {', '.join(denied)}: the harness's own tables (users, sessions, "
                      f"tokens, webhook secrets, review queue, tasks) are never readable by db_query.",
                      hint="Remove them from ORCH_AGENT_DB_TABLES; list only tables of your own data.",
                      id="orchestrator.E020")]
    return []


@register(TAG)
def check_llm_models(app_configs, **kwargs):
    from .llm.profiles import ModelsConfigError, declared

    try:
        declared()
    except ModelsConfigError as exc:
        return [Error(str(exc), hint='LLM_MODELS is JSON: {"name": {"base_url": "http://host:8000/v1", "model": "…", '
                                     '"api_key": "…"}}; docs/agent.md, "Models", lists every field.', id="orchestrator.E040")]
    return []


@register(TAG)
def check_extensions(app_configs, **kwargs):
    """Every module ORCH_EXTENSIONS names can be imported (apps.py imported them at start-up)."""
    return [Error(f"ORCH_EXTENSIONS names {module!r}, which cannot be imported: {why}",
                  hint=f"Fix {module!r} or remove it from ORCH_EXTENSIONS (comma-separated dotted module paths, "
                       f"importable by the web, worker and sweeper processes; docs/extending.md).",
                  id="orchestrator.E030")
            for module, why in extensions.load().items()]


@register(TAG)
def check_mcp_servers(app_configs, **kwargs):
    """Every server ORCH_MCP_SERVERS declares is well formed (a wrong one is left out at run time)."""
    from .tools.mcp import ConfigError, parse_server

    problems = []
    for name, spec in (settings.ORCH_MCP_SERVERS or {}).items():
        try:
            parse_server(name, spec, origin="ORCH_MCP_SERVERS")
        except ConfigError as exc:
            problems.append(Error(f"ORCH_MCP_SERVERS: {exc}", id="orchestrator.E050", hint=(
                'ORCH_MCP_SERVERS is JSON: {"git": {"command": ["mcp-server-git", "--repository", "/srv/repo"], '
                '"env": {}}, "files": {"url": "http://127.0.0.1:9000/mcp", "headers": {"Authorization": "Bearer …"}}}; '
                'docs/extending.md, "MCP servers".')))
    return problems
