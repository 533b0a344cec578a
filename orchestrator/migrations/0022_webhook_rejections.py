"""Rejected webhooks counted (WebhookRejection), and the table of the rate limiter's cache
when no Redis is configured (settings CACHES["ratelimit"]: DatabaseCache)."""
from django.db import migrations, models

RATELIMIT_CACHE_TABLE = "orchestrator_ratelimit_cache"  # settings.py names the same table


def create_cache_table(apps, schema_editor):
    # Always, whatever the settings say now: an installation that drops REDIS_URL later
    # falls back to this table (createcachetable skips a table that exists).
    from django.core.management.commands.createcachetable import Command

    command = Command()
    command.verbosity = 0
    command.create_table(schema_editor.connection.alias, RATELIMIT_CACHE_TABLE, dry_run=False)


def drop_cache_table(apps, schema_editor):
    schema_editor.execute(f"DROP TABLE IF EXISTS {schema_editor.quote_name(RATELIMIT_CACHE_TABLE)}")


class Migration(migrations.Migration):

    dependencies = [
        ("orchestrator", "0021_agent_reader_role"),
    ]

    operations = [
        migrations.CreateModel(
            name="WebhookRejection",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("source", models.CharField(blank=True, help_text="the source's name; empty for an unknown one",
                                            max_length=60)),
                ("asked_for", models.CharField(blank=True, help_text="the name in the URL (the first one seen)",
                                               max_length=60)),
                ("reason", models.CharField(max_length=100)),
                ("ip", models.GenericIPAddressField(blank=True, null=True)),
                ("count", models.PositiveIntegerField(default=1)),
                ("first_at", models.DateTimeField(auto_now_add=True)),
                ("last_at", models.DateTimeField(db_index=True)),
                ("last_task_id", models.BigIntegerField(blank=True, help_text="the task id in the URL (not checked)",
                                                        null=True)),
                ("last_webhook_id", models.CharField(blank=True, max_length=200)),
                ("last_user_agent", models.CharField(blank=True, max_length=200)),
            ],
            options={
                "indexes": [models.Index(fields=["source", "reason", "ip", "last_at"], name="webhook_rejection_key")],
            },
        ),
        migrations.RunPython(create_cache_table, drop_cache_table),
    ]
