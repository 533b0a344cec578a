"""The entry point a django-q2 worker runs for a task."""
import logging

from .. import telemetry
from ..conf import harness
from ..outage import check_connection_if_idle, retry_while_down
from . import scheduler
from .lease import claim, claim_for_delivery
from .runner import Runner
from .executor import run_isolated

log = logging.getLogger(__name__)


@telemetry.traced_drive
def drive_task(task_id: int) -> str:
    # Health-checked if it sat idle: a worker taking messages back to back does not ping the
    # database before each (a session broken meanwhile fails the claim, retried on a new one).
    check_connection_if_idle()
    # A task being recovered runs before the one this message names, which may have waited
    # behind a long queue while the recovered task's own message is at its back (a dead
    # host's tasks would run again only once every queued task had had its turn): see
    # lease.claim_for_delivery. The named task is not dropped: it is sent again, to the front
    # (its message had waited its turn).
    lease = retry_while_down(lambda: claim_for_delivery(task_id), seconds=harness.database_retry_seconds,
                             logger=log, what="the claim", extra={"task_id": task_id})
    if lease is not None and lease.task_id != task_id:
        scheduler.send_again(task_id)
    if lease is None:
        # Another worker holds a live lease, or the task is no longer runnable: a
        # duplicate delivery is harmless.
        return "not claimed"
    if harness.isolate_execution:
        return run_isolated(lease)
    return Runner(lease).run()


def drive_inline(task_id: int, *, watched: bool = False) -> str:
    """Claim and run a task in this process and thread (tests, benchmarks, debugging).

    `watched=True` runs it as an isolated executor does (a step that runs alone runs on the
    runner's thread), without the watchdog that would enforce a Stop's grace period."""
    lease = claim(task_id)
    return "not claimed" if lease is None else Runner(lease, watched=watched).run()
