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
from orchestrator.engine.lease import LeaseLost
from orchestrator.engine.wal import EffectFailed, perform
from orchestrator.models import IdempotencyRecord, Task, WalEntry
from orchestrator.primitives.cancellation import CancellationToken
from orchestrator.primitives.faults import InjectedFault

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


def test_on_postgresql_the_effect_and_its_record_are_one_statement_outside_any_transaction():
    # One round trip: the upsert, the entry `done` and the key in one autocommitted statement,
    # not BEGIN, the upsert, the record and COMMIT (engine/wal.py: _in_one_statement).
    if connection.vendor != "postgresql":
        pytest.skip("the one statement is PostgreSQL's; SQLite keeps the transaction")
    task = services.task_create(type="demo.migrate_rows", params={"rows": 100, "batch_size": 50, "rate": 1.0})
    lease = leases.claim(task.pk)
    seen = []

    def watch(execute, sql, params, many, context):
        seen.append((sql, connection.in_atomic_block, connection.get_autocommit()))
        return execute(sql, params, many, context)

    completed = []
    with connection.execute_wrapper(watch):
        assert upsert(lease, [[7_000_011, "1.5"], [7_000_012, "2.5"]], completed) == {
            "table": "demo_destination", "rows": 2}
    [(sql, in_atomic, autocommit)] = seen
    assert "demo_destination" in sql and "orchestrator_walentry" in sql and "orchestrator_idempotencyrecord" in sql
    assert (in_atomic, autocommit) == (False, True)
    assert [(e.tool, e.committed) for e in completed] == [("db.upsert", True)]
    [entry] = WalEntry.objects.filter(task=task)
    assert (entry.status, entry.result, entry.idempotent) == ("done", {"table": "demo_destination", "rows": 2}, True)
    assert entry.pk == completed[0].entry_id
    assert IdempotencyRecord.objects.filter(key=entry.idempotency_key).exists()
    assert sorted(DemoDestination.objects.filter(pk__gte=7_000_011).values_list("pk", flat=True)) == [
        7_000_011, 7_000_012]


def test_a_worker_whose_lease_was_taken_writes_neither_the_effect_nor_its_record():
    task = services.task_create(type="demo.migrate_rows", params={"rows": 100, "batch_size": 50, "rate": 1.0})
    lease = leases.claim(task.pk)
    Task.objects.filter(pk=task.pk).update(lease_epoch=lease.epoch + 1)  # another worker took the task
    with pytest.raises(LeaseLost):
        upsert(lease, [[7_000_021, "1.5"]], [])
    assert not DemoDestination.objects.filter(pk=7_000_021).exists()
    assert not WalEntry.objects.filter(task=task).exists()
    assert not IdempotencyRecord.objects.filter(key__startswith=f"t{task.pk}:").exists()


# Not a number (refused before anything is sent); too many digits for the column (refused by the database).
@pytest.mark.parametrize("amount", ["x" * 40, "1" + "0" * 20])
def test_a_value_refused_fails_the_effect_and_writes_nothing(amount):
    if amount.isdigit() and connection.vendor != "postgresql":
        pytest.skip("SQLite keeps a number of any size in a decimal column")
    task = services.task_create(type="demo.migrate_rows", params={"rows": 100, "batch_size": 50, "rate": 1.0})
    lease = leases.claim(task.pk)
    with pytest.raises(EffectFailed):
        upsert(lease, [[7_000_031, "1.5"], [7_000_032, amount]], [])
    assert not DemoDestination.objects.filter(pk__gte=7_000_031).exists()
    assert not WalEntry.objects.filter(task=task).exists()
    # The step's retry, with a value that fits, performs it once.
    assert upsert(lease, [[7_000_031, "1.5"]], []) == {"table": "demo_destination", "rows": 1}
    assert WalEntry.objects.filter(task=task, status="done").count() == 1


@pytest.mark.parametrize("point", ["before_intent", "during_effect", "after_intent"])
def test_a_crash_before_the_record_leaves_nothing_and_the_retry_writes_it_once(point, monkeypatch):
    task = services.task_create(type="demo.migrate_rows", params={"rows": 100, "batch_size": 50, "rate": 1.0})
    lease = leases.claim(task.pk)
    monkeypatch.setenv("ORCH_FAULTS", f"{point}:raise")
    # Raised inside the tool (the transaction's way, SQLite), during_effect is the tool's failure.
    with pytest.raises((InjectedFault, EffectFailed)):
        upsert(lease, [[7_000_041, "1.5"]], [])
    assert not DemoDestination.objects.filter(pk=7_000_041).exists()
    assert not WalEntry.objects.filter(task=task).exists()
    monkeypatch.delenv("ORCH_FAULTS")
    assert upsert(lease, [[7_000_041, "2.5"]], []) == {"table": "demo_destination", "rows": 1}
    assert list(DemoDestination.objects.filter(pk=7_000_041).values_list("amount", flat=True)) == [2.5]
    assert WalEntry.objects.filter(task=task, status="done").count() == 1
