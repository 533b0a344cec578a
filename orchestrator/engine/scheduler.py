"""Hands tasks to the worker cluster (django-q2) — only after the transaction commits, so
a worker never looks for a task that is not there yet."""
import logging

from django.db import transaction

log = logging.getLogger(__name__)

DRIVE = "orchestrator.engine.worker.drive_task"


def enqueue(task_id: int) -> None:
    def send():
        from django_q.tasks import async_task

        async_task(DRIVE, task_id, task_name=f"task-{task_id}", group="orchestrator")

    transaction.on_commit(send)
