"""Start-up checks for configurations that silently break durability."""
from django.conf import settings
from django.core.checks import Warning, register


@register()
def check_worker_configuration(app_configs, **kwargs):
    problems = []
    q = settings.Q_CLUSTER
    if q.get("timeout") and q.get("retry", 0) <= q["timeout"]:
        problems.append(Warning(
            "Q_CLUSTER retry must exceed timeout, or django-q2 delivers a running job again.",
            hint="Raise Q_CLUSTER['retry'] above the job timeout plus queue wait.",
            id="orchestrator.W001",
        ))
    if settings.ORCH_STALE_AFTER_SECONDS <= settings.ORCH_HEARTBEAT_SECONDS:
        problems.append(Warning(
            "ORCH_STALE_AFTER_SECONDS must be larger than ORCH_HEARTBEAT_SECONDS, or live tasks look dead.",
            hint="Use at least 3 heartbeat intervals.",
            id="orchestrator.W002",
        ))
    db = settings.DATABASES["default"]
    if db["ENGINE"].endswith("sqlite3"):
        opts = db.get("OPTIONS", {})
        if opts.get("transaction_mode") != "IMMEDIATE" or "journal_mode=WAL" not in opts.get("init_command", ""):
            problems.append(Warning(
                "SQLite without IMMEDIATE transactions and WAL mode fails with 'database is locked' under workers.",
                id="orchestrator.W003",
            ))
    return problems
