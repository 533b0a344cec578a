"""The agent's tools: the schema the model sees is what validates its arguments, and a bad
call comes back as an error for the model, never a crash; db_query cannot write."""
from decimal import Decimal

import pytest

from orchestrator.agent import toolbox
from demo.models import DemoSource

pytestmark = pytest.mark.django_db(transaction=True)

ALL = [*toolbox.TOOLS, "contracts_list", "contracts_read"]  # the built-ins and the demo's


def test_each_tool_offers_its_argument_model_as_a_json_schema():
    schema = toolbox.find_tool("contracts_read").schema()  # the demo's, declared with orchestrator.sdk
    assert schema["type"] == "function" and schema["function"]["name"] == "contracts_read"
    assert schema["function"]["parameters"]["required"] == ["contract"]
    assert all(set(name) <= set("abcdefghijklmnopqrstuvwxyz_") for name in toolbox.TOOLS)  # the protocol's charset


@pytest.mark.parametrize("name, arguments, error", [
    ("contracts_read", "{not json", "error: the arguments are not valid JSON"),
    ("contracts_read", '{"contract": "five"}', "error: invalid arguments for contracts_read: contract:"),
    ("contracts_read", '{"contract": 99}', "error: there is no contract 99"),
    ("db_upsert", '{"table": "auth_user", "columns": ["id"], "rows": [[1]]}', "error: invalid arguments for db_upsert"),
    ("email_send", '{"to": [], "subject": "s", "body": "b"}', "error: invalid arguments for email_send: to:"),
    ("rm_rf", "{}", "error: there is no tool 'rm_rf'"),
])
def test_a_bad_call_is_an_error_the_model_can_read(name, arguments, error):
    ok, result = toolbox.call(None, name, arguments, ALL)
    assert not ok and result.startswith(error), result


def test_a_tool_not_offered_to_this_task_is_refused():
    ok, result = toolbox.call(None, "email_send", '{"to": ["a@example.org"], "subject": "s", "body": "b"}',
                              ["contracts_read"])
    assert not ok and result == "error: there is no tool 'email_send'; the tools are: contracts_read"


def test_db_query_reads_and_cannot_write_whatever_the_statement_hides():
    DemoSource.objects.create(id=1, amount=2.5)
    ok, result = toolbox.call(None, "db_query", '{"sql": "SELECT id, amount FROM demo_source"}', ALL)
    assert ok and result["columns"] == ["id", "amount"]
    [[row_id, amount]] = result["rows"]
    assert row_id == 1 and Decimal(str(amount)) == Decimal("2.5")  # a decimal comes back exact, as text
    ok, result = toolbox.call(None, "db_query", '{"sql": "DELETE FROM demo_source"}', ALL)
    assert not ok and result == "error: db_query only reads: the statement must start with SELECT or WITH"
    ok, result = toolbox.call(None, "db_query", '{"sql": "WITH gone AS (DELETE FROM demo_source RETURNING id) '
                                                'SELECT * FROM gone"}', ALL)
    assert not ok and result.startswith("error:")
    ok, result = toolbox.call(None, "db_query", '{"sql": "SELECT username, password FROM auth_user"}', ALL)
    assert not ok and result.startswith("error:") and "auth_user" in result
    assert DemoSource.objects.count() == 1


@pytest.mark.parametrize("name, arguments, waived, waits", [
    ("email_send", {"to": ["ops@example.org"]}, [], True),  # non-idempotent: a reviewer first
    ("email_send", {"to": ["ops@example.org"]}, ["email_send"], False),  # an admin waived it
    ("email_send", {"to": ["ops@example.org", "thief@evil.example"]}, ["email_send"], True),  # outside the allow-list
    ("http_request", {"method": "GET", "url": "https://example.org/"}, [], False),
    ("http_request", {"method": "POST", "url": "https://example.org/"}, [], True),
    ("http_request", {"method": "DELETE", "url": "https://example.org/"}, [], True),
    ("http_request", {"method": "POST", "url": "https://example.org/"}, ["http_request"], False),
    ("shell_run", {"argv": ["id"]}, [], True),
    ("memory_write", {"key": "k", "body": "b"}, [], False),  # idempotent, the harness's own table
    ("contracts_read", {"contract": 1}, [], False),
])
def test_which_calls_wait_for_a_reviewer(settings, name, arguments, waived, waits):
    settings.ORCH_AGENT_EMAIL_ALLOW = ["*@example.org"]
    assert bool(toolbox.needs_approval(name, arguments, require=[], waived=waived)) is waits
    assert toolbox.needs_approval(name, arguments, require=[name], waived=[name])  # require_approval wins


def test_the_email_allow_list_defaults_to_the_installations_own_domain(settings):
    settings.ORCH_AGENT_EMAIL_ALLOW, settings.DEFAULT_FROM_EMAIL = [], "orchestrator@corp.example"
    assert toolbox.email_allowed("Ops@Corp.Example") and not toolbox.email_allowed("ops@corp.example.evil.org")
    assert not toolbox.email_allowed("someone@elsewhere.org")


def test_the_safe_default_holds_no_side_effect_and_nothing_of_the_host(settings):
    # The built-in read, and the demo's reads (an extension's, declared granted_by_default).
    assert toolbox.SAFE_DEFAULT == ["memory_search"]
    assert toolbox.safe_default() == ["contracts_list", "contracts_read", "memory_search"]
    assert set(toolbox.HOST_TOOLS) == {"db_query", "db_upsert", "shell_run"}
    assert all(toolbox.find_tool(name).effect == toolbox.READ_ONLY and not toolbox.find_tool(name).reaches_host
               for name in toolbox.safe_default())
    settings.ORCH_DEMO = False  # without the demo, its tools are neither granted nor known
    assert toolbox.safe_default() == ["memory_search"] and toolbox.find_tool("contracts_read") is None
