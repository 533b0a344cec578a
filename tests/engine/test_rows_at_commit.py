"""Rows a step keeps with its checkpoint (ctx.write_at_commit, engine/rows_at_commit.py): written
by the step's commit, in its transaction — on PostgreSQL inside the one commit statement — so a
step that does not commit leaves none of them, and its next run writes them again."""
import threading

import pytest
from django.db import connections
from django.db.backends.signals import connection_created

from orchestrator.engine import services
from orchestrator.engine.worker import drive_inline
from orchestrator.models import AgentMessage, Task
from tests.support.testtypes import Diamond

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def types(settings):
    settings.ORCH_EXTRA_TASK_TYPES = ["tests.support.testtypes"]


def note(ctx, key: str, content: str, **more):
    ctx.write_at_commit(AgentMessage, unique=("task", "key"), task_id=ctx.task_id, key=key, turn=1,
                        role=AgentMessage.Role.TOOL, content=content, step_id=ctx.step_id, **more)


def rows(task) -> dict[str, tuple]:
    return {m.key: (m.content, m.name, m.step_id) for m in AgentMessage.objects.filter(task=task)}


def test_rows_land_with_their_steps_checkpoint_and_a_later_write_of_a_key_updates_only_what_it_gives(monkeypatch):
    seen_before_commit = {}

    def run_step(self, ctx, step_id):
        if step_id == "a":
            note(ctx, "k1", "draft", name="first")
            note(ctx, "k1", "final", name="kept")  # the same key again in the step: the last write wins
            note(ctx, "k2", "other")
            seen_before_commit["a"] = AgentMessage.objects.filter(task_id=ctx.task_id).exists()
        if step_id == "b":
            # A later step overwrites k1's content; `name`, not given, stays as it was.
            ctx.write_at_commit(AgentMessage, unique=("task", "key"), task_id=ctx.task_id, key="k1", turn=1,
                                role=AgentMessage.Role.TOOL, content="by b")
        return step_id

    monkeypatch.setattr(Diamond, "run_step", run_step)
    task = services.task_create(type="test.diamond", params={})
    assert drive_inline(task.pk) == "completed"
    assert seen_before_commit == {"a": False}  # nothing is written before the step's checkpoint
    assert rows(task) == {"k1": ("by b", "kept", "a"), "k2": ("other", "", "a")}


def test_a_row_with_nothing_but_its_key_is_refused_at_the_call():
    from orchestrator.engine.context import StepContext

    ctx = StepContext(task_id=1, step_id="a", params=Diamond.Params(), deps={}, lease=None, token=None)
    with pytest.raises(ValueError, match="give a field besides its unique ones"):
        ctx.write_at_commit(AgentMessage, unique=("task", "key"), task_id=1, key="k")
    assert ctx.rows_at_commit == []


def test_a_step_that_fails_after_writing_leaves_no_row_and_its_retry_writes_it(monkeypatch):
    attempts = []

    def run_step(self, ctx, step_id):
        if step_id == "a":
            attempts.append(AgentMessage.objects.filter(task_id=ctx.task_id, key="k1").exists())
            note(ctx, "k1", f"attempt {len(attempts)}")
            if len(attempts) == 1:
                raise ConnectionError("upstream timed out")  # after the write: the step does not commit
        return step_id

    monkeypatch.setattr(Diamond, "run_step", run_step)
    task = services.task_create(type="test.diamond", params={})
    assert drive_inline(task.pk) == "completed", Task.objects.get(pk=task.pk).status_reason
    assert attempts == [False, False]  # the failed attempt left no row for its retry to find
    assert rows(task) == {"k1": ("attempt 2", "", "a")}


def test_a_step_whose_lease_was_taken_writes_no_row(monkeypatch):
    def run_step(self, ctx, step_id):
        note(ctx, f"row-{step_id}", "written by a worker that lost its lease")
        if step_id == "a":  # another worker claimed the task meanwhile
            Task.objects.filter(pk=ctx.task_id).update(lease_epoch=ctx.lease.epoch + 1)
        return step_id

    monkeypatch.setattr(Diamond, "run_step", run_step)
    task = services.task_create(type="test.diamond", params={}, limits={"max_subtasks": 1})
    assert drive_inline(task.pk) == "lease lost"
    assert not AgentMessage.objects.filter(task=task, key="row-a").exists()


def test_on_postgresql_the_rows_are_part_of_the_one_commit_statement(monkeypatch):
    from django.db import connection

    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL's one commit statement (SQLite writes them in the commit's transaction)")
    statements, lock = [], threading.Lock()

    def wrapper(execute, sql, params, many, context):
        with lock:
            statements.append(sql)
        return execute(sql, params, many, context)

    def attach(sender=None, connection=None, **kwargs):
        if wrapper not in connection.execute_wrappers:
            connection.execute_wrappers.append(wrapper)

    def run_step(self, ctx, step_id):
        if step_id == "d":
            # The fields an agent's tool result gives (PlanExecuteAgent._tool_call).
            note(ctx, "k", "with the checkpoint", order=1, tool_call_id="call_1", name="contracts_read", generation=0)
        return step_id

    monkeypatch.setattr(Diamond, "run_step", run_step)
    task = services.task_create(type="test.diamond", params={}, limits={"max_subtasks": 1})
    connection_created.connect(attach)
    for open_connection in connections.all():
        attach(connection=open_connection)
    try:
        assert drive_inline(task.pk) == "completed"
    finally:
        connection_created.disconnect(attach)
        for open_connection in connections.all():
            if wrapper in open_connection.execute_wrappers:
                open_connection.execute_wrappers.remove(wrapper)
    touching = [s for s in statements if '"orchestrator_agentmessage"' in s]
    assert len(touching) == 1 and "UPDATE orchestrator_step SET status = 'done'" in touching[0], touching
    assert rows(task) == {"k": ("with the checkpoint", "contracts_read", "d")}
    # Within what psycopg converts once and caches (its placeholders): a longer statement is
    # converted again on every step (~0.6 ms of Python for this one, at 4,336 bytes).
    import psycopg._queries

    assert len(touching[0].encode()) <= psycopg._queries.MAX_CACHED_STATEMENT_LENGTH


def test_a_fenced_write_lands_whole_or_not_at_all_and_never_under_a_stale_lease():
    """rows_at_commit.write_fenced (outside a checkpoint: an agent's attempt row, a turn's answer
    with its ledger row): the fence, the probe (read before the writes), the rows and the
    deletions in one statement on PostgreSQL, one transaction on SQLite."""
    from django.db import IntegrityError

    from orchestrator.engine import lease as leases, rows_at_commit
    from orchestrator.engine.lease import LeaseLost
    from orchestrator.models import ModelCallAttempt

    task = services.task_create(type="test.diamond", params={})
    lease = leases.claim(task.pk)
    count = ("(SELECT count(*) FROM orchestrator_agentmessage WHERE task_id = %(probe_task)s)", {"probe_task": task.pk})

    def message(key, **more):
        return rows_at_commit.RowAtCommit(AgentMessage, ("task", "key"), {
            "task_id": task.pk, "key": key, "turn": 1, "role": "assistant", "content": key, **more})

    def ledger():
        return rows_at_commit.RowAtCommit(ModelCallAttempt, (), {
            "task_id": task.pk, "step_id": "a", "outcome": "completed", "prompt_tokens": 5})

    keys, probed = rows_at_commit.write_fenced(lease, [message("k1"), ledger()], probe=count)
    assert probed == 0 and keys[0] is None and ModelCallAttempt.objects.get(pk=keys[1]).prompt_tokens == 5
    first = AgentMessage.objects.get(task=task, key="k1")
    keys, probed = rows_at_commit.write_fenced(lease, [message("k2")], deleted=((AgentMessage, first.pk),), probe=count)
    assert probed == 1 and set(rows(task)) == {"k2"}
    # A row the database refuses: nothing of the write lands (the ledger row, the deletion).
    k2 = AgentMessage.objects.get(task=task, key="k2")
    with pytest.raises(IntegrityError):
        rows_at_commit.write_fenced(lease, [ledger(), message("k3", turn=-1)], deleted=((AgentMessage, k2.pk),))
    assert set(rows(task)) == {"k2"} and ModelCallAttempt.objects.filter(task=task).count() == 1
    # Another worker took the task: the stale holder writes nothing.
    Task.objects.filter(pk=task.pk).update(lease_epoch=lease.epoch + 1)
    with pytest.raises(LeaseLost):
        rows_at_commit.write_fenced(lease, [message("k4"), ledger()], deleted=((AgentMessage, k2.pk),))
    assert set(rows(task)) == {"k2"} and ModelCallAttempt.objects.filter(task=task).count() == 1
    with pytest.raises(ValueError, match="unique"):  # a step's own rows are found again by their key
        rows_at_commit.keep([], ledger())
