"""The admin's MCP servers (McpServer; orchestrator/tools/mcp.py reads them with ORCH_MCP_SERVERS).
Admins only (superusers), viewing included: a server's tools reach outside the harness.

A server's headers (a bearer token) and environment are secrets: the form shows each one's
name with a mask for its value, never the value. Sending a name with the mask keeps the stored
value, a new value replaces it, a name left out is removed. The lists show only the names,
and the audit entry of a save names what changed, never a value. A name ORCH_MCP_SERVERS
declares is refused: the environment's server wins, so this one would never be used."""
import json

from django import forms
from django.conf import settings
from django.contrib import admin

from .admin_guards import AdminsOnly, GuardedChangelistAdmin
from .engine.audit import audit
from .models import McpServer
from .tools import mcp

MASK = "********"  # what a stored value shows as; sent back unchanged, it keeps that value


def masked(values: dict | None) -> dict:
    return {name: MASK for name in (values or {})}


def names_only(values: dict | None) -> str:
    return ", ".join(sorted(values or {})) or "—"


class SecretValuesField(forms.JSONField):
    """A JSON object of strings whose stored values are shown masked."""

    def __init__(self, **kwargs):
        kwargs.setdefault("required", False)
        kwargs.setdefault("widget", forms.Textarea(attrs={"rows": 4, "cols": 80, "autocomplete": "off"}))
        super().__init__(**kwargs)

    def clean(self, value):
        value = super().clean(value)
        if value in (None, ""):
            return {}
        if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            raise forms.ValidationError('A JSON object of strings, e.g. {"Authorization": "Bearer …"}.')
        return value


class McpServerForm(forms.ModelForm):
    command = forms.JSONField(required=False, widget=forms.TextInput(attrs={"size": 80}),
                              help_text='stdio: the argv as a JSON list, e.g. ["mcp-server-time"]')
    url = forms.URLField(required=False, max_length=500, assume_scheme="http",
                         help_text="streamable HTTP: the endpoint, e.g. http://127.0.0.1:9000/mcp")
    headers = SecretValuesField(help_text=f"HTTP headers sent with every request (secrets: stored values show as "
                                          f"{MASK}; send {MASK} to keep one, a new value to replace it, leave a "
                                          f"name out to remove it)")
    env = SecretValuesField(help_text=f"stdio: extra environment of the child (secrets, shown as {MASK} like the "
                                      f"headers); the child gets nothing else of the worker's environment but "
                                      f"PATH, HOME, LANG, LC_ALL, TZ and TMPDIR")
    tool_effects = forms.JSONField(required=False, widget=forms.Textarea(attrs={"rows": 3, "cols": 80}),
                                   help_text=f"tool -> effect class ({', '.join(mcp.EFFECTS)}), overriding its "
                                             f"annotations, e.g. {{\"git_reset\": \"non_idempotent\"}}")

    class Meta:
        model = McpServer
        fields = ("name", "enabled", "command", "url", "headers", "env", "tool_effects")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.instance.pk and not self.is_bound:
            self.initial["headers"] = masked(self.instance.headers)
            self.initial["env"] = masked(self.instance.env)

    def clean_name(self):
        name = self.cleaned_data["name"]
        if name in (settings.ORCH_MCP_SERVERS or {}):
            raise forms.ValidationError(f"ORCH_MCP_SERVERS declares a server named {name!r}; the environment's wins, "
                                        f"so this one would never be used. Pick another name.")
        return name

    def _kept(self, field: str) -> dict:
        stored = getattr(self.instance, field) or {} if self.instance.pk else {}
        given = self.cleaned_data.get(field) or {}
        unknown = [k for k, v in given.items() if v == MASK and k not in stored]
        if unknown:
            self.add_error(field, f"{', '.join(unknown)}: no stored value to keep; give the value")
        return {k: (stored[k] if v == MASK and k in stored else v) for k, v in given.items()}

    def clean(self):
        data = super().clean()
        data["headers"], data["env"] = self._kept("headers"), self._kept("env")
        data["command"] = data.get("command") or []
        data["url"] = data.get("url") or ""
        data["tool_effects"] = data.get("tool_effects") or {}
        name = data.get("name")
        if name and not self.errors:
            spec = {k: data[k] for k in ("command", "env", "url", "headers", "tool_effects") if data[k]}
            try:
                mcp.parse_server(name, spec, origin="admin")
            except mcp.ConfigError as exc:
                raise forms.ValidationError(str(exc)) from None
        return data


@admin.register(McpServer)
class McpServerAdmin(AdminsOnly, GuardedChangelistAdmin):
    """MCP servers whose tools an admin may grant to agents, as <name>__<tool> (docs/extending.md)."""

    form = McpServerForm
    list_display = ("name", "enabled", "endpoint", "header_names", "env_names", "effects", "updated_at")
    list_filter = ("enabled", "created_at")
    search_fields = ("name", "url")
    readonly_fields = ("created_at", "updated_at")

    @admin.display(description="server")
    def endpoint(self, obj):
        return f"stdio: {' '.join(obj.command)[:120]}" if obj.command else obj.url

    @admin.display(description="headers (values hidden)")
    def header_names(self, obj):
        return names_only(obj.headers)

    @admin.display(description="environment (values hidden)")
    def env_names(self, obj):
        return names_only(obj.env)

    @admin.display(description="effect overrides")
    def effects(self, obj):
        return json.dumps(obj.tool_effects, sort_keys=True) if obj.tool_effects else "—"

    def save_model(self, request, obj, form, change):
        before = McpServer.objects.filter(pk=obj.pk).values("headers", "env").first() if obj.pk else None
        super().save_model(request, obj, form, change)
        changed = [f"{field} {name}" for field in ("headers", "env")
                   for name in sorted(set((before or {}).get(field) or {}) | set(getattr(obj, field) or {}))
                   if ((before or {}).get(field) or {}).get(name) != (getattr(obj, field) or {}).get(name)]
        audit(action="mcp_server.save", actor=request.user, ip=request.META.get("REMOTE_ADDR"),
              after={"name": obj.name, "enabled": obj.enabled, "command": obj.command, "url": obj.url,
                     "header_names": sorted(obj.headers or {}), "env_names": sorted(obj.env or {}),
                     "secrets_changed": changed, "tool_effects": obj.tool_effects})

    def delete_model(self, request, obj):
        audit(action="mcp_server.delete", actor=request.user, ip=request.META.get("REMOTE_ADDR"),
              after={"name": obj.name})
        super().delete_model(request, obj)
