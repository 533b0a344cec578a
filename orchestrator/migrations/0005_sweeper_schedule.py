from django.db import migrations

NAME = "orchestrator: recover stale tasks"


def create_schedule(apps, schema_editor):
    Schedule = apps.get_model("django_q", "Schedule")
    # The worker cluster sweeps too (besides `manage.py recover --loop`): a deployment with
    # only web + workers still recovers tasks whose worker died.
    Schedule.objects.update_or_create(name=NAME, defaults={
        "func": "orchestrator.engine.recovery.sweep", "schedule_type": "I", "minutes": 1, "repeats": -1})


def remove_schedule(apps, schema_editor):
    apps.get_model("django_q", "Schedule").objects.filter(name=NAME).delete()


class Migration(migrations.Migration):
    dependencies = [("orchestrator", "0004_step_failure_fingerprint_wal_skipped"),
                    ("django_q", "0019_alter_task_options_alter_ormq_key_alter_ormq_lock_and_more")]
    operations = [migrations.RunPython(create_schedule, remove_schedule)]
