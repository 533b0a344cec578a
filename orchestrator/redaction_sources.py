"""The secrets that live in the database, fed to the redaction primitive
(orchestrator/primitives/redaction.py, which sits below the models and cannot read them):
every webhook source's secrets (`whsec_<base64>`, and the base64 key alone, which is what
signs) and the stored hashes of API tokens (the tokens themselves are never stored).

Registered once per process when the app is ready; read again every DATABASE_SECRETS_TTL
seconds (another process may have rotated a secret) and at once when this process saves or
deletes a webhook source. A database that cannot be read (not migrated yet, down, or an
async context) keeps the last values until the next try."""
from django.db import connection, transaction
from django.db.models.signals import post_delete, post_save

from .primitives import redaction

DATABASE_SECRETS_TTL = 10.0  # seconds
PROVIDER = "database"


def database_secrets() -> dict[str, str]:
    from .models import ApiToken, WebhookSource

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
        for prefix, token_hash in ApiToken.objects.values_list("prefix", "token_hash"):
            found[f"API token hash {prefix}…"] = token_hash
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


def register() -> None:
    from .models import ApiToken, WebhookSource

    redaction.register_provider(PROVIDER, database_secrets, ttl=DATABASE_SECRETS_TTL)
    for model in (WebhookSource, ApiToken):
        post_save.connect(webhook_sources_changed, sender=model, dispatch_uid=f"redaction-{model.__name__}-saved")
        post_delete.connect(webhook_sources_changed, sender=model, dispatch_uid=f"redaction-{model.__name__}-deleted")
