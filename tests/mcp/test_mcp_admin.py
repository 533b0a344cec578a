"""MCP servers in the admin: admins only; a server's headers and environment are secrets, never
shown (masked in the form, names only in the list, kept when sent back masked), never audited,
redacted everywhere once saved; a declaration that cannot work is refused with its reason."""
import json

import pytest
from django.test import Client

from orchestrator.models import AuditEntry, McpServer
from orchestrator.primitives.redaction import redact_text
from orchestrator.tools import mcp

pytestmark = pytest.mark.django_db

TOKEN = "Bearer adm-" + "5c8e1f0a9b7d"
KEY = "child-key-" + "3e9a7c1b5d"
ADD, LIST = "/admin/orchestrator/mcpserver/add/", "/admin/orchestrator/mcpserver/"


@pytest.fixture
def admin_client(make_user):
    client = Client()
    client.force_login(make_user("boss", superuser=True))
    return client


def form(**fields) -> dict:
    data = {"name": "files", "enabled": "on", "command": "", "url": "", "headers": "{}", "env": "{}",
            "tool_effects": "{}"}
    data.update({k: json.dumps(v) if isinstance(v, (dict, list)) else v for k, v in fields.items()})
    return data


def test_headers_and_environment_are_never_shown_and_kept_when_sent_back_masked(admin_client):
    response = admin_client.post(ADD, form(url="http://127.0.0.1:9000/mcp", headers={"Authorization": TOKEN},
                                           tool_effects={"write": "non_idempotent"}))
    assert response.status_code == 302, response.content.decode()[:3000]
    server = McpServer.objects.get(name="files")
    assert server.headers == {"Authorization": TOKEN}
    assert redact_text(f"sent {TOKEN}") == "sent [redacted: header Authorization of MCP server files]"
    change = f"{LIST}{server.pk}/change/"
    for page in (admin_client.get(LIST), admin_client.get(change)):
        html = page.content.decode()
        assert page.status_code == 200 and TOKEN not in html and TOKEN.split()[1] not in html
    assert "Authorization" in admin_client.get(LIST).content.decode()
    assert "********" in admin_client.get(change).content.decode()
    # Sent back masked (what the form shows): the stored value is kept.
    response = admin_client.post(change, form(url="http://127.0.0.1:9000/mcp",
                                              headers={"Authorization": "********", "X-Team": "blue-team-1"}))
    assert response.status_code == 302, response.content.decode()[:3000]
    assert McpServer.objects.get(pk=server.pk).headers == {"Authorization": TOKEN, "X-Team": "blue-team-1"}
    # Left out: removed.
    admin_client.post(change, form(url="http://127.0.0.1:9000/mcp", headers={"X-Team": "********"}))
    assert McpServer.objects.get(pk=server.pk).headers == {"X-Team": "blue-team-1"}
    audits = json.dumps(list(AuditEntry.objects.filter(action="mcp_server.save").values("after")))
    assert TOKEN.split()[1] not in audits and "Authorization" in audits
    assert mcp.server("files").url == "http://127.0.0.1:9000/mcp"


def test_a_stdio_servers_environment_is_a_secret_too(admin_client):
    response = admin_client.post(ADD, form(command=["mcp-server-time"], env={"API_KEY": KEY}))
    assert response.status_code == 302, response.content.decode()[:3000]
    server = McpServer.objects.get(name="files")
    assert KEY not in admin_client.get(f"{LIST}{server.pk}/change/").content.decode()
    assert KEY not in redact_text(KEY)


@pytest.mark.parametrize("fields, says", [
    ({"command": ["x"], "url": "http://127.0.0.1:1/mcp"}, "give exactly one of command"),
    ({}, "give exactly one of command"),
    ({"name": "a__b", "command": ["x"]}, "not a server name"),
    ({"command": ["x"], "headers": {"Authorization": "Bearer abcdefgh"}}, "headers are for a url"),
    ({"url": "http://127.0.0.1:1/mcp", "tool_effects": {"t": "harmless"}}, "the classes are read_only"),
    ({"url": "http://127.0.0.1:1/mcp", "headers": {"Authorization": "********"}}, "no stored value to keep"),
    ({"name": "git", "command": ["x"]}, "ORCH_MCP_SERVERS declares a server named 'git'"),
])
def test_a_declaration_that_cannot_work_is_refused(admin_client, settings, fields, says):
    settings.ORCH_MCP_SERVERS = {"git": {"command": ["mcp-server-git"]}}
    response = admin_client.post(ADD, form(**fields))
    assert response.status_code == 200 and says in response.content.decode().replace("&#x27;", "'")
    assert not McpServer.objects.exists()


def test_only_admins_see_mcp_servers(make_user):
    from django.contrib.auth.models import Permission

    McpServer.objects.create(name="files", url="http://127.0.0.1:9000/mcp", headers={"Authorization": TOKEN})
    staff = make_user("stan", "operator")
    staff.is_staff = True
    staff.save()
    # Every model permission on servers: what Django alone would let through.
    staff.user_permissions.set(Permission.objects.filter(content_type__model="mcpserver"))
    client = Client()
    client.force_login(staff)
    assert client.get(LIST).status_code == 403
    assert client.get(ADD).status_code == 403


def test_a_malformed_orch_mcp_servers_stops_the_start_as_a_system_check_without_quoting_its_secrets(settings):
    from django.core.management import call_command
    from django.core.management.base import SystemCheckError

    from orchestrator.checks import check_mcp_servers

    settings.ORCH_MCP_SERVERS = {
        "both": {"command": ["mcp-server-git"], "url": "http://127.0.0.1:9000/mcp"},
        "web": {"url": "ftp://files.example.org/mcp", "headers": {"Authorization": TOKEN}},
        "time": {"command": ["mcp-server-time"], "tool_effects": {"get_current_time": "harmless"}},
    }
    errors = check_mcp_servers(None)
    assert [e.id for e in errors] == ["orchestrator.E050"] * 3
    said = "\n".join(e.msg for e in errors)
    assert "both: give exactly one of command (a stdio server) or url" in said
    assert "web: url must be an http(s) address" in said
    assert "time: tool_effects get_current_time=harmless: the classes are" in said
    assert TOKEN not in said and all(TOKEN not in (e.hint or "") for e in errors)
    with pytest.raises(SystemCheckError, match="E050"):
        call_command("check")
    settings.ORCH_MCP_SERVERS = {"time": {"command": ["mcp-server-time"]}}
    assert check_mcp_servers(None) == []
