"""Secrets never reach a page, the API, the export or a log (issue 19, item 7): the
installation's secrets — a setting named *SECRET*/*KEY*/*TOKEN*/*PASSWORD*, such a variable
in the environment, the database's password, a webhook source's secret — written into a step
result, a WAL entry's arguments, an agent's dialog, an event or a log line come out as
`[redacted: NAME]`, for every role. Each test fails without the redaction: it checks the raw
value is absent where it was planted."""
import base64
import io
import json
import logging
from urllib.parse import quote

import pytest
from django.conf import settings as django_settings
from django.test import Client

from orchestrator import logging as orch_logging
from orchestrator.engine import services, webhooks
from orchestrator.engine.events import append_event
from orchestrator.models import AgentMessage, Step, WalEntry, WebhookSource
from orchestrator.presenters import fragments
from orchestrator.primitives import redaction
from orchestrator.primitives.redaction import redact, redact_text
from tests.support.helpers import bearer

SECRET_KEY = "sk-test-Redaction-0123456789abcdefXYZ"
LLM_KEY = "llm-test-Key-9f8e7d6c5b4a"
DB_PASSWORD = "db-Pass/word+42!"
URL_PASSWORD = "url-Pass-31415926"


@pytest.fixture
def installation_secrets(settings, monkeypatch):
    """The secrets a real installation has, in each of the places they come from."""
    settings.SECRET_KEY = SECRET_KEY
    monkeypatch.setenv("LLM_API_KEY", LLM_KEY)
    monkeypatch.setenv("DATABASE_URL", f"postgres://orch:{URL_PASSWORD}@db.internal:5432/orch")
    # A copy: the open connections keep their own settings, a new one is not affected.
    databases = {alias: dict(db) for alias, db in django_settings.DATABASES.items()}
    databases["default"]["PASSWORD"] = DB_PASSWORD
    monkeypatch.setattr(django_settings, "DATABASES", databases)
    redaction.refresh()
    yield
    redaction.refresh()


@pytest.fixture
def webhook_secret(db, installation_secrets):
    secret = webhooks.new_secret()
    WebhookSource.objects.create(name="upstream", secrets=[secret])  # saving refreshes the secrets
    return secret


def planted(webhook_secret: str) -> dict:
    """A tool result that read every secret (what a prompt-injected model would try)."""
    return {"stdout": f"SECRET_KEY={SECRET_KEY}\nLLM_API_KEY={LLM_KEY}\n",
            "rows": [["db", DB_PASSWORD], ["hook", webhook_secret]],
            "url": f"postgres://orch:{URL_PASSWORD}@db.internal/orch"}


def raw_values(webhook_secret: str) -> list[str]:
    return [SECRET_KEY, LLM_KEY, DB_PASSWORD, URL_PASSWORD, webhook_secret, webhook_secret.removeprefix("whsec_")]


def assert_clean(text: str, webhook_secret: str, *, markers=("SECRET_KEY", "LLM_API_KEY")) -> None:
    for value in raw_values(webhook_secret):
        assert value not in text, f"a secret reached the output: {value!r}"
    for name in markers:
        assert f"[redacted: {name}" in text, f"no marker for {name}"


@pytest.fixture
def agent_task(db, webhook_secret):
    """A task whose step result, WAL entry, dialog and events carry the secrets."""
    task = services.task_create(type="demo.pipeline", params={}, title=f"use {LLM_KEY}")
    step = Step.objects.create(task=task, step_id="tool-1-0", position=0, status="done", attempts=1,
                               result=planted(webhook_secret), result_bytes=300,
                               error=f"connect failed: postgres://orch:{URL_PASSWORD}@db.internal/orch")
    WalEntry.objects.create(task=task, step_id=step.step_id, call_index=0, tool="http_request",
                            args={"url": "https://example.org/hook", "headers": {"Authorization": f"Bearer {LLM_KEY}"},
                                  "body": {"key": SECRET_KEY, "hook": webhook_secret}},
                            result=planted(webhook_secret), idempotency_key=f"task-{task.pk}-redaction",
                            idempotent=False, lease_epoch=1)
    AgentMessage.objects.create(task=task, key="turn-1-tool-1", turn=1, order=1, role="tool", name="shell_run",
                                content=json.dumps(planted(webhook_secret)))
    AgentMessage.objects.create(task=task, key="turn-1", turn=1, order=0, role="assistant",
                                content=f"I found the key {SECRET_KEY}",
                                tool_calls=[{"id": "c1", "name": "http_request", "step": "",
                                             "arguments": json.dumps({"token": LLM_KEY})}])
    append_event(task, "progress", {"message": f"read {SECRET_KEY} and {DB_PASSWORD}"})
    return task


# --- the primitive ---------------------------------------------------------------------------

def test_redact_replaces_every_secret_with_its_marker_and_leaves_the_input_alone(webhook_secret):
    value = planted(webhook_secret)
    before = json.dumps(value)
    out = redact(value)
    assert json.dumps(value) == before  # never touches its argument
    text = json.dumps(out)
    assert_clean(text, webhook_secret)
    assert "[redacted: DATABASES[default].PASSWORD]" in text
    assert "[redacted: DATABASE_URL password]" in text
    assert "[redacted: webhook secret of upstream]" in text
    assert redact(("a", SECRET_KEY)) == ("a", "[redacted: SECRET_KEY]")  # tuples stay tuples
    assert redact({SECRET_KEY: 1}) == {"[redacted: SECRET_KEY]": 1}  # keys too
    assert redact(42) == 42 and redact(None) is None


def test_encoded_secrets_are_caught(installation_secrets):
    basic = base64.b64encode(f"admin:{SECRET_KEY}".encode()).decode()
    for text in (quote(DB_PASSWORD, safe=""), base64.b64encode(SECRET_KEY.encode()).decode(), f"Basic {basic}",
                 base64.urlsafe_b64encode(b"xy" + LLM_KEY.encode()).decode()):
        out = redact_text(text)
        assert "[redacted: " in out, f"an encoded secret got through: {text!r} -> {out!r}"
    assert redact_text(quote(DB_PASSWORD, safe="")) == "[redacted: DATABASES[default].PASSWORD, url-encoded]"


def test_ordinary_text_is_not_mangled(settings, monkeypatch):
    """Short values, booleans, dotted paths and field names are not secrets whatever their
    setting's name: a text with common words comes out as it went in."""
    settings.SECRET_KEY = SECRET_KEY
    settings.AXES_PASSWORD_FORM_FIELD = "password"
    monkeypatch.setenv("LLM_API_KEY", "standin")  # the stand-in model's key: in every stand-in model name
    monkeypatch.setenv("SOME_TOKEN", "true")
    monkeypatch.setenv("SHORT_SECRET", "abc123")
    redaction.refresh()
    text = ("Enter your password; model standin-planner said true; key abc123 is short; "
            "hashers django.contrib.auth.hashers.MD5PasswordHasher; a secret is not here")
    assert redact_text(text) == text
    assert redact({"password": "password", "n": 12345678}) == {"password": "password", "n": 12345678}
    # ...while the real secret in the same text still goes.
    assert redact_text(f"{text} {SECRET_KEY}") == f"{text} [redacted: SECRET_KEY]"


def test_the_longest_secret_wins_where_one_starts_another(monkeypatch):
    monkeypatch.setenv("SHORTER_TOKEN", "tok-abcdefgh")
    monkeypatch.setenv("LONGER_TOKEN", "tok-abcdefgh-ijklmnop")
    redaction.refresh()
    try:
        assert (redact_text("tok-abcdefgh-ijklmnop / tok-abcdefgh / tok-abcdefg")
                == "[redacted: LONGER_TOKEN] / [redacted: SHORTER_TOKEN] / tok-abcdefg")
    finally:
        monkeypatch.undo()
        redaction.refresh()


def test_a_rotated_webhook_secret_is_redacted_at_once(webhook_secret):
    source = WebhookSource.objects.get(name="upstream")
    newer = webhooks.rotate(source)
    assert redact_text(f"x {newer} y") == "x [redacted: webhook secret of upstream] y"


def test_redacting_in_an_async_context_or_a_broken_transaction_keeps_working(webhook_secret):
    """A log line written by a websocket consumer (async) or after a failed query must not
    raise because the database part cannot be read then: the last values are kept."""
    import asyncio

    from django.db import IntegrityError, transaction

    assert redact_text(webhook_secret) == "[redacted: webhook secret of upstream]"  # read in a sync context

    async def in_event_loop():
        redaction.refresh()
        return redact_text(f"{SECRET_KEY} {webhook_secret}")

    assert asyncio.run(in_event_loop()) == "[redacted: SECRET_KEY] [redacted: webhook secret of upstream]"
    with transaction.atomic():
        with pytest.raises(IntegrityError):
            with transaction.atomic():
                WebhookSource.objects.create(name="upstream", secrets=[])  # the name is taken
        redaction.refresh()
        assert redact_text(SECRET_KEY) == "[redacted: SECRET_KEY]"


def test_the_admin_password_file_is_read(settings, tmp_path):
    settings.VAR_DIR = tmp_path
    (tmp_path / "admin-credentials.txt").write_text("username: admin\npassword: Adm1n-Pw-xyzzy\n")
    redaction.refresh()
    assert redact_text("login admin / Adm1n-Pw-xyzzy") == "login admin / [redacted: admin password]"


def test_the_primitive_redacts_without_django_or_a_database():
    """What the agent's tools call before a result reaches the dialog: importable and working
    in a process with no settings configured and no database."""
    import os
    import subprocess
    import sys

    code = ("import sys; from orchestrator.primitives.redaction import redact; "
            "print(redact({'out': ['token tok-Planted-123456789']})); "
            "print('orchestrator.models' in sys.modules, 'django.db.models' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"} | {"PLANTED_TOKEN": "tok-Planted-123456789"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["{'out': ['token [redacted: PLANTED_TOKEN]']}", "False False"]


# --- logs --------------------------------------------------------------------------------------

@pytest.mark.parametrize("formatter", [orch_logging.JsonFormatter(), orch_logging.TextFormatter()],
                         ids=["json", "text"])
def test_log_lines_are_redacted(installation_secrets, formatter):
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    logger = logging.getLogger("orchestrator.tests.redaction")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        logger.info("calling with key %s", LLM_KEY, extra={"task_id": 1, "worker": f"w {SECRET_KEY}",
                                                            "call_args": {"password": DB_PASSWORD}})
        try:
            raise RuntimeError(f"connect to postgres://orch:{URL_PASSWORD}@db failed")
        except RuntimeError:
            logger.exception("step failed")
    finally:
        logger.removeHandler(handler)
    text = stream.getvalue()
    for value in (SECRET_KEY, LLM_KEY, URL_PASSWORD):
        assert value not in text
    assert "[redacted: LLM_API_KEY]" in text and "[redacted: DATABASE_URL password]" in text
    if isinstance(formatter, orch_logging.JsonFormatter):
        first = json.loads(text.splitlines()[0])
        assert first["worker"] == "w [redacted: SECRET_KEY]"
        assert first["call_args"] == {"password": "[redacted: DATABASES[default].PASSWORD]"}


# --- the API and the export --------------------------------------------------------------------

def test_the_api_answers_redacted(agent_task, viewer, webhook_secret):
    client = Client()
    headers = bearer(viewer)
    step = Step.objects.get(task=agent_task, step_id="tool-1-0")
    for path in (f"/api/tasks/{agent_task.pk}", f"/api/tasks/{agent_task.pk}/wal",
                 f"/api/tasks/{agent_task.pk}/events", f"/api/tasks/{agent_task.pk}/steps/{step.step_id}/result"):
        response = client.get(path, **headers)
        assert response.status_code == 200, (path, response.content[:300])
        assert_clean(response.content.decode(), webhook_secret, markers=())
        assert "[redacted: " in response.content.decode(), path


def test_the_export_is_redacted(agent_task, viewer, webhook_secret):
    from orchestrator import selectors

    response = Client().get(f"/api/tasks/{agent_task.pk}/export", **bearer(viewer))
    assert response.status_code == 200
    text = response.content.decode()
    assert_clean(text, webhook_secret)
    assert "[redacted: webhook secret of upstream]" in text
    document = response.json()
    assert any("[redacted: SECRET_KEY]" in row["content"] for row in document["transcript"])
    # The export as the CLI and other callers read it, before any renderer.
    assert_clean(json.dumps(selectors.task_export(agent_task.pk), default=str), webhook_secret)


# --- the pages ---------------------------------------------------------------------------------

def test_the_task_page_never_shows_a_secret(agent_task, viewer, webhook_secret):
    client = Client()
    client.force_login(viewer)
    response = client.get(f"/tasks/{agent_task.pk}/")
    assert response.status_code == 200
    assert_clean(response.content.decode(), webhook_secret)


def test_the_live_fragments_never_show_a_secret(agent_task, viewer, webhook_secret):
    _, regions = fragments.task_page_regions(agent_task.pk, viewer, "csrf")
    html = "\n".join(regions.values())
    assert_clean(html, webhook_secret)
    event = agent_task.events.order_by("-seq").first()
    assert_clean(fragments.event_row(event)["html"], webhook_secret, markers=("SECRET_KEY",))


def test_websocket_messages_are_redacted(agent_task, webhook_secret):
    """What the task page's websocket sends as it happens: the event (with its payload) and
    the task's state, through the consumers' one encoder."""
    from asgiref.sync import async_to_sync

    from orchestrator import live
    from orchestrator.consumers import TaskConsumer, TaskListConsumer

    event = agent_task.events.order_by("-seq").first()
    for consumer in (TaskConsumer, TaskListConsumer):
        text = async_to_sync(consumer.encode_json)({"events": [live.event_json(event)],
                                                    "state": live.task_state(agent_task.pk)})
        assert_clean(text, webhook_secret, markers=("SECRET_KEY",))


def test_the_review_page_shows_arguments_redacted(agent_task, reviewer, webhook_secret):
    from review.models import ReviewItem

    entry = WalEntry.objects.get(task=agent_task)
    item = ReviewItem.objects.create(task=agent_task, wal_entry=entry, step_id=entry.step_id, tool=entry.tool,
                                     kind="effect", reason=f"lost after sending {LLM_KEY}",
                                     evidence={"response": SECRET_KEY})
    client = Client()
    client.force_login(reviewer)
    response = client.get(f"/review/{item.pk}/")
    assert response.status_code == 200
    assert_clean(response.content.decode(), webhook_secret)
    api = Client().get(f"/api/reviews/{item.pk}", **bearer(reviewer))
    assert api.status_code == 200
    assert_clean(api.content.decode(), webhook_secret, markers=("SECRET_KEY",))
    entry.refresh_from_db()
    assert entry.args["body"]["key"] == SECRET_KEY  # what was stored (and approved) is untouched
