"""Recoveries that take too long: a task whose recovery began more than
ORCH_RECOVERY_TIMEOUT_SECONDS ago and that no runner has got going again becomes
`needs_human` (engine/recovery.py's sweep calls this on every pass)."""
import logging
from datetime import timedelta

from django.db import transaction
from django.utils import timezone

from ..conf import harness
from ..models import Task, TaskStatus as S
from . import states

log = logging.getLogger("orchestrator.engine.recovery")  # the recovery's lines keep its logger


def give_up_slow_recoveries(now=None) -> list[int]:
    """Recoveries that did not get their task running again within the timeout: needs_human."""
    now = now or timezone.now()
    timeout = harness.recovery_timeout_seconds
    cutoff = now - timedelta(seconds=timeout)
    handed = []
    recovering = Task.objects.filter(recovering_since__lt=cutoff, status__in=(S.QUEUED, S.RUNNING))
    for task_id in recovering.values_list("pk", flat=True)[:500]:
        with transaction.atomic():
            task = recovering.select_for_update(skip_locked=True).filter(pk=task_id).first()
            if task is None:
                continue
            extra = {"task_id": task.pk, "checkpoint_version": task.checkpoint_version, "event_id": task.event_seq,
                     "recovery_attempt": task.recovery_attempts, "resume_strategy": "needs_human"}
            last = task.events.filter(kind="recovery").order_by("-seq").values_list("payload", flat=True).first()
            cause = (last or {}).get("cause", "unknown cause")
            waited = (now - task.recovering_since).total_seconds()
            states.transition(
                task, S.NEEDS_HUMAN, action="recovery", lease_owner="", lease_epoch=task.lease_epoch + 1,
                recovering_since=None,
                reason=f"recovery timed out: not running again {waited:.0f} s after it began "
                       f"(ORCH_RECOVERY_TIMEOUT_SECONDS={timeout:g}; {task.recovery_attempts} attempt(s); "
                       f"last cause: {cause})")
            handed.append(task.pk)
            extra["event_id"] = task.event_seq  # the status event just written
        log.warning("recovery timed out: needs a human", extra=extra)
    return handed
