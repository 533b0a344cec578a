"""A transactional tool's effect (db.upsert: writes in the harness's own database) commits together
with its WAL record. Run again with the same key (a step re-run after a crash between the effect's
commit and the step's), the first result is returned and the second run's writes roll back. On
PostgreSQL the effect goes first and the record's insert is what finds the key (engine/wal.py: one
read saved per effect), so there this proves that the optimistic effect is rolled back."""
import logging

import pytest
from django.db import connection

from demo.models import DemoDestination
from orchestrator.engine import lease as leases, services
from orchestrator.engine.wal import perform
from orchestrator.models import IdempotencyRecord, WalEntry
from orchestrator.primitives.cancellation import CancellationToken

pytestmark = pytest.mark.django_db(transaction=True)


def upsert(lease, rows, completed):
    return perform(lease=lease, step_id="batch-0001", call_index=0, tool_name="db.upsert",
                   args={"table": "demo_destination", "columns": ["id", "amount"], "rows": rows},
                   token=CancellationToken(), completed=completed)


def test_a_transactional_effect_run_again_with_its_key_returns_the_first_result_and_writes_nothing(caplog):
    task = services.task_create(type="demo.migrate_rows", params={"rows": 100, "batch_size": 50, "rate": 1.0})
    lease = leases.claim(task.pk)

    first = []
    assert upsert(lease, [[7_000_001, "1.5"]], first) == {"table": "demo_destination", "rows": 1}
    assert [(e.tool, e.committed) for e in first] == [("db.upsert", True)]

    again = []
    with caplog.at_level(logging.INFO, logger="orchestrator.engine.wal"):
        result = upsert(lease, [[7_000_001, "2.5"], [7_000_002, "3.5"]], again)
    assert result == {"table": "demo_destination", "rows": 1}  # the first run's, as recorded
    assert list(DemoDestination.objects.filter(pk__gte=7_000_001).values_list("pk", "amount")) == [(7_000_001, 1.5)]
    [entry] = WalEntry.objects.filter(task=task)
    assert entry.status == "done" and entry.result == result
    assert IdempotencyRecord.objects.filter(key=entry.idempotency_key).count() == 1
    took_the_key = "key recorded by an earlier execution" in caplog.text
    assert took_the_key == (connection.vendor == "postgresql")  # PostgreSQL: performed, then rolled back
