from django.db import migrations


class Migration(migrations.Migration):
    """The agent's security model (issue 19): memory scoped to its owner."""

    dependencies = [("orchestrator", "0019_task_claimed_at")]

    operations = []
