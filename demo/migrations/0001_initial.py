# The demo's tables moved here from the orchestrator app (orchestrator 0027): Django's state only.
# The tables were created by orchestrator 0001 and keep their names; nothing changes in the database.

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):

    initial = True

    dependencies = [
        ('orchestrator', '0026_retention_of_webhook_deliveries'),
    ]

    operations = [migrations.SeparateDatabaseAndState(database_operations=[], state_operations=[
        migrations.CreateModel(
            name='DemoDestination',
            fields=[
                ('id', models.BigIntegerField(primary_key=True, serialize=False)),
                ('amount', models.DecimalField(decimal_places=4, max_digits=18)),
            ],
            options={
                'db_table': 'demo_destination',
            },
        ),
        migrations.CreateModel(
            name='DemoSource',
            fields=[
                ('id', models.BigIntegerField(primary_key=True, serialize=False)),
                ('amount', models.DecimalField(decimal_places=4, max_digits=18)),
            ],
            options={
                'db_table': 'demo_source',
            },
        ),
        migrations.CreateModel(
            name='DemoContractExtraction',
            fields=[
                ('contract', models.CharField(max_length=100, primary_key=True, serialize=False)),
                ('parties', models.JSONField(default=list)),
                ('dates', models.JSONField(default=list)),
                ('amounts', models.JSONField(default=list)),
                ('task', models.ForeignKey(null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='+', to='orchestrator.task')),
            ],
            options={
                'db_table': 'demo_contract_extraction',
            },
        ),
    ])]
