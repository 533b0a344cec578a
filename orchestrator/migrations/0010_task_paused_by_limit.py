from django.db import migrations, models


def from_status_reason(apps, schema_editor):
    """Tasks paused by a limit before the field existed said so in status_reason only."""
    Task = apps.get_model("orchestrator", "Task")
    for task in Task.objects.filter(status="paused", status_reason__startswith="limit: ").only("pk", "status_reason"):
        Task.objects.filter(pk=task.pk).update(paused_by_limit=task.status_reason.removeprefix("limit: ")[:20])


class Migration(migrations.Migration):

    dependencies = [
        ('orchestrator', '0009_apitoken_expires_at'),
    ]

    operations = [
        migrations.AddField(
            model_name='task',
            name='paused_by_limit',
            field=models.CharField(blank=True, default='', max_length=20),
        ),
        migrations.RunPython(from_status_reason, migrations.RunPython.noop),
    ]
