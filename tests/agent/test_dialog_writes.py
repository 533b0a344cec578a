"""How an agent's steps write their dialog rows (issue 24: the harness's statements per step):
each row is one INSERT … ON CONFLICT inside its fenced transaction, and a turn's answer, its
ledger row and the end of its attempt commit together."""
import threading

import pytest
from django.db import connection, connections
from django.db.backends.signals import connection_created

from orchestrator.agent import history
from orchestrator.engine import services
from orchestrator.engine.worker import drive_inline
from orchestrator.models import AgentMessage, ModelCallAttempt, Task
from tests.support.helpers import standin_for_this_process

pytestmark = pytest.mark.django_db(transaction=True)

GOAL = "Parse the 3 contracts and remember the summary"
TOOLS = ["contracts_list", "contracts_read", "memory_write"]


@pytest.fixture
def model(settings):
    with standin_for_this_process(settings, token_seconds=0) as server:
        yield server


class Statements:
    """Every SQL statement of every connection (the runner's pool threads have their own)."""

    def __init__(self):
        self.seen: list[str] = []
        self._lock = threading.Lock()

    def wrapper(self, execute, sql, params, many, context):
        with self._lock:
            self.seen.append(sql)
        return execute(sql, params, many, context)

    def attach(self, sender=None, connection=None, **kwargs):
        if self.wrapper not in connection.execute_wrappers:
            connection.execute_wrappers.append(self.wrapper)


def test_dialog_rows_are_written_without_a_savepoint_or_a_locking_read_of_the_dialog(model):
    statements = Statements()
    connection_created.connect(statements.attach)
    for open_connection in connections.all():
        statements.attach(connection=open_connection)
    try:
        task = services.task_create(type="agent.plan_execute", params={"goal": GOAL, "tools": TOOLS})
        assert drive_inline(task.pk, watched=True) == "completed"
    finally:
        connection_created.disconnect(statements.attach)
        for open_connection in connections.all():
            if statements.wrapper in open_connection.execute_wrappers:
                open_connection.execute_wrappers.remove(statements.wrapper)
    rows = AgentMessage.objects.filter(task=task)
    assert rows.filter(role="tool").count() >= 3 and rows.filter(role="assistant").count() >= 2
    dialog = [s for s in statements.seen if '"orchestrator_agentmessage"' in s]
    inserts = [s for s in dialog if s.lstrip().upper().startswith("INSERT")]
    upserts = [s for s in inserts if "ON CONFLICT" in s.upper()]
    attempts_made = ModelCallAttempt.objects.filter(task=task, purpose="turn").count()
    if connection.vendor == "postgresql":
        # One statement per write: a tool result inside its step's commit statement; a model
        # call's attempt row with its fence; an answer with its ledger row and its attempt's
        # removal, with its fence (rows_at_commit.write_fenced); the opening two rows.
        in_commit = [s for s in dialog if "SET checkpoint_version" in s]
        fenced = [s for s in dialog if s.startswith("WITH t AS (SELECT id FROM orchestrator_task")]
        attempts = [s for s in fenced if "ON CONFLICT" not in s and "DELETE" not in s]
        answers = [s for s in fenced if "ON CONFLICT" in s and "DELETE FROM" in s
                   and "orchestrator_modelcallattempt" in s]
        assert len(in_commit) == rows.filter(role="tool").count()
        assert len(attempts) == attempts_made
        assert len(answers) == rows.filter(role="assistant", interrupted=False).count()
        assert len(fenced) == len(attempts) + len(answers)
        assert len(upserts) == 2 and not [s for s in inserts if s not in upserts]  # system prompt and goal
    else:
        # In transactions: a row by its key is one INSERT … ON CONFLICT (the opening two, each
        # answer, each tool result in its step's checkpoint); a model call's attempt row, new
        # each time, is a plain INSERT.
        assert len(upserts) == rows.exclude(key__contains=":attempt:").count()
        assert len(inserts) - len(upserts) == attempts_made
    # update_or_create read each row FOR UPDATE inside a savepoint first: neither is left.
    assert not [s for s in dialog if s.lstrip().upper().startswith("SELECT") and "FOR UPDATE" in s.upper()]
    assert not [s for s in statements.seen if s.lstrip().upper().startswith("SAVEPOINT")]


def test_a_turn_whose_answer_cannot_be_written_leaves_its_attempt_counted_lost_not_completed(model, monkeypatch):
    """The answer, its ledger row and the attempt's removal are one transaction: when the answer's
    row fails, nothing of it stays — no `completed` row for an answer the dialog does not hold; the
    attempt row stays, and the step's retry counts it lost, so every billed call is counted once."""
    real_row = history.row
    failed = []

    def row(task_id, key, **fields):
        if fields.get("role") == AgentMessage.Role.ASSISTANT and key.startswith("turn-001") and not failed:
            failed.append(key)
            # A value its column refuses (turn is a PositiveIntegerField: a CHECK constraint on
            # both databases): the database itself refuses the answer's write, after the fence
            # held and with the ledger row and the attempt's removal in the same write.
            fields["turn"] = -1
        return real_row(task_id, key, **fields)

    monkeypatch.setattr(history, "row", row)
    task = services.task_create(type="agent.plan_execute", params={"goal": GOAL, "tools": TOOLS})
    assert drive_inline(task.pk) == "completed", Task.objects.get(pk=task.pk).status_reason
    assert failed == ["turn-001:g0"]
    first_turn = list(ModelCallAttempt.objects.filter(task=task, step_id="turn-001").order_by("id"))
    assert [r.outcome for r in first_turn] == ["lost", "completed"]
    assert first_turn[0].prompt_tokens > 0 and first_turn[0].estimated
    # The attempt rows are all accounted; the dialog holds one answer for the turn.
    assert not AgentMessage.objects.filter(task=task, interrupted=True, accounted=False).exists()
    assert AgentMessage.objects.filter(task=task, turn=1, role="assistant", interrupted=False).count() == 1
    # Every request the stand-in received is one ledger row, and the task counted them all.
    rows = list(ModelCallAttempt.objects.filter(task=task))
    assert len(rows) == len(model.billing)
    assert Task.objects.get(pk=task.pk).tokens_used == sum(r.prompt_tokens + r.completion_tokens for r in rows)
