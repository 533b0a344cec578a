"""The entry point a django-q2 worker runs for a task."""
import logging

from django.db import close_old_connections

from .lease import claim
from .runner import Runner

log = logging.getLogger(__name__)


def drive_task(task_id: int) -> str:
    close_old_connections()
    lease = claim(task_id)
    if lease is None:
        # Another worker holds a live lease, or the task is no longer runnable: a
        # duplicate delivery is harmless.
        return "not claimed"
    return Runner(lease).run()
