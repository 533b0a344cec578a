"""PostgreSQL: the statements the engine runs on every step (the step commit, a transactional
effect's record) are prepared once per connection (engine/prepared.py), and nothing is prepared
with ORCH_PREPARE_STEP_COMMIT off (for a pooler that does not keep prepared statements). Django's
own queries are never prepared (they bind on the client)."""
import pytest
from django.db import connection

from bench.measure import run_task

pytestmark = pytest.mark.django_db(transaction=True)


def prepared_statements() -> list[str]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement FROM pg_prepared_statements")
        return [row[0] for row in cursor.fetchall()]


@pytest.mark.parametrize("prepare", [True, False])
def test_the_step_commit_and_an_effect_record_are_prepared_unless_turned_off(prepare, settings):
    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL's prepared statements")
    settings.ORCH_EXTRA_TASK_TYPES = ["bench.benchtypes"]
    settings.ORCH_PREPARE_STEP_COMMIT = prepare
    connection.close()  # a fresh session: nothing prepared yet
    run_task("bench.chain", {"steps": 3, "effect": True})
    statements = prepared_statements()
    if prepare:
        assert len(statements) == 2, statements
        assert any("step_done" in s for s in statements)  # the step commit
        # The effect with its record (one statement: the upsert, the entry `done`, the key).
        assert any("step_done" not in s and "orchestrator_walentry" in s and "e AS (INSERT" in s for s in statements)
    else:
        assert statements == []
