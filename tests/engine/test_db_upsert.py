"""db.upsert writes as bulk_create(update_conflicts=True) did (orchestrator/tools/db.py): rows
inserted, then updated by primary key; columns not given at their model defaults, an auto_now
column at the time of the write; more rows than one statement takes; a row whose values do not
match the columns is refused before anything is written, saying which."""
from decimal import Decimal

import pytest
from django.db import transaction

from demo.models import DemoDestination
from orchestrator.models import AgentMemory
from orchestrator.tools.base import ToolError
from orchestrator.tools.catalog import get_tool

pytestmark = pytest.mark.django_db(transaction=True)


class NeverCancelled:
    def raise_if_cancelled(self):
        pass


def upsert(args: dict) -> dict:
    tool = get_tool("db.upsert")
    tool.validate(args)
    with transaction.atomic():
        return tool.perform(args, key="test-key", token=NeverCancelled())


def test_rows_are_inserted_then_updated_by_primary_key_in_batches():
    rows = [[i, f"{i}.5000"] for i in range(1, 1201)]  # more than one statement's 500 rows
    assert upsert({"table": "demo_destination", "columns": ["id", "amount"], "rows": rows}) == {
        "table": "demo_destination", "rows": 1200}
    assert DemoDestination.objects.count() == 1200
    assert DemoDestination.objects.get(pk=1200).amount == Decimal("1200.5")
    upsert({"table": "demo_destination", "columns": ["id", "amount"], "rows": [[7, "0.2500"], [5000, "1"]]})
    assert DemoDestination.objects.get(pk=7).amount == Decimal("0.25")  # updated, not duplicated
    assert DemoDestination.objects.count() == 1201


def test_columns_not_given_take_their_defaults_and_auto_now_the_time_of_the_write():
    upsert({"table": "agent_memory", "columns": ["key", "value"], "rows": [["scope:k", "first"]]})
    first = AgentMemory.objects.get(pk="scope:k")
    assert (first.value, first.step_id, first.task_id) == ("first", "", None)
    assert first.updated_at is not None
    upsert({"table": "agent_memory", "columns": ["key", "value", "step_id"], "rows": [["scope:k", "second", "s1"]]})
    second = AgentMemory.objects.get(pk="scope:k")
    assert (second.value, second.step_id) == ("second", "s1")


def test_a_row_that_does_not_match_the_columns_is_refused_saying_which():
    args = {"table": "demo_destination", "columns": ["id", "amount"], "rows": [[1, "1"], [2]]}
    with pytest.raises(ToolError, match=r"row 1 has 1 values for 2 columns"):
        get_tool("db.upsert").validate(args)
    assert not DemoDestination.objects.exists()
