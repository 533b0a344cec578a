"""The Content-Security-Policy header, pages without inline script or style, and the API
docs served from local static files (no CDN: they work offline)."""
import re

import pytest

from orchestrator.engine import services
from tests.conftest import ROOT

pytestmark = pytest.mark.django_db

INLINE_SCRIPT = re.compile(r"<script\b(?![^>]*\bsrc=)(?![^>]*type=\"application/json\")[^>]*>", re.I)
INLINE_STYLE = re.compile(r"<style\b|\sstyle\s*=", re.I)
EVENT_HANDLER = re.compile(r"<[^>]+\son[a-z]+\s*=", re.I)


def policy(response) -> dict:
    header = response["Content-Security-Policy"]
    return {d.split()[0]: d.split()[1:] for d in (part.strip() for part in header.split(";")) if d}


def test_pages_send_a_strict_policy(client, operator):
    client.force_login(operator)
    for url in ("/", "/accounts/login/", "/tasks/new/", "/review/"):
        directives = policy(client.get(url))
        assert directives["default-src"] == ["'self'"], url
        assert directives["script-src"] == ["'self'"] and directives["style-src"] == ["'self'"]
        assert directives["connect-src"] == ["'self'"]  # the websockets: ws:/wss: to this host and port
        assert directives["object-src"] == ["'none'"] and directives["frame-ancestors"] == ["'none'"]
        assert "'unsafe-inline'" not in client.get(url)["Content-Security-Policy"]


def test_templates_have_no_inline_script_style_or_event_handler():
    for path in sorted((ROOT / "templates").rglob("*.html")):
        text = path.read_text()
        assert not INLINE_SCRIPT.search(text), path
        assert not INLINE_STYLE.search(text), path
        assert not EVENT_HANDLER.search(text), path


def assert_no_inline(body: str, url: str):
    assert not INLINE_SCRIPT.search(body), url
    assert not INLINE_STYLE.search(body), url
    assert not EVENT_HANDLER.search(body), url


def test_rendered_pages_have_no_inline_script_or_style(client, make_user):
    user = make_user("olga", "operator", "viewer", "reviewer")
    client.force_login(user)
    task = services.task_create(type="demo.pipeline", params={}, actor=user)
    services.task_pause(task_id=task.pk, actor=user)
    for url in ("/", f"/tasks/{task.pk}/", "/tasks/new/", "/tasks/new/?type=demo.pipeline", "/review/",
                f"/tasks/{task.pk}/edit/"):
        response = client.get(url)
        assert response.status_code == 200, url
        assert_no_inline(response.content.decode(), url)
    client.logout()
    assert_no_inline(client.get("/accounts/login/").content.decode(), "/accounts/login/")


def test_the_api_docs_reference_only_local_static_files(client):
    response = client.get("/api/docs")
    assert response.status_code == 200
    body = response.content.decode()
    urls = re.findall(r'(?:src|href)="([^"]+)"', body)
    assert any(u.endswith("swagger-ui-bundle.js") for u in urls) and any(u.endswith("swagger-ui.css") for u in urls)
    assert all(u.startswith("/static/") for u in urls), urls
    assert "cdn" not in body.lower() and "https://" not in body
    for url in urls:
        assert client.get(url).status_code == 200, url  # served (whitenoise, from ninja's app)
    assert "Content-Security-Policy" in response
