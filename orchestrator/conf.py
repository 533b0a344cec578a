"""The harness's settings in one place: every ORCH_* environment variable, declared once
with its type, default and meaning (TABLE). settings.py loads them (`from_environment`);
the engine reads them through `harness`. The ORCH_* table of docs/configuration.md is
generated from TABLE (`manage.py config_table --write`; a test fails when they differ).

One parser per kind: `boolean` reads every true-or-false variable, TABLE's and the Django
settings' own (DEBUG, through `env_bool`)."""
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

BASE_DIR = Path(__file__).resolve().parent.parent

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def boolean(text: str) -> bool:
    """The one true-or-false parser: an unknown word is refused, never read as false."""
    value = text.strip().lower()
    if value in TRUE_WORDS:
        return True
    if value in FALSE_WORDS:
        return False
    raise ValueError(f"expected one of {', '.join(TRUE_WORDS)} or {', '.join(FALSE_WORDS)}")


def names(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def json_object(text: str) -> dict:
    import json
    value = json.loads(text) if text.strip() else {}
    if not isinstance(value, dict):
        raise ValueError("expected a JSON object")
    return value


KINDS = {int: "a whole number", float: "a number", boolean: "true or false"}


def parse_value(name: str, raw: str, parse: Callable[[str], Any], meaning: str = "") -> Any:
    """`raw` (set, not empty) parsed; a value that does not parse stops the start with a
    message naming the variable."""
    try:
        return parse(raw)
    except ValueError as exc:
        sets = f"; it sets: {meaning}." if meaning else "."
        raise ImproperlyConfigured(f"{name}={raw!r} is not {KINDS.get(parse, 'valid')} ({exc}){sets}") from None


def env_bool(name: str, default: bool, environ=os.environ) -> bool:
    """A true-or-false variable that is not in TABLE (DEBUG, EMAIL_IMAP_USE_SSL): unset or
    empty is `default`, else `boolean` (an unknown word stops the start)."""
    raw = environ.get(name)
    if raw is None or raw == "":
        return default
    return parse_value(name, raw, boolean)


@dataclass(frozen=True)
class Setting:
    name: str
    parse: Callable[[str], Any]
    # A value, or a function of the values read so far and the environment (a default that
    # follows another setting).
    default: Any
    meaning: str
    # docs/configuration.md only: the default in words (markdown), where the value alone
    # does not say it (a default that follows another setting, a unit); and a link to the
    # page that says more.
    shown_default: str = ""
    see: str = ""


RETENTION = "[Retention](recovery.md#retention-a-year-of-production)"
NOTIFICATIONS = "[notifications.md](notifications.md#settings)"

TABLE: tuple[Setting, ...] = (
    # --- where things live, and what runs
    Setting("ORCH_VAR_DIR", Path, BASE_DIR / "var", "directory for the SQLite file, logs and fault markers"),
    Setting("ORCH_WORKERS", int, 2, "worker processes per `qcluster`"),
    Setting("ORCH_WEB_DB_POOL_SIZE", int, 20,
            "PostgreSQL: the web server (daphne) takes its database connections from a pool of at most this many "
            "instead of opening one per request (a request that waits 5 s for one answers 503); 0: a new "
            "connection per request"),
    Setting("ORCH_JOB_TIMEOUT_SECONDS", int, 3600, "django-q2 job timeout (its `retry` is set to twice this)"),
    Setting("ORCH_ISOLATE_EXECUTION", boolean, True,
            "run a task's steps in a child process tree that Force-terminate can kill outright"),
    Setting("ORCH_EXECUTOR_WATCH_SECONDS", float, 0.05,
            "with `ORCH_ISOLATE_EXECUTION` on: how often a worker looks whether its executor process has exited (a "
            "crash is handed to recovery at once) and whether the worker is being shut down"),
    Setting("ORCH_EXECUTOR_CONTROL_POLL_SECONDS", float, 0.1,
            "with `ORCH_ISOLATE_EXECUTION` on: how often a worker reads its task's control column: Force-terminate, a "
            "Stop past its grace, a lease lost to another worker (each kills the executor's process tree)"),
    Setting("ORCH_EXECUTOR_MAX_RUNS", int, 100,
            "with `ORCH_ISOLATE_EXECUTION` on: task runs one executor process serves before its worker forks a new one "
            "(1: a new process for every run). A killed or crashed executor, or one whose run left a thread running, "
            "is never reused"),
    Setting("ORCH_EXTRA_TASK_TYPES", names, [], "extra task type modules, comma-separated (plug-ins, tests)"),
    Setting("ORCH_EXTENSIONS", names, [],
            "your own modules (dotted paths, comma-separated) defining tools and task types with "
            "`orchestrator.sdk`; a missing or broken one stops the start with its name (system check)"),
    Setting("ORCH_DEMO", boolean, True,
            "offer the demo workloads (task types `demo.*`, the agent's `contracts_list` / `contracts_read`): the "
            "`demo` app, an extension written on `orchestrator.sdk` like yours; off, they are neither listed nor "
            "runnable (their tables stay)"),
    Setting("ORCH_MCP_SERVERS", json_object, {},
            'MCP servers whose tools agents may be granted, JSON: `{"git": {"command": [...], "env": {}}, '
            '"files": {"url": "http://…/mcp", "headers": {…}}}`; the admin adds more'),
    Setting("ORCH_MCP_CALL_TIMEOUT_SECONDS", float, 60.0, "the longest an MCP tool call may take"),
    Setting("ORCH_CONTRACTS_DIR", str, "", "where `demo.contracts` reads `contract_*.txt` (empty: the shipped samples)",
            see="[Demo task types](task-types.md#demo-task-types)"),
    Setting("ORCH_PUBLIC_URL", str, lambda values, env: f"http://127.0.0.1:{env.get('PORT', '8000')}",
            "the dashboard's address, for links in emails to operators", shown_default="`http://127.0.0.1:<PORT>`",
            see=NOTIFICATIONS),
    # --- leases, recovery, retries
    Setting("ORCH_HEARTBEAT_SECONDS", float, 2.0, "how often a running task's lease is refreshed"),
    Setting("ORCH_STALE_AFTER_SECONDS", float, lambda values, env: 3 * values["ORCH_HEARTBEAT_SECONDS"],
            "a running task whose heartbeat is older is recovered",
            shown_default="3 × `ORCH_HEARTBEAT_SECONDS`"),
    Setting("ORCH_CONTROL_POLL_SECONDS", float, 0.05, "how often a runner looks for operator requests"),
    Setting("ORCH_GRACE_SECONDS", float, 5.0, "how long Stop waits for the current step before it escalates"),
    Setting("ORCH_PAUSE_GRACE_SECONDS", float, 5.0,
            "how long Pause lets a running step finish before it cancels one that is safe to cancel (an LLM stream, "
            "a read, an idempotent step's subprocess); it runs again on resume"),
    Setting("ORCH_STEP_TIMEOUT_SECONDS", float, 3600.0,
            "a step running longer is cancelled through its token and its failure policy applies (an effect in "
            "flight becomes unknown → review); a task type (`step_timeout`) or a step (`StepSpec(timeout=…)`) may "
            "set its own"),
    Setting("ORCH_STALL_FACTOR", float, 5.0,
            "a running task whose current step has run this many times the p95 of its type's step durations (at "
            "least 10 s, once the type has 5 finished steps) is marked *stalled* on the list, its page and the API "
            "(`waiting_on.stalled`), counted in `orch_tasks_stalled`, and its operators are told once per stall "
            "(`task.stalled`); 0: never"),
    Setting("ORCH_SLICE_SECONDS", float, 60.0, "a worker drives one task this long, then re-enqueues it (fairness)"),
    Setting("ORCH_MAX_RECOVERY_ATTEMPTS", int, 3, "recoveries per task before it `needs_human`"),
    Setting("ORCH_RECOVERY_TIMEOUT_SECONDS", float, 300.0,
            "a recovery that has not got its task running again after this long makes it `needs_human` "
            "(operators are emailed)"),
    Setting("ORCH_REQUEUE_AFTER_SECONDS", float, 30.0,
            "a `queued` task nobody claimed for this long is handed to the broker again (its message may have been "
            "lost)"),
    Setting("ORCH_DATABASE_RETRY_SECONDS", float, 120.0,
            "how long a finished step waits for an unreachable database to commit its checkpoint"),
    Setting("ORCH_STEP_MAX_ATTEMPTS", int, 3, "attempts per step before its failure policy applies"),
    Setting("ORCH_SNAPSHOT_KEEP", int, 10, "snapshot versions kept per task (older ones are pruned)"),
    Setting("ORCH_SNAPSHOT_FULL_EVERY", int, 200,
            "a full snapshot every this many versions; the versions between store only what changed"),
    Setting("ORCH_RESULT_INLINE_BYTES", int, 65_536,
            "a step result larger than this (as JSON) is stored apart and loaded only when needed"),
    Setting("ORCH_PURE_STEP_SYNC_COMMIT", boolean, False,
            "PostgreSQL: wait for the disk flush when committing a step that had no side effect "
            "(off: such a step is recomputed if the database server itself crashes)"),
    Setting("ORCH_PREPARE_STEP_COMMIT", boolean, True,
            "PostgreSQL: prepare the step's commit statement and a transactional effect's record once per connection "
            "instead of parsing and planning them on every step (most of their server time); turn it off behind a "
            "pooler in transaction "
            "mode that does not keep prepared statements (PgBouncer before 1.21)"),
    Setting("ORCH_FAULTS", str, "",
            "fault injection for the crash tests (`orchestrator/primitives/faults.py`); unset in production",
            see="[Tests](testing.md)"),
    # --- events sent into tasks (the inbox, engine/inbox.py)
    Setting("ORCH_INBOX_SHED_P4_AT", int, 100, "pending events of a task past which new P4 events are refused (429)"),
    Setting("ORCH_INBOX_SHED_P3_AT", int, 250, "pending events of a task past which new P3 events are refused too"),
    Setting("ORCH_INBOX_SHED_P2_AT", int, 500, "pending events of a task past which new P2 events are refused too"),
    Setting("ORCH_INBOX_PAUSE_AT", int, 5000, "pending events at which a task pauses and its operators are told"),
    Setting("ORCH_INBOX_SHED_ALL_AT", int, 50_000,
            "pending P3/P4 events across the installation past which new ones are refused"),
    Setting("ORCH_INBOX_MERGE_SECONDS", float, 1.5, "a mergeable event supersedes its group's pending ones this recent"),
    Setting("ORCH_INBOX_MERGE_CAP_SECONDS", float, 4.5, "a burst of mergeable events is delivered at most this late"),
    Setting("ORCH_INBOX_P4_TTL_SECONDS", float, 600.0, "a P4 event not consumed within this long expires"),
    # --- retention of finished tasks (engine/retention.py); 0 turns a rule off
    Setting("ORCH_RETAIN_STREAM_EVENTS_DAYS", float, 7.0,
            "a finished task's token-level stream events (agent.stream) are dropped this long after it finished",
            see=RETENTION),
    Setting("ORCH_RETAIN_EVENTS_DAYS", float, 30.0,
            "a finished task's progress log is compacted to a summary this long after it finished", see=RETENTION),
    Setting("ORCH_RETAIN_WAL_DAYS", float, 90.0,
            "a finished task's WAL rows (those no review refers to) and idempotency records go this long after",
            see=RETENTION),
    Setting("ORCH_RETAIN_NOTIFICATIONS_DAYS", float, 30.0,
            "a webhook delivery that is over (delivered, or given up after its last attempt) is deleted this long "
            "after it was queued; a pending one never", see=RETENTION),
    Setting("ORCH_RETAIN_WEBHOOK_REJECTIONS_DAYS", float, 30.0,
            "a row of rejected incoming webhook requests is deleted this long after its last repeat (the first "
            "occurrence stays in the audit log)", see=RETENTION),
    Setting("ORCH_RETAIN_EVERY_SECONDS", float, 300.0, "how often the sweeper runs the retention rules", see=RETENTION),
    Setting("ORCH_RETAIN_BATCH_TASKS", int, 50, "tasks per rule per retention run (each in its own short transaction)",
            see=RETENTION),
    # --- limits every task gets unless its creator overrides them
    Setting("ORCH_DEFAULT_MAX_STEPS", int, 100_000, "default max_steps of a task"),
    Setting("ORCH_DEFAULT_MAX_TOKENS", int, 10_000_000, "default max_tokens of a task"),
    Setting("ORCH_DEFAULT_MAX_SECONDS", float, 24 * 3600.0, "default max_seconds (active time) of a task"),
    Setting("ORCH_DEFAULT_MAX_SUBTASKS", int, 4, "default max_subtasks (steps run at once) of a task"),
    # --- what an agent may reach (the security model: docs/agent.md, "Security model")
    Setting("ORCH_AGENT_HOST_TOOLS", names, [],
            "agent tools that reach the host or the database (`shell_run`, `db_query`, `db_upsert`) this "
            "installation enables; an admin must still grant them per task",
            see="[Security model](agent.md#security-model-what-an-agent-can-reach)"),
    Setting("ORCH_AGENT_DB_TABLES", names, ["demo_source", "demo_destination", "demo_contract_extraction"],
            "the tables `db_query` may read; auth, sessions, tokens, webhook sources, the review queue and the "
            "harness's own tables are never readable, whatever this says"),
    Setting("ORCH_AGENT_DB_ROLE", str, "orchestrator_agent_reader",
            "PostgreSQL: the read-only role `db_query` runs as (`SET ROLE` in a read-only transaction; "
            "`manage.py agent_db_role` grants it)"),
    Setting("ORCH_AGENT_RESULT_INLINE_CHARS", int, 8000,
            "a tool result longer than this reaches the model as its head and a reference; the model reads on with "
            "`result_read` (the step keeps the whole result)"),
    Setting("ORCH_AGENT_COMPACT_AT", float, 0.7,
            "share of the model's context window (less the answer's cap) past which an agent's dialog is compacted: "
            "a `compact-NNN` step has the model summarise the earlier turns, and later requests send the summary "
            "and the harness's ledger of effects instead of them"),
    Setting("ORCH_AGENT_SUMMARY_TOKENS", int, 1200,
            "the longest a compaction's summary may be, in tokens (at most an eighth of the window)"),
    Setting("ORCH_AGENT_EMAIL_ALLOW", names, [],
            "recipient patterns (`*@example.org`, `ops@example.org`) `email_send` may write to; any other recipient "
            "needs a reviewer's approval", shown_default="the domain of `DEFAULT_FROM_EMAIL`"),
    Setting("ORCH_HTTP_ALLOW", names, [],
            "`host:port` pairs `http_request` may reach although they are loopback, private, link-local or "
            "metadata addresses"),
    Setting("ORCH_HTTP_TIMEOUT_SECONDS", float, 30.0, "the longest an agent's HTTP request may take"),
    Setting("ORCH_HTTP_MAX_RESPONSE_BYTES", int, 1_000_000, "the largest response body an agent's HTTP request reads"),
    Setting("ORCH_HTTP_MAX_REQUEST_BYTES", int, 1_000_000, "the largest request body an agent's HTTP request sends"),
    Setting("ORCH_SANDBOX_CPU_SECONDS", int, 60, "`shell_run`: CPU seconds per sandboxed call"),
    Setting("ORCH_SANDBOX_MEMORY_MB", int, 512, "`shell_run`: address space per sandboxed call (MiB)"),
    Setting("ORCH_SANDBOX_PROCESSES", int, 64, "`shell_run`: processes per sandboxed call"),
    Setting("ORCH_SANDBOX_OUTPUT_BYTES", int, 65_536, "`shell_run`: stdout and stderr kept per sandboxed call (each)"),
    Setting("ORCH_APPROVAL_TIMEOUT_SECONDS", float, 86400.0,
            "an approval nobody decided within this long expires and its tool's fallback applies "
            "(a task may set `approval_timeout_seconds`)"),
    Setting("ORCH_NOTIFY_ATTEMPTS", int, 8,
            "attempts per outgoing webhook delivery (exponential backoff) before it is marked failed",
            see=NOTIFICATIONS),
    Setting("ORCH_NOTIFY_BACKOFF_SECONDS", float, 30.0,
            "the wait before a webhook delivery's second attempt; each next wait doubles (capped at 6 h)",
            see=NOTIFICATIONS),
    Setting("ORCH_NOTIFY_TIMEOUT_SECONDS", float, 5.0,
            "the longest one webhook attempt may take, and how long the email to the people who can act waits "
            "for each answer of the mail server", see=NOTIFICATIONS),
    Setting("ORCH_WEBHOOK_RATE", str, "120/m",
            "requests per source and per client address the webhook endpoint takes (django-ratelimit syntax)"),
    # --- web
    Setting("ORCH_LIVE_POLL_SECONDS", float, lambda values, env: 1.0 if env.get("REDIS_URL") else 0.1,
            "how often each web process looks for changed tasks (0.1 s; 1 s as a safety net with Redis)",
            shown_default="`0.1` (`1` with `REDIS_URL`)"),
    Setting("ORCH_MAX_REQUEST_BYTES", int, 2_621_440,
            'the largest request body; a bigger API request gets 413 `{"detail": "Request body too large: the '
            'limit is … bytes …"}` (Django\'s `DATA_UPLOAD_MAX_MEMORY_SIZE` follows it)',
            shown_default="`2621440` (2.5 MiB)"),
    Setting("ORCH_LOGIN_FAILURE_LIMIT", int, 5,
            "login throttling: after this many wrong passwords for one username from one IP address, that pair is "
            "locked out for `ORCH_LOGIN_COOLOFF_MINUTES`"),
    Setting("ORCH_LOGIN_COOLOFF_MINUTES", float, 15.0, "how long a lock-out (`ORCH_LOGIN_FAILURE_LIMIT`) lasts"),
    Setting("ORCH_METRICS_TOKEN", str, "",
            "the bearer token Prometheus sends to `GET /metrics` (a secret, 32+ random characters); empty: the "
            "endpoint answers 404", see="[Metrics](deployment.md#metrics)"),
    # --- logs
    Setting("ORCH_LOG_LEVEL", str, "INFO", "log level of the harness's loggers"),
    Setting("ORCH_LOG_FORMAT", str, "json", "`json` lines, or `text` for `key=value` lines instead of JSON"),
    Setting("ORCH_OTEL_CONSOLE", boolean, False,
            "print trace spans to stdout, one JSON object per line (`OTEL_EXPORTER_OTLP_ENDPOINT` sends them to a "
            "collector)"),
)


def from_environment(environ=os.environ) -> dict[str, Any]:
    """Every setting of TABLE, from the environment or its default; a value that does not
    parse stops the start with a message naming the variable."""
    values: dict[str, Any] = {}
    for setting in TABLE:
        raw = environ.get(setting.name)
        if raw is None or raw == "":
            default = setting.default
            values[setting.name] = default(values, environ) if callable(default) else default
        else:
            values[setting.name] = parse_value(setting.name, raw, setting.parse, setting.meaning)
    return values


# --- docs/configuration.md's table of these settings -----------------------------------------
DOCS_PAGE = BASE_DIR / "docs" / "configuration.md"
REGENERATE = "python manage.py config_table --write"
TABLE_BEGIN = f"<!-- conf.TABLE begin: generated by `{REGENERATE}` from orchestrator/conf.py; edit it there -->"
TABLE_END = "<!-- conf.TABLE end -->"


def shown_default(setting: Setting) -> str:
    """The default as docs/configuration.md shows it (markdown)."""
    if setting.shown_default:
        return setting.shown_default
    value = setting.default
    if callable(value):
        raise ValueError(f"{setting.name}: a default that follows other settings needs shown_default")
    if isinstance(value, bool):
        return f"`{'true' if value else 'false'}`"
    if isinstance(value, Path):
        return f"`{value.relative_to(BASE_DIR) if value.is_relative_to(BASE_DIR) else value}/`"
    if isinstance(value, float):
        return f"`{int(value) if value.is_integer() else value}`"
    if isinstance(value, list):
        return f"`{','.join(value)}`" if value else "empty"
    if value in ("", {}):
        return "empty"
    return f"`{value}`"


def markdown_table() -> str:
    """TABLE as the markdown table docs/configuration.md holds between TABLE_BEGIN and TABLE_END."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    lines = ["| variable | default | meaning |", "| --- | --- | --- |"]
    for setting in TABLE:
        meaning = setting.meaning + (f"; see {setting.see}" if setting.see else "")
        lines.append(f"| `{setting.name}` | {cell(shown_default(setting))} | {cell(meaning)} |")
    return "\n".join(lines) + "\n"


def with_generated_table(page: str) -> str:
    """`page` (docs/configuration.md's text) with the generated table between its markers."""
    head, begin, rest = page.partition(TABLE_BEGIN)
    _, end, tail = rest.partition(TABLE_END)
    if not begin or not end:
        raise ValueError(f"{DOCS_PAGE.name} lacks the markers {TABLE_BEGIN!r} ... {TABLE_END!r}")
    return f"{head}{TABLE_BEGIN}\n{markdown_table()}{TABLE_END}{tail}"


class HarnessSettings:
    """What the engine reads, by the names it uses (from Django's settings, so tests can
    override them)."""

    @property
    def heartbeat_seconds(self) -> float:
        return settings.ORCH_HEARTBEAT_SECONDS

    @property
    def stale_after_seconds(self) -> float:
        return settings.ORCH_STALE_AFTER_SECONDS

    @property
    def stall_factor(self) -> float:
        return settings.ORCH_STALL_FACTOR

    @property
    def grace_seconds(self) -> float:
        return settings.ORCH_GRACE_SECONDS

    @property
    def snapshot_keep(self) -> int:
        return settings.ORCH_SNAPSHOT_KEEP

    @property
    def snapshot_full_every(self) -> int:
        return settings.ORCH_SNAPSHOT_FULL_EVERY

    @property
    def result_inline_bytes(self) -> int:
        return settings.ORCH_RESULT_INLINE_BYTES

    @property
    def pure_step_sync_commit(self) -> bool:
        return settings.ORCH_PURE_STEP_SYNC_COMMIT

    @property
    def prepare_step_commit(self) -> bool:
        return settings.ORCH_PREPARE_STEP_COMMIT

    @property
    def inbox(self) -> dict:
        return {name: getattr(settings, f"ORCH_INBOX_{name.upper()}") for name in (
            "shed_p4_at", "shed_p3_at", "shed_p2_at", "pause_at", "shed_all_at", "merge_seconds",
            "merge_cap_seconds", "p4_ttl_seconds")}

    @property
    def retention(self) -> dict:
        return {name: getattr(settings, f"ORCH_RETAIN_{name.upper()}") for name in (
            "stream_events_days", "events_days", "wal_days", "notifications_days", "webhook_rejections_days",
            "every_seconds", "batch_tasks")}

    @property
    def max_recovery_attempts(self) -> int:
        return settings.ORCH_MAX_RECOVERY_ATTEMPTS

    @property
    def requeue_after_seconds(self) -> float:
        return settings.ORCH_REQUEUE_AFTER_SECONDS

    @property
    def recovery_timeout_seconds(self) -> float:
        return settings.ORCH_RECOVERY_TIMEOUT_SECONDS

    @property
    def approval_timeout_seconds(self) -> float:
        return settings.ORCH_APPROVAL_TIMEOUT_SECONDS

    @property
    def database_retry_seconds(self) -> float:
        return settings.ORCH_DATABASE_RETRY_SECONDS

    @property
    def slice_seconds(self) -> float:
        return settings.ORCH_SLICE_SECONDS

    @property
    def control_poll_seconds(self) -> float:
        return settings.ORCH_CONTROL_POLL_SECONDS

    @property
    def executor_watch_seconds(self) -> float:
        return settings.ORCH_EXECUTOR_WATCH_SECONDS

    @property
    def executor_control_poll_seconds(self) -> float:
        return settings.ORCH_EXECUTOR_CONTROL_POLL_SECONDS

    @property
    def executor_max_runs(self) -> int:
        return settings.ORCH_EXECUTOR_MAX_RUNS

    @property
    def default_limits(self) -> dict:
        return {
            "max_steps": settings.ORCH_DEFAULT_MAX_STEPS,
            "max_tokens": settings.ORCH_DEFAULT_MAX_TOKENS,
            "max_seconds": settings.ORCH_DEFAULT_MAX_SECONDS,
            "max_subtasks": settings.ORCH_DEFAULT_MAX_SUBTASKS,
        }

    @property
    def step_max_attempts(self) -> int:
        return settings.ORCH_STEP_MAX_ATTEMPTS

    @property
    def isolate_execution(self) -> bool:
        return settings.ORCH_ISOLATE_EXECUTION

    @property
    def extra_task_type_modules(self) -> list[str]:
        return list(settings.ORCH_EXTRA_TASK_TYPES)


harness = HarnessSettings()
