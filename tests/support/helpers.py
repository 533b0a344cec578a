"""Helpers the tests share (instead of a copy per file)."""
from orchestrator.models import Task
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
