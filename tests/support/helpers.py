"""Helpers the tests share (instead of a copy per file)."""
import contextlib
import re
import subprocess
from pathlib import Path

from django.conf import settings

from orchestrator.models import Task, TaskEvent, WalEntry
from tests.conftest import wait_for

SETTLED = ("completed", "awaiting_review", "failed", "needs_human")


def bearer(user, **token_options) -> dict:
    """Request headers that authenticate as `user` with a fresh API token."""
    from orchestrator.auth import token_issue

    return {"HTTP_AUTHORIZATION": f"Bearer {token_issue(user=user, **token_options)}"}


def settle(task_id: int, timeout: float = 60) -> Task:
    """Wait until the task stops moving by itself (done, failed, or waiting for a person)."""
    wait_for(lambda: Task.objects.get(pk=task_id).status in SETTLED, timeout=timeout, message="the task to settle")
    return Task.objects.get(pk=task_id)


def drive_and_close(task_id: int) -> None:
    """drive_inline for a thread of its own: its database connection is closed after (else
    PostgreSQL's test teardown waits on it)."""
    from django.db import connection

    from orchestrator.engine.worker import drive_inline

    try:
        drive_inline(task_id)
    finally:
        connection.close()


def preempt_during(monkeypatch, type_name: str):
    """`arm(step_id, payload)`: when the task type's `step_id` starts, send a preempt from inside
    the run; once the runner's supervisor has seen it (the step's token is cancelled), the step
    goes on and is interrupted. Returns the list the sent event lands in."""
    from orchestrator.engine import inbox
    from orchestrator.tasktypes import get_type

    task_type = type(get_type(type_name))
    real = task_type.run_step
    sent = []

    def arm(step_id: str, payload: dict):
        def run_step(self, ctx, current):
            if current == step_id and not sent:
                sent.append(inbox.send(task_id=ctx.task_id, type="preempt", payload=payload, source="operator"))
                wait_for(lambda: ctx._runner.preempting, timeout=10, message="the preempt seen")
            return real(self, ctx, current)

        monkeypatch.setattr(task_type, "run_step", run_step)
        return sent

    return arm


def one_effect(tool: str, args: dict, **params) -> Task:
    """A test.one_effect task (tests/support/probe_types.py: three steps, the middle one performs
    `tool` with `args`), run inline to its end."""
    from orchestrator.engine import services
    from orchestrator.engine.worker import drive_inline

    task = services.task_create(type="test.one_effect", params={"tool": tool, "args": args, **params})
    drive_inline(task.pk)
    return Task.objects.get(pk=task.pk)


def done_order(task_id: int) -> list[str]:
    """The task's steps in the order they were done (their step_done events)."""
    return list(TaskEvent.objects.filter(task_id=task_id, kind="step_done").order_by("seq")
                .values_list("payload__step", flat=True))


def stage_processes(task_id: int) -> list[str]:
    """demo.pipeline's living stage subprocesses of the task: `python <VAR_DIR>/pipeline/task-N/stage-KK.py ...`
    (VAR_DIR is this pytest process's own: task ids repeat across the suite's processes)."""
    pattern = re.escape(str(Path(settings.VAR_DIR) / "pipeline" / f"task-{task_id}" / "stage-"))
    out = subprocess.run(["pgrep", "-af", pattern], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "pgrep" not in line]


def write_intent(*, lease, step_id: str, call_index: int, tool_name: str, args: dict, key: str,
                 idempotent: bool) -> WalEntry:
    """Commit a WAL intent on its own, fenced on the lease (LeaseLost if it is stale), as a
    worker does before an effect outside this database: the state a worker killed between its
    intent and its effect leaves behind."""
    from django.db import transaction

    from orchestrator.engine.lease import bump_fenced
    from orchestrator.engine.wal import new_entry

    with transaction.atomic():
        bump_fenced(lease)  # a worker whose lease is stale writes no intent
        return new_entry(lease, step_id, call_index, tool_name, args, key, idempotent)


@contextlib.contextmanager
def standin_for_this_process(settings, *, model: str = "standin-planner", token_seconds: float = 0.0005,
                             **overrides):
    """The stand-in model server, and this process's settings pointing at it (the agents a test
    drives in-process, `drive_inline`, talk to it); `overrides` are more settings."""
    from orchestrator.llm.standin import StandinServer

    with StandinServer(token_seconds=token_seconds) as server:
        settings.LLM_BASE_URL, settings.LLM_API_KEY, settings.LLM_MODEL = server.base_url, "standin", model
        for name, value in overrides.items():
            setattr(settings, name, value)
        yield server


# The demo's contracts goal for an agent, and the tools it needs: the safe default has no
# email_send (a side effect must be named), and its approval is waived (the installation itself
# creates these tasks: actor None).
CONTRACTS_GOAL = "Parse the 5 contracts and email a summary to ops@example.org"
CONTRACTS_TOOLS = {"tools": ["contracts_list", "contracts_read", "memory_search", "email_send"],
                   "approval_waived": ["email_send"]}


def terminate_this_threads_session() -> None:
    """What a database restart does to this thread's PostgreSQL connection: its server process
    ends, ended by another session (the client sees it only at its next statement)."""
    import psycopg
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        pid = cursor.fetchone()[0]
    with psycopg.connect(**connection.get_connection_params(), autocommit=True) as other:
        other.execute("SELECT pg_terminate_backend(%s)", [pid])
