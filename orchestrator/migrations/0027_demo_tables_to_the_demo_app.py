# The demo's tables moved to the demo app (demo 0001): Django's state only; the tables stay as they are.

from django.db import migrations


class Migration(migrations.Migration):

    dependencies = [
        ('orchestrator', '0026_retention_of_webhook_deliveries'),
        ('demo', '0001_initial'),
    ]

    operations = [migrations.SeparateDatabaseAndState(database_operations=[], state_operations=[
        migrations.RemoveField(
            model_name='democontractextraction',
            name='task',
        ),
        migrations.DeleteModel(
            name='DemoDestination',
        ),
        migrations.DeleteModel(
            name='DemoSource',
        ),
        migrations.DeleteModel(
            name='DemoContractExtraction',
        ),
    ])]
