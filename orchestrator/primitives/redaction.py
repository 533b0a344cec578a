"""Redaction: the installation's secrets never reach the model, a page, the API, a log or the
export. `redact(value)` returns `value` with every occurrence of a known secret (and of its
common encodings) replaced by a visible marker, `[redacted: SECRET_KEY]`.

    from orchestrator.primitives.redaction import redact, redact_text
    redact({"stdout": "key=...", "rows": [...]})   # str/dict/list/tuple, walked recursively
    redact_text("...")                              # one string

Importing this module touches neither the database nor the settings; the secrets are
collected on first use, from providers:
- settings (`settings_secrets`): every Django setting whose name contains SECRET, KEY, TOKEN or
  PASSWORD and whose value is a string (SECRET_KEY_FALLBACKS: each string of the list), the
  databases' PASSWORD, EMAIL_HOST_PASSWORD, the password of any URL setting
  (`scheme://user:password@host`), and the admin password saved in
  `<VAR_DIR>/admin-credentials.txt` by `make run`;
- the environment (`environment_secrets`): variables whose name contains those words
  (LLM_API_KEY, ADMIN_PASSWORD, GITHUB_TOKEN...) and the password of any URL in a variable
  (DATABASE_URL, REDIS_URL...);
- others registered with `register_provider(name, function, ttl)`: the database's webhook
  secrets and API token hashes are added by orchestrator/redaction_sources.py at app start
  (this package sits below the models and may not read them itself).

What is not a secret, whatever its name (BENIGN_VALUE): values shorter than MIN_SECRET_LENGTH
(8) characters — replacing a short value would mangle ordinary text (LLM_API_KEY's default
`standin` is in every stand-in model name) —, numbers, booleans and null-like words, Python
dotted paths (PASSWORD_HASHERS, AUTH_PASSWORD_VALIDATORS), and the names of settings that
hold no secret (NOT_SECRET_SETTINGS: CSRF_COOKIE_NAME-like names do not match the words at
all; AXES_PASSWORD_FORM_FIELD="password" does and is listed).

Encodings caught (ENCODINGS): the value as is, URL-encoded (`quote` and `quote_plus`),
HTML-escaped, and base64 (standard and URL-safe) at any of the three byte alignments, so a
secret inside a longer base64 blob (`Authorization: Basic base64(user:password)`) is found
too; the marker then says which encoding, `[redacted: SECRET_KEY, base64]`. Hex and other
encodings are not caught.

Fast: one compiled expression of every form (escaped, factored into a trie so the longest
match wins and each position is tried once), rebuilt only when the set of secrets changes; each provider's values are cached (settings and environment until a
setting changes or `refresh()` is called; database providers for their TTL).
"""
from __future__ import annotations

import base64
import html
import math
import os
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import quote, quote_plus, unquote, urlsplit

MIN_SECRET_LENGTH = 8
SECRET_NAME = re.compile(r"SECRET|KEY|TOKEN|PASSWORD|PASSWD", re.IGNORECASE)
# Settings whose names match but that hold no secret (their values are field names, hasher
# paths, prefixes, numbers): listed so a value such as "password" is never treated as one.
NOT_SECRET_SETTINGS = frozenset({
    "PASSWORD_HASHERS", "AUTH_PASSWORD_VALIDATORS", "PASSWORD_RESET_TIMEOUT", "CACHE_MIDDLEWARE_KEY_PREFIX",
    "AXES_PASSWORD_FORM_FIELD", "AXES_USERNAME_FORM_FIELD", "ORCH_DEFAULT_MAX_TOKENS", "LLM_STANDIN_TOKEN_SECONDS",
    "DEFAULT_AUTO_FIELD", "CSRF_HEADER_NAME", "CSRF_COOKIE_NAME", "SESSION_COOKIE_NAME",
})
BENIGN_WORDS = frozenset({"true", "false", "none", "null", "yes", "no", "on", "off", "password", "secret",
                          "changeme", "standin", "undefined"})
DOTTED_PATH = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+")
NUMBER = re.compile(r"[+-]?\d+(\.\d+)?")
ADMIN_CREDENTIALS_FILE = "admin-credentials.txt"
ENCODINGS = ("url", "html", "base64")


def marker(label: str, encoding: str = "") -> str:
    return f"[redacted: {label}, {encoding}]" if encoding else f"[redacted: {label}]"


def is_benign(value) -> bool:
    """True when `value` cannot be treated as a secret (see the module's docstring)."""
    if not isinstance(value, str):
        return True
    text = value.strip()
    return (len(text) < MIN_SECRET_LENGTH or text.lower() in BENIGN_WORDS or bool(NUMBER.fullmatch(text))
            or bool(DOTTED_PATH.fullmatch(text)))


def url_password(value) -> str:
    """The password of `scheme://user:password@host/...`, or ""."""
    if not isinstance(value, str) or "://" not in value or "@" not in value:
        return ""
    try:
        password = urlsplit(value.strip()).password
    except ValueError:
        return ""
    return unquote(password) if password else ""


# --- providers -------------------------------------------------------------------------------

def settings_secrets() -> dict[str, str]:
    """{label: value} from Django's settings (see the module's docstring)."""
    from django.conf import settings

    found: dict[str, str] = {}

    def add(label: str, value) -> None:
        if isinstance(value, str) and not is_benign(value):
            found.setdefault(label, value)

    def add_url_password(label: str, value) -> None:
        password = url_password(value)
        if password and not is_benign(password):
            found.setdefault(f"{label} password", password)

    if not settings.configured:
        return found
    for name in dir(settings):
        if not name.isupper() or name in NOT_SECRET_SETTINGS:
            continue
        value = getattr(settings, name, None)
        if isinstance(value, str):
            if SECRET_NAME.search(name):
                add(name, value)
            add_url_password(name, value)
        elif isinstance(value, (list, tuple)) and "SECRET" in name.upper():
            for index, item in enumerate(value):
                add(f"{name}[{index}]", item)
    for alias, database in (getattr(settings, "DATABASES", None) or {}).items():
        if isinstance(database, dict):
            add(f"DATABASES[{alias}].PASSWORD", database.get("PASSWORD"))
    for alias, cache in (getattr(settings, "CACHES", None) or {}).items():
        if isinstance(cache, dict):
            location = cache.get("LOCATION")
            for item in location if isinstance(location, (list, tuple)) else [location]:
                add_url_password(f"CACHES[{alias}]", item)
    var_dir = getattr(settings, "VAR_DIR", None) or os.environ.get("ORCH_VAR_DIR")
    if var_dir:
        password = admin_password(Path(var_dir) / ADMIN_CREDENTIALS_FILE)
        if password and not is_benign(password):
            found.setdefault("admin password", password)
    return found


def admin_password(path: Path) -> str:
    """The password line of the file `make run` writes for the first admin, or ""."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip().lower() == "password":
            return value.strip()
    return ""


def environment_secrets() -> dict[str, str]:
    """{label: value} from the process's environment (see the module's docstring)."""
    found: dict[str, str] = {}
    for name, value in os.environ.items():
        if SECRET_NAME.search(name) and not is_benign(value):
            found.setdefault(name, value)
        password = url_password(value)
        if password and not is_benign(password):
            found.setdefault(f"{name} password", password)
    return found


# --- the registry ------------------------------------------------------------------------------

class _Provider:
    def __init__(self, name: str, collect: Callable[[], dict[str, str]], ttl: float | None):
        self.name, self.collect, self.ttl = name, collect, ttl
        self.values: dict[str, str] = {}
        self.expires = 0.0  # monotonic time; 0: collect at the next use
        self.loaded = False

    def current(self, now: float) -> dict[str, str]:
        if not self.loaded or (self.ttl is not None and now >= self.expires):
            self.expires = now + (self.ttl or 0)
            try:
                self.values = dict(self.collect() or {})
                self.loaded = True
            except Exception:  # a database that is not there (yet): keep the last values, retry after the TTL
                self.loaded = self.loaded or self.ttl is not None
        return self.values


class Redactor:
    """The secrets of the installation and the one regular expression that finds them."""

    def __init__(self):
        self._lock = threading.RLock()
        self._providers: dict[str, _Provider] = {}
        self._pattern: re.Pattern | None = None
        self._labels: dict[str, str] = {}
        self._fingerprint: frozenset | None = None
        self._local = threading.local()  # collecting may log or query: no redaction inside it

    def register_provider(self, name: str, collect: Callable[[], dict[str, str]], ttl: float | None = None) -> None:
        """Add (or replace) a source of secrets: `collect()` returns {label: value}. With a
        `ttl` (seconds) it is called again after that long; without, until refresh()."""
        with self._lock:
            self._providers[name] = _Provider(name, collect, ttl)

    def refresh(self) -> None:
        """Collect every provider again at the next use (a setting, a variable or a webhook
        secret changed)."""
        with self._lock:
            for provider in self._providers.values():
                provider.loaded, provider.expires = False, 0.0

    def secrets(self) -> dict[str, str]:
        """{value: label} of every secret known now (the first label of a value wins)."""
        now = time.monotonic()
        values: dict[str, str] = {}
        for provider in list(self._providers.values()):
            for label, value in provider.current(now).items():
                if isinstance(value, str) and not is_benign(value):
                    values.setdefault(value, label)
        return values

    def pattern(self) -> tuple[re.Pattern | None, dict[str, str]]:
        if getattr(self._local, "collecting", False):
            return self._pattern, self._labels
        with self._lock:
            self._local.collecting = True
            try:
                secrets = self.secrets()
            finally:
                self._local.collecting = False
            fingerprint = frozenset(secrets.items())
            if fingerprint != self._fingerprint:
                self._labels = encoded_forms(secrets)
                self._pattern = re.compile(trie_pattern(self._labels)) if self._labels else None
                self._fingerprint = fingerprint
            return self._pattern, self._labels

    def redact_text(self, text: str) -> str:
        pattern, labels = self.pattern()
        if pattern is None or not text:
            return text
        return pattern.sub(lambda match: labels[match.group(0)], text)

    def redact(self, value):
        pattern, labels = self.pattern()
        if pattern is None:
            return value
        return _walk(value, lambda text: pattern.sub(lambda match: labels[match.group(0)], text))


def _walk(value, replace):
    if isinstance(value, str):
        return replace(value) if value else value
    if isinstance(value, dict):
        return {(replace(k) if isinstance(k, str) else k): _walk(v, replace) for k, v in value.items()}
    if isinstance(value, list):
        return [_walk(item, replace) for item in value]
    if isinstance(value, tuple):
        return tuple(_walk(item, replace) for item in value)
    return value


def trie_pattern(words) -> str:
    """One regular expression matching any of `words`, the longest where several start at
    the same place: the alternation factored by common prefixes (a trie), because Python's
    engine tries every branch of a flat alternation at every position (2.4x slower with 20 secrets)."""
    trie: dict = {}
    for word in words:
        node = trie
        for char in word:
            node = node.setdefault(char, {})
        node[""] = {}

    def build(node: dict) -> str:
        branches = [re.escape(char) + build(child) for char, child in sorted(node.items()) if char]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        if "" in node:  # a word ends here; longer ones go on: greedy, so the longest wins
            return "(?:" + body + ")?"
        return body

    return build(trie)


def base64_fragments(secret: bytes) -> set[str]:
    """What base64 of any text containing `secret` contains, whatever its offset: for each of
    the three alignments, the characters made only of the secret's bits."""
    fragments = set()
    for pad in range(3):
        encoded = base64.b64encode(b"\0" * pad + secret).decode().rstrip("=")
        start, end = math.ceil(8 * pad / 6), (8 * (pad + len(secret))) // 6
        fragment = encoded[start:end]
        if len(fragment) >= MIN_SECRET_LENGTH:
            fragments.add(fragment)
            fragments.add(fragment.replace("+", "-").replace("/", "_"))
    return fragments


def encoded_forms(secrets: dict[str, str]) -> dict[str, str]:
    """{text to find: its marker} for every secret and its encodings (ENCODINGS)."""
    forms: dict[str, str] = {}
    for value, label in secrets.items():
        forms.setdefault(value, marker(label))
    for value, label in secrets.items():
        for encoded in {quote(value, safe=""), quote_plus(value), quote(value)}:
            if encoded != value:
                forms.setdefault(encoded, marker(label, "url-encoded"))
        escaped = html.escape(value)
        if escaped != value:
            forms.setdefault(escaped, marker(label, "html-escaped"))
        for fragment in base64_fragments(value.encode()):
            forms.setdefault(fragment, marker(label, "base64"))
    return forms


REDACTOR = Redactor()
REDACTOR.register_provider("settings", settings_secrets)
REDACTOR.register_provider("environment", environment_secrets)


def redact(value):
    """`value` (str, dict, list, tuple; walked recursively, dict keys too) with every secret
    replaced by its marker; other types are returned as they are. Never touches its argument."""
    return REDACTOR.redact(value)


def redact_text(text: str) -> str:
    return REDACTOR.redact_text(text)


def register_provider(name: str, collect: Callable[[], dict[str, str]], ttl: float | None = None) -> None:
    REDACTOR.register_provider(name, collect, ttl)


def refresh() -> None:
    REDACTOR.refresh()


def _on_setting_changed(**kwargs) -> None:
    REDACTOR.refresh()


try:  # tests change settings (override_settings): collect again
    from django.core.signals import setting_changed

    setting_changed.connect(_on_setting_changed, dispatch_uid="orchestrator.redaction.refresh")
except ImportError:  # pragma: no cover - older Django keeps it in django.test.signals
    pass
