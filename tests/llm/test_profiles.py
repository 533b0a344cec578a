"""Model profiles (orchestrator/llm/profiles.py): LLM_MODELS read and validated with pydantic
(a bad value is a system check error naming the profile and the field, never the key), the
order in which a name is resolved (LLM_MODELS, then the admin, then a model on the default
server), and the cost of a call at a profile's prices."""
import json
import re
from decimal import Decimal

import pytest
from django.core.management import call_command
from django.core.management.base import SystemCheckError

from orchestrator.checks import check_llm_models
from orchestrator.llm import Usage
from orchestrator.llm.profiles import (
    ModelsConfigError,
    ProfileUnavailable,
    cost_of,
    declared_secrets,
    parse_models_setting,
    problem_with,
    resolve,
)
from orchestrator.models import ModelProfile
from orchestrator.primitives.redaction import redact_text

KEY = "sk-fast-0123456789abcdef"
FAST = {"base_url": "http://gpu-1:8000/v1/", "api_key": KEY, "model": "Qwen/Qwen2.5-7B-Instruct",
        "context_window": 8192, "price_input_per_million": 0.5, "price_output_per_million": "1.5",
        "price_cached_per_million": 0.05, "supports_stream_options": False}


@pytest.fixture
def llm(settings):
    settings.LLM_BASE_URL, settings.LLM_API_KEY, settings.LLM_MODEL = ("http://default:8011/v1", "default-key-123",
                                                                        "standin-planner")
    settings.LLM_CONTEXT_WINDOW = 32768
    settings.LLM_MODELS = json.dumps({"fast": FAST})
    return settings


# --- LLM_MODELS -------------------------------------------------------------------------

def test_llm_models_is_read_with_its_types_and_defaults():
    profiles = parse_models_setting(json.dumps({"fast": FAST, "tiny": {"base_url": "https://x.example/v1",
                                                                       "model": "m"}}))
    fast, tiny = profiles["fast"], profiles["tiny"]
    assert fast.base_url == "http://gpu-1:8000/v1" and fast.price_output_per_million == Decimal("1.5")
    assert fast.api_key.get_secret_value() == KEY and KEY not in repr(fast)
    assert not fast.supports_stream_options and fast.supports_tools and not fast.send_reasoning_back
    assert tiny.api_key.get_secret_value() == "" and tiny.context_window is None
    assert parse_models_setting("") == {} and parse_models_setting("   ") == {}


@pytest.mark.parametrize("value, names", [
    ("{not json", ["not valid JSON"]),
    ('["fast"]', ["must be a JSON object"]),
    (json.dumps({"bad name!": FAST}), ["profile names", "'bad name!'"]),
    (json.dumps({"fast": {**FAST, "base_url": "gpu-1:8000"}}), ["profile 'fast', base_url", "http(s) URL"]),
    (json.dumps({"fast": {**FAST, "model": ""}}), ["profile 'fast', model"]),
    (json.dumps({"fast": {k: v for k, v in FAST.items() if k != "model"}}), ["profile 'fast', model", "required"]),
    (json.dumps({"fast": {**FAST, "price_input_per_million": -1}}), ["price_input_per_million", "greater than"]),
    (json.dumps({"fast": {**FAST, "context_window": 0}}), ["context_window"]),
    (json.dumps({"fast": {**FAST, "supports_tool": False}}), ["supports_tool", "Extra inputs"]),
    (json.dumps({"fast": {**FAST, "api_key": 12345678901}}), ["profile 'fast', api_key"]),
])
def test_a_bad_llm_models_is_refused_naming_the_profile_and_the_field_never_the_key(value, names):
    with pytest.raises(ModelsConfigError) as refused:
        parse_models_setting(value)
    message = str(refused.value)
    assert message.startswith("LLM_MODELS")
    for name in names:
        assert name in message
    assert KEY not in message and "12345678901" not in message


def test_a_bad_llm_models_stops_the_start_as_a_system_check(settings):
    settings.LLM_MODELS = json.dumps({"fast": {**FAST, "base_url": "ftp://gpu-1"}})
    [error] = check_llm_models(None)
    assert error.id == "orchestrator.E040" and "profile 'fast', base_url" in error.msg and KEY not in error.msg
    with pytest.raises(SystemCheckError, match="E040"):
        call_command("check")
    settings.LLM_MODELS = json.dumps({"fast": FAST})
    assert check_llm_models(None) == []


# --- resolution -------------------------------------------------------------------------

@pytest.mark.django_db
def test_empty_is_the_default_profile(llm):
    profile = resolve("")
    assert (profile.name, profile.source, profile.base_url, profile.model, profile.api_key, profile.context_window) == (
        "", "default", "http://default:8011/v1", "standin-planner", "default-key-123", 32768)
    assert profile.cost(Usage(1000, 1000, 2000)) is None  # the default has no prices


@pytest.mark.django_db
def test_a_name_that_is_no_profile_is_a_model_on_the_default_server(llm):
    profile = resolve("standin-planner+ollama")
    assert (profile.source, profile.base_url, profile.model, profile.api_key) == (
        "default", "http://default:8011/v1", "standin-planner+ollama", "default-key-123")


@pytest.mark.django_db
def test_llm_models_wins_over_an_admin_profile_of_the_same_name_then_the_admin_s_are_used(llm):
    ModelProfile.objects.create(name="fast", base_url="http://elsewhere:9/v1", model="other", api_key="admin-key-123")
    ModelProfile.objects.create(name="cheap", base_url="http://cpu-2:8080/v1/", model="llama", api_key="cheap-key-123",
                                price_input_per_million=Decimal("0.1"), price_output_per_million=Decimal("0.2"),
                                send_reasoning_back=True)
    fast = resolve("fast")
    assert (fast.source, fast.base_url, fast.model, fast.api_key, fast.context_window) == (
        "LLM_MODELS", "http://gpu-1:8000/v1", "Qwen/Qwen2.5-7B-Instruct", KEY, 8192)
    assert not fast.supports_stream_options and not fast.client().include_usage
    cheap = resolve("cheap")
    assert (cheap.source, cheap.base_url, cheap.model, cheap.api_key, cheap.context_window) == (
        "admin", "http://cpu-2:8080/v1", "llama", "cheap-key-123", 32768)  # no window: LLM_CONTEXT_WINDOW
    assert cheap.send_reasoning_back and cheap.client().include_usage
    assert KEY not in repr(fast) and KEY not in fast.describe()


@pytest.mark.django_db
def test_a_disabled_admin_profile_is_refused_not_sent_to_the_default_server(llm):
    ModelProfile.objects.create(name="old", base_url="http://old:1/v1", model="m", enabled=False)
    with pytest.raises(ProfileUnavailable, match="'old' is disabled"):
        resolve("old")
    assert "disabled" in problem_with("old")
    assert problem_with("fast") == "" and problem_with("anything-else") == "" and problem_with("") == ""


@pytest.mark.django_db
def test_a_task_cannot_be_created_with_a_disabled_profile(llm):
    from orchestrator.engine import services
    from orchestrator.engine.services import InvalidInput

    ModelProfile.objects.create(name="old", base_url="http://old:1/v1", model="m", enabled=False)
    with pytest.raises(InvalidInput) as refused:
        services.task_create(type="agent.plan_execute", params={"goal": "hello", "model": "old"})
    assert [(e.field, "disabled" in e.message) for e in refused.value.errors] == [("params.model", True)]
    assert services.task_create(type="agent.plan_execute", params={"goal": "hello", "model": "fast"}).pk


def test_every_llm_models_key_is_fed_to_the_redaction(llm):
    assert declared_secrets() == {"LLM_MODELS key of fast": KEY}
    assert KEY not in redact_text(f"Authorization: Bearer {KEY}")


@pytest.mark.django_db
def test_an_admin_profile_key_is_redacted_as_soon_as_it_is_saved(llm):
    key = "sk-admin-9876543210fedcba"
    ModelProfile.objects.create(name="cheap", base_url="http://cpu-2:8080/v1", model="llama", api_key=key)
    assert key not in redact_text(f"the key is {key}")


# --- prices -----------------------------------------------------------------------------

@pytest.mark.django_db
def test_a_call_costs_its_tokens_at_the_profile_s_prices_cached_tokens_at_the_cached_price(llm):
    fast = resolve("fast")
    # 10k prompt tokens of which 4k cached, 2k completion: 6k x 0.5 + 4k x 0.05 + 2k x 1.5, per million.
    assert fast.cost(Usage(10_000, 2_000, 12_000, cached_tokens=4_000)) == Decimal("0.006200")
    assert cost_of(fast, 1_000_000, 0) == Decimal("0.500000")
    # No cached price: cached tokens cost the input price.
    ModelProfile.objects.create(name="cheap", base_url="http://cpu-2:8080/v1", model="llama",
                                price_input_per_million=Decimal("1"), price_output_per_million=Decimal("2"))
    assert resolve("cheap").cost(Usage(1000, 500, 1500, cached_tokens=900)) == Decimal("0.002000")
    # Only one of the two prices: no cost rather than a wrong one.
    ModelProfile.objects.create(name="half", base_url="http://cpu-3:8080/v1", model="llama",
                                price_input_per_million=Decimal("1"))
    assert resolve("half").cost(Usage(1000, 500, 1500)) is None


@pytest.mark.django_db
def test_the_new_task_form_and_the_api_offer_the_profiles_a_task_can_pick(llm, make_user):
    from django.test import Client

    from tests.support.helpers import bearer

    ModelProfile.objects.create(name="cheap", base_url="http://cpu-2:8080/v1", model="llama")
    ModelProfile.objects.create(name="old", base_url="http://old:1/v1", model="m", enabled=False)  # not offered
    operator = make_user("olga", "operator")
    client = Client()
    client.force_login(operator)
    html = client.get("/tasks/new/?type=agent.plan_execute").content.decode()
    offered = re.search(r'<datalist id="id_params\.model_suggestions"[^>]*>(.*?)</datalist>', html, re.S)
    assert offered and re.findall(r'<option value="([^"]*)">', offered.group(1)) == ["fast", "cheap"]
    assert 'list="id_params.model_suggestions"' in html
    types = {t["name"]: t for t in client.get("/api/task-types", **bearer(operator)).json()}
    assert types["agent.plan_execute"]["params_schema"]["properties"]["model"]["examples"] == ["fast", "cheap"]
    # Offered, not imposed: a model's name on the default server is still taken.
    response = client.post("/tasks/new/", {"type": "agent.plan_execute", "params.goal": "hello",
                                           "params.model": "some-other-model"})
    assert response.status_code == 302, response.content.decode()[-2000:]
