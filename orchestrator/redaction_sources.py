"""The secrets that live in the database, fed to the redaction primitive
(orchestrator/primitives/redaction.py, which sits below the models and cannot read them):
every webhook source's secrets (`whsec_<base64>`, and the base64 key alone, which is what
signs), the stored hashes of API tokens (the tokens themselves are never stored) and the keys
of model profiles (the admin's ModelProfile rows, and LLM_MODELS' as a provider of their own),
and the header and environment values of MCP servers (the admin's McpServer rows, and
ORCH_MCP_SERVERS' as a provider of their own): a bearer token, a child's key.

Registered once per process when the app is ready; read again every DATABASE_SECRETS_TTL
seconds (another process may have rotated a secret) and at once when this process saves or
deletes a webhook source. A database that cannot be read (not migrated yet, down, or an
async context) keeps the last values until the next try."""
from django.db import connection, transaction
from django.db.models.signals import post_delete, post_save

from .primitives import redaction

DATABASE_SECRETS_TTL = 10.0  # seconds
PROVIDER = "database"


def mcp_server_values(name: str, spec) -> dict[str, str]:
    """{label: value} of one MCP server's declaration: every header value (and the credential
    after "Bearer " alone) and every environment value — whatever else is wrong with it."""
    found: dict[str, str] = {}
    if not isinstance(spec, dict):
        return found
    for kind, values in (("header", spec.get("headers")), ("environment", spec.get("env"))):
        for key, value in (values.items() if isinstance(values, dict) else ()):
            if not isinstance(value, str):
                continue
            label = f"{kind} {key} of MCP server {name}"
            found[label] = value
            scheme, _, credential = value.partition(" ")
            if kind == "header" and credential.strip() and scheme.lower() in ("bearer", "token", "basic"):
                found[f"{label} (credential)"] = credential.strip()
    return found


def mcp_settings_secrets() -> dict[str, str]:
    """The secrets of the MCP servers declared in ORCH_MCP_SERVERS (collected again when a
    setting changes)."""
    from django.conf import settings

    found: dict[str, str] = {}
    declared = getattr(settings, "ORCH_MCP_SERVERS", None) or {}
    for name, spec in (declared.items() if isinstance(declared, dict) else ()):
        found.update(mcp_server_values(str(name), spec))
    return found


def database_secrets() -> dict[str, str]:
    from .models import ApiToken, McpServer, ModelProfile, NotificationSubscription, WebhookSource

    def read() -> dict[str, str]:
        found: dict[str, str] = {}
        for name, secrets in WebhookSource.objects.values_list("name", "secrets"):
            for index, secret in enumerate(secrets if isinstance(secrets, list) else []):
                if not isinstance(secret, str):
                    continue
                label = f"webhook secret of {name}" + (f" #{index + 1}" if index else "")
                found[label] = secret
                if secret.startswith("whsec_"):
                    found[f"{label} (key)"] = secret.removeprefix("whsec_")
        for name, secret in NotificationSubscription.objects.values_list("name", "secret"):
            if secret:  # an outgoing webhook's signing secret (docs/notifications.md)
                found[f"signing secret of subscription {name}"] = secret
                if secret.startswith("whsec_"):
                    found[f"signing secret of subscription {name} (key)"] = secret.removeprefix("whsec_")
        for prefix, token_hash in ApiToken.objects.values_list("prefix", "token_hash"):
            found[f"API token hash {prefix}…"] = token_hash
        for name, key in ModelProfile.objects.exclude(api_key="").values_list("name", "api_key"):
            found[f"model profile key of {name}"] = key
        for name, headers, env in McpServer.objects.values_list("name", "headers", "env"):
            found.update(mcp_server_values(name, {"headers": headers, "env": env}))
        return found

    # Inside a transaction a failed read must not break it (PostgreSQL): a savepoint. Outside,
    # no transaction: on SQLite an atomic block would take the write lock for a read.
    if connection.in_atomic_block:
        if connection.needs_rollback:  # a broken transaction: keep the last values, try again later
            raise transaction.TransactionManagementError("the current transaction is broken")
        with transaction.atomic():
            return read()
    return read()


def webhook_sources_changed(**kwargs) -> None:
    redaction.refresh()


def mcp_servers_changed(**kwargs) -> None:
    from .tools import mcp

    redaction.refresh()
    mcp.configuration_changed()  # this process's MCP client reads the servers again


def register() -> None:
    from .llm import profiles
    from .models import ApiToken, McpServer, ModelProfile, NotificationSubscription, WebhookSource

    redaction.register_provider(PROVIDER, database_secrets, ttl=DATABASE_SECRETS_TTL)
    redaction.register_provider("llm_models", profiles.declared_secrets)
    redaction.register_provider("ORCH_MCP_SERVERS", mcp_settings_secrets)
    post_save.connect(mcp_servers_changed, sender=McpServer, dispatch_uid="redaction-McpServer-saved")
    post_delete.connect(mcp_servers_changed, sender=McpServer, dispatch_uid="redaction-McpServer-deleted")
    for model in (WebhookSource, ApiToken, ModelProfile, NotificationSubscription):
        post_save.connect(webhook_sources_changed, sender=model, dispatch_uid=f"redaction-{model.__name__}-saved")
        post_delete.connect(webhook_sources_changed, sender=model, dispatch_uid=f"redaction-{model.__name__}-deleted")
