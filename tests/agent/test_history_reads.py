"""The dialog reads every turn and every tool call make, written out in SQL for speed (issue 24:
the agent's harness overhead): they must say what the ORM's queries said. Rows of a stale
generation, user messages (no step), a summary of the current or of a stale generation."""
import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from orchestrator.agent import compaction, history
from orchestrator.models import AgentMessage, Step, Task, WalEntry

pytestmark = pytest.mark.django_db(transaction=True)

Role = AgentMessage.Role


def a_task_with_a_dialog() -> Task:
    """Turn 1 answered (generation 1; an answer of generation 0 left by a rolled-back run), its
    two tool results, a user message sent after the answer, and turn 2's answer."""
    task = Task.objects.create(type="agent.plan_execute", params={"goal": "g", "tools": []})
    for position, (step_id, generation) in enumerate((("turn-001", 1), ("tool-001-1", 1), ("tool-001-2", 1),
                                                     ("turn-002", 0), ("compact-002", 3))):
        Step.objects.create(task=task, step_id=step_id, position=position, generation=generation)

    def row(key, turn, order, role, step_id="", generation=0, **fields):
        return AgentMessage.objects.create(task=task, key=key, turn=turn, order=order, role=role, step_id=step_id,
                                           generation=generation, content=fields.pop("content", key), **fields)

    row("system", 0, 0, Role.SYSTEM, "turn-001", 1)
    row("goal", 0, 1, Role.USER, "turn-001", 1)
    row("turn-001:g0", 1, 0, Role.ASSISTANT, "turn-001", 0)  # the rolled-back run's answer
    row("turn-001:g1", 1, 0, Role.ASSISTANT, "turn-001", 1,
        tool_calls=[{"id": "c1", "name": "x", "arguments": "{}", "step": "tool-001-1"},
                    {"id": "c2", "name": "x", "arguments": "{}", "step": "tool-001-2"}])
    row("tool-001-2:g1", 1, 2, Role.TOOL, "tool-001-2", 1, tool_call_id="c2")
    row("tool-001-1:g1", 1, 1, Role.TOOL, "tool-001-1", 1, tool_call_id="c1")
    row("user:1", 1, history.USER_ORDER + 1, Role.USER, content="also check the dates")
    row("turn-002:g0", 2, 0, Role.ASSISTANT, "turn-002", 0, content="done")
    return task


def keys(rows) -> list[str]:
    return [r.key for r in rows]


def test_with_no_summary_the_rows_sent_are_the_current_ones_in_order_read_in_one_query():
    task = a_task_with_a_dialog()
    with CaptureQueriesContext(connection) as queries:
        summary, rows = history.sendable(task.pk, 3)
    assert len(queries) == 1
    assert summary is None
    assert keys(rows) == keys(history.current(task.pk)) == [
        "system", "goal", "turn-001:g1", "tool-001-1:g1", "tool-001-2:g1", "user:1", "turn-002:g0"]
    assert rows[2].tool_calls[1]["step"] == "tool-001-2" and rows[2].pk and not rows[2]._state.adding


def test_a_summary_before_the_turn_is_sent_with_what_it_does_not_hide_and_a_stale_one_is_not():
    task = a_task_with_a_dialog()
    last = AgentMessage.objects.get(task=task, key="tool-001-1:g1")  # the last row of turn 1 before the message
    of = {"first_turn": 1, "last_turn": 1, "last_message_id": last.pk, "digest": "", "messages": 3}
    stale = AgentMessage.objects.create(task=task, key="compact-002:g2", turn=2, order=500, role=Role.SUMMARY,
                                        step_id="compact-002", generation=2, content="stale", summary_of=of)
    # A summary of a rolled-back compaction is not a summary: every current row is sent.
    summary, rows = history.sendable(task.pk, 3)
    assert summary is None and stale.key not in keys(rows)
    assert keys(rows) == keys(history.current(task.pk))
    AgentMessage.objects.create(task=task, key="compact-002:g3", turn=2, order=500, role=Role.SUMMARY,
                                step_id="compact-002", generation=3, content="turn 1 in short", summary_of=of)
    summary, rows = history.sendable(task.pk, 3)
    assert summary.key == "compact-002:g3"
    expected = [r for r in history.current(task.pk) if not compaction.hidden_by(summary, r)]
    assert keys(rows) == keys(expected)
    assert "tool-001-1:g1" not in keys(rows) and "user:1" in keys(rows)  # sent after the answer it summarised
    # For turn 2 the summary (turn 2) is not yet there: every current row.
    assert history.sendable(task.pk, 2)[0] is None


def test_a_tool_calls_state_is_what_the_orm_queries_said():
    task = a_task_with_a_dialog()
    WalEntry.objects.create(task=task, step_id="tool-001-1", call_index=0, tool="x", idempotency_key="k1",
                            idempotent=False, lease_epoch=1)
    with CaptureQueriesContext(connection) as queries:
        state = history.call_state(task.pk, "tool-001-1", 1)
    assert len(queries) == 1
    assert state == (True, True) and history.superseded(task.pk, 1)  # the user message came after turn 1's answer
    assert history.call_state(task.pk, "tool-001-2", 1) == (False, True)
    # Turn 2's answer (generation 0) came after the message: nothing supersedes turn 2, nor turn 3 (no answer).
    for turn in (2, 3):
        assert history.call_state(task.pk, "tool-00x-1", turn) == (False, history.superseded(task.pk, turn)) \
            == (False, False)
    # Interrupted answers are not answers: a message after one still counts from the last whole answer.
    AgentMessage.objects.create(task=task, key="turn-002:attempt", turn=2, order=0, role=Role.ASSISTANT,
                                interrupted=True, step_id="turn-002", content="half")
    AgentMessage.objects.create(task=task, key="user:2", turn=2, order=history.USER_ORDER + 2, role=Role.USER,
                                content="stop")
    assert history.call_state(task.pk, "tool-002-1", 2) == (False, history.superseded(task.pk, 2)) == (False, True)
