"""Django settings, read from the environment (see docs/configuration.md).

The zero-config default is a SQLite file under var/; DATABASE_URL selects PostgreSQL.
"""
import os
from datetime import timedelta
from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from orchestrator.conf import env_bool, from_environment

BASE_DIR = Path(__file__).resolve().parent.parent
# Every ORCH_* setting, from its one declaration (orchestrator/conf.py TABLE).
ORCH = from_environment(os.environ)
globals().update(ORCH)
VAR_DIR = ORCH["ORCH_VAR_DIR"]
VAR_DIR.mkdir(parents=True, exist_ok=True)
# True-or-false variables outside conf.TABLE (DEBUG, EMAIL_IMAP_USE_SSL) are read by env_bool,
# with the parser TABLE's own use (conf.boolean): 1/true/yes/on, 0/false/no/off; any other
# word stops the start with the variable named.

DEV_SECRET_KEY = "dev-only-insecure-secret-key-change-me-in-production"  # orchestrator.checks E011 looks for it
# Off unless asked for: `make run` (and the test suite) set DEBUG=true; a server started any
# other way without DEBUG gets production behaviour, and so needs a SECRET_KEY (below).
DEBUG = env_bool("DEBUG", False)
SECRET_KEY = os.environ.get("SECRET_KEY", "").strip()
if not DEBUG and SECRET_KEY in ("", DEV_SECRET_KEY):
    # The dev key is public (it is in this file): with it anyone can forge sessions and
    # password-reset links. Refuse to start rather than run a production site with it.
    raise ImproperlyConfigured(
        "SECRET_KEY is not set (or is the public development key) and DEBUG=false (unset DEBUG is false "
        "outside `make run`): refusing to start. "
        "Set SECRET_KEY to a long random value, the same on every web and worker host, e.g. "
        "SECRET_KEY=$(python -c 'import secrets; print(secrets.token_urlsafe(50))'); "
        "or set DEBUG=true for local development.")
SECRET_KEY = SECRET_KEY or DEV_SECRET_KEY
ALLOWED_HOSTS = [h.strip() for h in os.environ.get("ALLOWED_HOSTS", "127.0.0.1,localhost,testserver").split(",") if h.strip()]
PORT = int(os.environ.get("PORT", "8000"))
CSRF_TRUSTED_ORIGINS = [
    o.strip() for o in os.environ.get("CSRF_TRUSTED_ORIGINS", "").split(",") if o.strip()
] or [f"http://{h}:{PORT}" for h in ALLOWED_HOSTS if h not in {"*", "testserver"}]

INSTALLED_APPS = [
    "daphne",  # first, so runserver serves ASGI
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "channels",
    "django_q",
    "ninja",  # serves the API docs' Swagger UI from its own static files (no CDN)
    "axes",
    "orchestrator.apps.OrchestratorConfig",
    "review.apps.ReviewConfig",
    # The demo workloads' tables (always installed: their migrations are part of the history); its
    # task types and tools are offered while ORCH_DEMO is on (orchestrator/extensions.py).
    "demo.apps.DemoConfig",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    # Serves /static/ under daphne too (runserver's static handling is not used).
    "whitenoise.middleware.WhiteNoiseMiddleware",
    # A request waits a few seconds for SQLite's write lock, not the workers' 30 (orchestrator/database_busy.py).
    "orchestrator.database_busy.RequestBusyTimeoutMiddleware",
    # A NUL character in the path or a form field is a 400; in the query string it is dropped
    # (PostgreSQL stores and compares none: orchestrator/nul_characters.py).
    "orchestrator.nul_characters.NulCharacterMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    # An unreachable database is a 503 page, not a 500 (process_exception).
    "orchestrator.outage.DatabaseOutageMiddleware",
    # SQLite's write lock held elsewhere is a 503 "busy, try again in 5 s" (asked before the line above).
    "orchestrator.database_busy.DatabaseBusyMiddleware",
    "csp.middleware.CSPMiddleware",
    # Last, as django-axes requires: refuses logins for a locked-out username + IP.
    "axes.middleware.AxesMiddleware",
]

ROOT_URLCONF = "orchestrator.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "orchestrator.web.access.nav_context",
            ],
        },
    },
]
WSGI_APPLICATION = "orchestrator.wsgi.application"
ASGI_APPLICATION = "orchestrator.asgi.application"

# --- Database -------------------------------------------------------------------------
SQLITE_PATH = VAR_DIR / "orchestrator.sqlite3"
DATABASE_URL = os.environ.get("DATABASE_URL", f"sqlite:///{SQLITE_PATH}")
# Workers keep connections open: django-q2's ORM broker otherwise reconnects on every
# poll: 18 tasks/s instead of 155 on PostgreSQL, measured on a 2-core machine.
CONN_MAX_AGE = int(os.environ.get("CONN_MAX_AGE", "600"))
_db = dj_database_url.parse(DATABASE_URL, conn_max_age=CONN_MAX_AGE, conn_health_checks=True)
if _db["ENGINE"] == "django.db.backends.sqlite3":
    # Without IMMEDIATE transactions, WAL mode and a busy timeout, concurrent
    # read-then-write transactions from the web and worker processes fail with
    # "database is locked" (24 of 24 in a test with a web process writing at the same time;
    # with these options none). SQLite connections are cheap: no pooling.
    _db["CONN_MAX_AGE"] = 0
    _db["CONN_HEALTH_CHECKS"] = False
    _db["OPTIONS"] = {
        "transaction_mode": "IMMEDIATE",
        # Workers wait this long for the write lock (their checkpoints must land); a web
        # request waits SQLITE_REQUEST_BUSY_TIMEOUT_SECONDS, then answers 503 with Retry-After
        # (orchestrator/database_busy.py): a worker frozen while writing must not hang the web.
        "timeout": 30,
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
    }
    # Tests use a file (not :memory:) so that worker processes can open the same
    # database; one per test run, so concurrent runs do not trample each other.
    _db["TEST"] = {"NAME": str(Path(_db["NAME"]).with_name(f"test_{os.getpid()}_" + Path(_db["NAME"]).name))}
    # The database holds password hashes, sessions and API token hashes: owner-only.
    # Created here with mode 0600 before SQLite opens it (SQLite gives its -wal and -shm
    # files the database file's mode).
    if _db["NAME"] and _db["NAME"] != ":memory:" and not str(_db["NAME"]).startswith("file:"):
        _path = Path(_db["NAME"])
        _path.parent.mkdir(parents=True, exist_ok=True)
        os.close(os.open(_path, os.O_CREAT | os.O_WRONLY, 0o600))
        for _file in (_path, _path.with_name(_path.name + "-wal"), _path.with_name(_path.name + "-shm")):
            if _file.exists() and _file.stat().st_uid == os.getuid() and _file.stat().st_mode & 0o077:
                _file.chmod(0o600)
DATABASES = {"default": _db}
# The web server's connections (applied by asgi.py when the process starts as the server): under
# ASGI a connection cannot persist across requests (asgi.py says why), so without a pool every
# request opened one, and PostgreSQL forked a backend for it and warmed its caches (measured on
# 2 cores: daphne's own CPU per task created 17 -> 14-15 ms, POSTs/s from 8 clients 36 -> 57-64,
# bench/compare.py's tasks in flight 26 -> 31 /s). psycopg's pool (Django's
# "pool" option) keeps them; with CONN_HEALTH_CHECKS (on) it checks a connection before handing
# it out, so one broken by a database restart is replaced, not used.
WEB_DATABASE = None
if _db["ENGINE"] == "django.db.backends.postgresql" and ORCH["ORCH_WEB_DB_POOL_SIZE"] > 0:
    WEB_DATABASE = {**_db, "CONN_MAX_AGE": 0, "OPTIONS": {**_db.get("OPTIONS", {}), "pool": {
        "min_size": min(2, ORCH["ORCH_WEB_DB_POOL_SIZE"]), "max_size": ORCH["ORCH_WEB_DB_POOL_SIZE"],
        "timeout": 5}}}
# How long a web request waits for SQLite's write lock before its 503 (database_busy.py).
SQLITE_REQUEST_BUSY_TIMEOUT_SECONDS = 3

# Rendered table rows (step and WAL rows, keyed by every value they show): live updates
# re-render a task page's regions several times a second, and most rows have not changed.
# Per process, like the rows' templates; the default cache stays as it was.
CACHES = {
    "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
    "rendered_rows": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache", "LOCATION": "rendered-rows",
                      "TIMEOUT": 600, "OPTIONS": {"MAX_ENTRIES": 20_000}},
}
IS_SQLITE = _db["ENGINE"] == "django.db.backends.sqlite3"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# --- Channels / Redis -----------------------------------------------------------------
# A socket's read of the channel layer waits up to channels_redis's BZPOPMIN timeout (5 s) for a
# message; redis-py 8 gives every read a 5 s socket timeout by default, so an idle page's
# consumer raised TimeoutError about every 5 s, its socket was closed and the page reconnected
# (channels_redis issue #422; seen as a page left "queued" under load). The read's own timeout
# is set above the pop's: a Redis that stops answering is still noticed, 5 s later.
CHANNEL_LAYER_SOCKET_TIMEOUT_SECONDS = 10


def redis_channel_layer(url: str) -> dict:
    return {"BACKEND": "channels_redis.core.RedisChannelLayer",
            "CONFIG": {"hosts": [{"address": url, "socket_timeout": CHANNEL_LAYER_SOCKET_TIMEOUT_SECONDS}],
                       "capacity": 1000}}


REDIS_URL = os.environ.get("REDIS_URL", "")
if REDIS_URL:
    CHANNEL_LAYERS = {"default": redis_channel_layer(REDIS_URL)}
else:
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}

# The webhook endpoint's rate limiter (django-ratelimit, ORCH_WEBHOOK_RATE) counts in a cache
# that every web process shares (a per-process LocMem cache would give each process its own
# limit): Redis when REDIS_URL is set (atomic INCR); else a table of the database (created by
# migration 0022), whose increments are read-then-write: under heavy concurrency a few
# requests past the limit may pass, none under it is refused.
if REDIS_URL:
    CACHES["ratelimit"] = {"BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": REDIS_URL,
                           "KEY_PREFIX": "orchestrator-ratelimit"}
else:
    CACHES["ratelimit"] = {"BACKEND": "django.core.cache.backends.db.DatabaseCache",
                           "LOCATION": "orchestrator_ratelimit_cache", "OPTIONS": {"MAX_ENTRIES": 100_000}}
RATELIMIT_USE_CACHE = "ratelimit"

# --- Workers (django-q2) --------------------------------------------------------------
# A task is driven in bounded slices (ORCH_SLICE_SECONDS, then it re-enqueues itself), so
# one django-q2 job never runs for hours. `retry` must exceed the job's run time plus its
# wait in the cluster's queue, or django-q2 delivers it again while it still runs
# (seen: an 8 s job with retry=3 started three times). Our own lease + sweeper guarantee
# recovery; django-q2 never retries.
Q_TIMEOUT = ORCH["ORCH_JOB_TIMEOUT_SECONDS"]
Q_CLUSTER = {
    "name": "orchestrator",
    "workers": ORCH["ORCH_WORKERS"],
    "timeout": Q_TIMEOUT,
    "retry": Q_TIMEOUT * 2,
    "max_attempts": 1,
    "ack_failures": True,
    "catch_up": False,
    "poll": 0.05,  # the ORM broker: how often an idle cluster looks for work (POST -> first step latency)
    # No row per successful job in django-q2's own table: the task's record is the truth, and
    # keeping the last 250 cost a locked read of all of them and a delete on every job (a third
    # of a cluster's CPU at 1,000 tasks in flight, bench/compare.py). Failed jobs are kept.
    "save_limit": -1,
    "label": "Worker jobs",
}
if REDIS_URL:
    Q_CLUSTER["redis"] = REDIS_URL
else:
    Q_CLUSTER["orm"] = "default"
    # Oldest message first (django-q2's own takes rows in no order): engine/brokers.py.
    Q_CLUSTER["broker_class"] = "orchestrator.engine.brokers.OrderedORM"

# --- Email ----------------------------------------------------------------------------
EMAIL_HOST = os.environ.get("EMAIL_HOST", "127.0.0.1")
EMAIL_PORT = int(os.environ.get("EMAIL_PORT", "1025"))
EMAIL_TIMEOUT = float(os.environ.get("EMAIL_TIMEOUT", "30"))
DEFAULT_FROM_EMAIL = os.environ.get("DEFAULT_FROM_EMAIL", "orchestrator@localhost")
# The sending account's mailbox over IMAP (optional): email.send files a copy of each message
# in its Sent folder, and the probe looks a message in doubt up there by Message-ID
# (orchestrator/tools/email.py). Empty EMAIL_IMAP_HOST: no copy, no probe.
EMAIL_IMAP_HOST = os.environ.get("EMAIL_IMAP_HOST", "")
EMAIL_IMAP_PORT = int(os.environ.get("EMAIL_IMAP_PORT", "993"))
EMAIL_IMAP_USE_SSL = env_bool("EMAIL_IMAP_USE_SSL", EMAIL_IMAP_PORT == 993)
EMAIL_IMAP_USER = os.environ.get("EMAIL_IMAP_USER", "")
EMAIL_IMAP_PASSWORD = os.environ.get("EMAIL_IMAP_PASSWORD", "")
EMAIL_IMAP_SENT_FOLDER = os.environ.get("EMAIL_IMAP_SENT_FOLDER", "Sent")

# --- The model (orchestrator/llm) ------------------------------------------------------
# Any OpenAI-compatible Chat Completions server. The defaults point at the stand-in model
# server (`manage.py standin_llm`, started by `make run`), which plans with rules: a
# stand-in for a real model, so that everything runs offline. docs/agent.md, "Models".
LLM_BASE_URL = os.environ.get("LLM_BASE_URL", "http://127.0.0.1:8011/v1")
LLM_API_KEY = os.environ.get("LLM_API_KEY", "standin")
LLM_MODEL = os.environ.get("LLM_MODEL", "standin-planner")
# The default context window (tokens) of a model that does not declare its own.
LLM_CONTEXT_WINDOW = int(os.environ.get("LLM_CONTEXT_WINDOW", "32768"))
# More model profiles, JSON: {"name": {"base_url": …, "api_key": …, "model": …, "context_window": …,
# "price_input_per_million": …, "price_output_per_million": …, "price_cached_per_million": …,
# "supports_tools": true, "supports_stream_options": true}}; the admin adds more (ModelProfile).
LLM_MODELS = os.environ.get("LLM_MODELS", "")
LLM_CONNECT_TIMEOUT = float(os.environ.get("LLM_CONNECT_TIMEOUT", "5"))
# The longest silence accepted while waiting for the next streamed chunk (not the whole call).
LLM_READ_TIMEOUT = float(os.environ.get("LLM_READ_TIMEOUT", "60"))
# Attempts per call when the server answers 429/5xx or cannot be reached (1 = no retry).
LLM_MAX_ATTEMPTS = int(os.environ.get("LLM_MAX_ATTEMPTS", "4"))
# The stand-in's pace: seconds per streamed token.
LLM_STANDIN_TOKEN_SECONDS = float(os.environ.get("LLM_STANDIN_TOKEN_SECONDS", "0.005"))

# --- Request limits -------------------------------------------------------------------
# The largest request body accepted (bytes); a bigger API request gets 413 with a JSON
# message saying the limit. Django's own limit for form and JSON bodies follows it.
DATA_UPLOAD_MAX_MEMORY_SIZE = ORCH["ORCH_MAX_REQUEST_BYTES"]

# --- Auth, i18n, static ---------------------------------------------------------------
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]
# Login throttling (django-axes): after ORCH_LOGIN_FAILURE_LIMIT wrong passwords for one
# username from one IP address, that username is refused from that address (even with the
# right password) for ORCH_LOGIN_COOLOFF_MINUTES. Applies to /accounts/login/ and the admin.
AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",  # first: it refuses locked-out attempts
    "django.contrib.auth.backends.ModelBackend",
]
AXES_FAILURE_LIMIT = ORCH["ORCH_LOGIN_FAILURE_LIMIT"]
AXES_COOLOFF_TIME = timedelta(minutes=ORCH["ORCH_LOGIN_COOLOFF_MINUTES"])
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_RESET_ON_SUCCESS = True
AXES_LOCKOUT_TEMPLATE = "registration/locked_out.html"
LOGIN_URL = "/accounts/login/"
LOGIN_REDIRECT_URL = "/"
LOGOUT_REDIRECT_URL = "/accounts/login/"
LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True
STATIC_URL = "/static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = VAR_DIR / "staticfiles"
STATIC_ROOT.mkdir(parents=True, exist_ok=True)
# Serve straight from the app and project static dirs: `make run` needs no collectstatic.
WHITENOISE_USE_FINDERS = True

# --- Content-Security-Policy (django-csp) ----------------------------------------------
# Pages load scripts, styles, images and fonts from this origin only; no inline script or
# style (templates and static/ have none), no plugins, no framing. connect-src 'self'
# covers the dashboard's websockets (ws:/wss: to the same host and port, CSP level 3).
CONTENT_SECURITY_POLICY = {
    "DIRECTIVES": {
        "default-src": ["'self'"],
        "script-src": ["'self'"],
        "style-src": ["'self'"],
        "img-src": ["'self'", "data:"],
        "font-src": ["'self'"],
        "connect-src": ["'self'"],
        "object-src": ["'none'"],
        "base-uri": ["'self'"],
        "form-action": ["'self'"],
        "frame-ancestors": ["'none'"],
    },
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        # One JSON object per line (python-json-logger); ORCH_LOG_FORMAT=text for key=value lines.
        "json": {"()": "orchestrator.logging.JsonFormatter"},
        "text": {"()": "orchestrator.logging.TextFormatter"},
    },
    "handlers": {"console": {"class": "logging.StreamHandler",
                             "formatter": "text" if ORCH["ORCH_LOG_FORMAT"] == "text" else "json"}},
    "loggers": {
        "orchestrator": {"handlers": ["console"], "level": ORCH["ORCH_LOG_LEVEL"]},
        "review": {"handlers": ["console"], "level": ORCH["ORCH_LOG_LEVEL"]},
        "django-q": {"handlers": ["console"], "level": "WARNING", "propagate": False},  # django-q2's logger
        # The MCP SDK's own warnings (a line a server sent that is not JSON-RPC...): through the
        # redacting formatter like ours, never straight to stderr.
        "mcp": {"handlers": ["console"], "level": "WARNING", "propagate": False},
    },
}

# --- The harness's own settings: read through orchestrator.conf ------------------------
# (The harness's own ORCH_* settings are loaded at the top, from orchestrator/conf.py.)
