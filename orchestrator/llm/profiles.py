"""Model profiles: which server, key and model a call goes to, what the model's window is and
what its tokens cost. An agent task picks one by name with its `model` parameter.

Where profiles come from, in this order (the first that has the name wins):
1. `LLM_MODELS`, JSON from the environment: {"name": {"base_url": ..., "api_key": ...,
   "model": ..., "context_window": ..., "price_input_per_million": ...,
   "price_output_per_million": ..., "price_cached_per_million": ..., "supports_tools": true,
   "supports_stream_options": true, "send_reasoning_back": false, "background_responses": false}}.
   Validated with pydantic;
   a bad value is a system check error (orchestrator.E040) and the same message at run time.
2. The admin's ModelProfile rows (enabled ones; a disabled one is refused, not skipped).
   The environment wins because it is the deployment's declared configuration: an admin
   cannot silently redirect a profile the deployment declared (the admin refuses the name).
3. Otherwise the name is a model on the default server (LLM_BASE_URL / LLM_API_KEY), as
   `model` always meant; empty is LLM_MODEL itself. LLM_CONTEXT_WINDOW is the window of any
   profile that declares none.

A profile's key is a secret: it goes only into the Authorization header of its own server's
requests. `Profile` keeps it out of its repr, error messages never quote it, and every key
(LLM_MODELS' and the admin's) is fed to the redaction of logs, pages and exports
(orchestrator/redaction_sources.py).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from decimal import Decimal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, TypeAdapter, ValidationError, field_validator

from .client import LLMClient, RetryPolicy, Usage
from ..primitives.errors import HarnessError

NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,59}$")  # ModelProfile.name holds 60
PER_MILLION = Decimal(1_000_000)
COST_PLACES = Decimal("0.000001")

SOURCE_DEFAULT = "default"        # LLM_BASE_URL / LLM_API_KEY / LLM_MODEL
SOURCE_SETTINGS = "LLM_MODELS"
SOURCE_ADMIN = "admin"


class ModelsConfigError(HarnessError, ValueError):
    """LLM_MODELS cannot be read; the message names the profile and the field."""


class ProfileUnavailable(HarnessError, ValueError):
    """A task asked for a profile that exists but may not be used (disabled in the admin)."""


def validate_base_url(value: str) -> str:
    parts = urlsplit(value or "")
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError("must be an http(s) URL such as http://gpu-1:8000/v1")
    return value.rstrip("/")


class ProfileConfig(BaseModel):
    """One profile of LLM_MODELS, as the JSON declares it."""
    model_config = ConfigDict(extra="forbid")

    base_url: str
    api_key: SecretStr = SecretStr("")
    model: str = Field(min_length=1, max_length=200)
    context_window: int | None = Field(None, gt=0)
    price_input_per_million: Decimal | None = Field(None, ge=0)
    price_output_per_million: Decimal | None = Field(None, ge=0)
    price_cached_per_million: Decimal | None = Field(None, ge=0)
    supports_tools: bool = True
    supports_stream_options: bool = True
    send_reasoning_back: bool = False
    background_responses: bool = False

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        return validate_base_url(value)


_PROFILES = TypeAdapter(dict[str, ProfileConfig])


def parse_models_setting(text: str) -> dict[str, ProfileConfig]:
    """LLM_MODELS' profiles by name; ModelsConfigError naming what is wrong (never a key's value)."""
    if not (text or "").strip():
        return {}
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ModelsConfigError(f"LLM_MODELS is not valid JSON ({exc.msg} at character {exc.pos})") from None
    if not isinstance(data, dict):
        raise ModelsConfigError('LLM_MODELS must be a JSON object of profiles: {"name": {"base_url": "http://…/v1", '
                                '"model": "…", "api_key": "…"}}')
    bad_names = [name for name in data if not NAME_PATTERN.match(name)]
    if bad_names:
        raise ModelsConfigError(f"LLM_MODELS: profile names must be letters, digits, '.', '_' or '-' (at most 60): "
                                f"{', '.join(repr(n) for n in bad_names)}")
    try:
        return _PROFILES.validate_python(data)
    except ValidationError as exc:
        # Only where and what: pydantic's own text would quote the input, which may be a key.
        problems = []
        for error in exc.errors():
            name, *where = error["loc"]
            field_name = ".".join(str(part) for part in where) or "(the profile)"
            problems.append(f"profile {name!r}, {field_name}: {error['msg']}")
        raise ModelsConfigError("LLM_MODELS: " + "; ".join(problems)) from None


@dataclass(frozen=True)
class Profile:
    """A resolved profile: everything a call needs. `name` is what the task asked for ("" for
    the default); `source` says where it came from."""
    name: str
    source: str
    base_url: str
    model: str
    context_window: int
    api_key: str = field(default="", repr=False)
    price_input_per_million: Decimal | None = None
    price_output_per_million: Decimal | None = None
    price_cached_per_million: Decimal | None = None
    supports_tools: bool = True
    supports_stream_options: bool = True
    send_reasoning_back: bool = False
    # The server keeps background responses (the Responses API's `background` mode, as
    # OpenAI's does): a turn is asked that way, and a process killed mid-stream is replaced
    # by one that retrieves the finished response instead of paying for the turn again.
    background_responses: bool = False

    def cost(self, usage: Usage) -> Decimal | None:
        """What a call's tokens cost at this profile's prices (None when it has none): cached
        prompt tokens at the cached price (the input price if it has none)."""
        return cost_of(self, usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens)

    def client(self) -> LLMClient:
        """The process's client for this profile's server, with the installation's timeouts and
        retries (shared and kept: not to be closed by the caller)."""
        from django.conf import settings

        return LLMClient.shared(base_url=self.base_url, api_key=self.api_key, model=self.model,
                         connect_timeout=settings.LLM_CONNECT_TIMEOUT, read_timeout=settings.LLM_READ_TIMEOUT,
                         retry=RetryPolicy(max_attempts=max(1, settings.LLM_MAX_ATTEMPTS)),
                         include_usage=self.supports_stream_options)

    def describe(self) -> str:
        """For people (pages, errors): never the key."""
        return f"{self.name or 'the default'} ({self.source}: {self.model} at {self.base_url})"


def cost_of(profile: Profile, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Decimal | None:
    if profile.price_input_per_million is None or profile.price_output_per_million is None:
        return None
    cached = min(max(cached_tokens, 0), prompt_tokens)
    cached_price = (profile.price_cached_per_million if profile.price_cached_per_million is not None
                    else profile.price_input_per_million)
    total = ((prompt_tokens - cached) * profile.price_input_per_million + cached * cached_price
             + completion_tokens * profile.price_output_per_million) / PER_MILLION
    return total.quantize(COST_PLACES)


def declared() -> dict[str, ProfileConfig]:
    """LLM_MODELS' profiles (ModelsConfigError when it cannot be read)."""
    from django.conf import settings

    return parse_models_setting(settings.LLM_MODELS)


def default_profile(model: str = "") -> Profile:
    from django.conf import settings

    return Profile(name="", source=SOURCE_DEFAULT, base_url=settings.LLM_BASE_URL.rstrip("/"),
                   model=model or settings.LLM_MODEL, context_window=settings.LLM_CONTEXT_WINDOW,
                   api_key=settings.LLM_API_KEY)


def resolve(name: str | None) -> Profile:
    """The profile a task's `model` names (see the module doc for the order). Raises
    ModelsConfigError (LLM_MODELS unreadable) or ProfileUnavailable (disabled in the admin)."""
    from django.conf import settings

    from ..models import ModelProfile

    name = (name or "").strip()
    if not name:
        return default_profile()
    config = declared().get(name)
    if config is not None:
        return Profile(name=name, source=SOURCE_SETTINGS, base_url=config.base_url, model=config.model,
                       context_window=config.context_window or settings.LLM_CONTEXT_WINDOW,
                       api_key=config.api_key.get_secret_value(),
                       price_input_per_million=config.price_input_per_million,
                       price_output_per_million=config.price_output_per_million,
                       price_cached_per_million=config.price_cached_per_million,
                       supports_tools=config.supports_tools, supports_stream_options=config.supports_stream_options,
                       send_reasoning_back=config.send_reasoning_back,
                       background_responses=config.background_responses)
    row = ModelProfile.objects.filter(name=name).first()
    if row is not None:
        if not row.enabled:
            raise ProfileUnavailable(f"the model profile {name!r} is disabled in the admin; enable it, or pick "
                                     f"another with `model`")
        return Profile(name=name, source=SOURCE_ADMIN, base_url=row.base_url.rstrip("/"), model=row.model,
                       context_window=row.context_window or settings.LLM_CONTEXT_WINDOW, api_key=row.api_key,
                       price_input_per_million=row.price_input_per_million,
                       price_output_per_million=row.price_output_per_million,
                       price_cached_per_million=row.price_cached_per_million,
                       supports_tools=row.supports_tools, supports_stream_options=row.supports_stream_options,
                       send_reasoning_back=row.send_reasoning_back,
                       background_responses=row.background_responses)
    return default_profile(model=name)  # a model name on the default server


def problem_with(name: str | None) -> str:
    """Why a task may not pick `name` now ("" when it may): for the create/edit form."""
    try:
        resolve(name)
    except (ModelsConfigError, ProfileUnavailable) as exc:
        return str(exc)
    return ""


def known_names() -> list[str]:
    """The profiles a task can pick (LLM_MODELS' and the admin's enabled ones), for help texts."""
    from ..models import ModelProfile

    try:
        names = list(declared())
    except ModelsConfigError:
        names = []
    return names + [n for n in ModelProfile.objects.filter(enabled=True).values_list("name", flat=True)
                    if n not in names]


def declared_secrets() -> dict[str, str]:
    """{label: key} of LLM_MODELS' keys, for the redaction of logs, pages and exports (the
    admin's keys are read with the database's other secrets: orchestrator/redaction_sources.py)."""
    try:
        profiles = declared()
    except ModelsConfigError:
        return {}  # the system check reports it; nothing can be called with it
    return {f"LLM_MODELS key of {name}": config.api_key.get_secret_value()
            for name, config in profiles.items() if config.api_key.get_secret_value()}
