"""WalEntry.settled_by: which outcomes in doubt a tool's probe settled without a reviewer."""
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("orchestrator", "0022_webhook_rejections"),
    ]

    operations = [
        migrations.AddField(
            model_name="walentry",
            name="settled_by",
            field=models.CharField(blank=True, default="", max_length=20),
        ),
    ]
