"""The tables the demo workloads write. They kept their names (db_table) when they moved here
from the orchestrator app: the move changed Django's state only (demo/migrations/0001_initial.py,
orchestrator/migrations/0027_demo_tables_to_the_demo_app.py)."""
from django.db import models


class DemoSource(models.Model):
    id = models.BigIntegerField(primary_key=True)
    amount = models.DecimalField(max_digits=18, decimal_places=4)

    class Meta:
        db_table = "demo_source"


class DemoDestination(models.Model):
    id = models.BigIntegerField(primary_key=True)
    amount = models.DecimalField(max_digits=18, decimal_places=4)

    class Meta:
        db_table = "demo_destination"


class DemoContractExtraction(models.Model):
    contract = models.CharField(max_length=100, primary_key=True)
    parties = models.JSONField(default=list)
    dates = models.JSONField(default=list)
    amounts = models.JSONField(default=list)
    # By name, not by import: the demo imports nothing of the harness but orchestrator.sdk.
    task = models.ForeignKey("orchestrator.Task", null=True, on_delete=models.SET_NULL, related_name="+")

    class Meta:
        db_table = "demo_contract_extraction"
