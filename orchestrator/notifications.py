"""Telling people that a task needs them: an email to the operators group (best effort;
the dashboard's badge is the reliable signal)."""
import logging

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.mail import send_mail

from .models import Task
from .roles import OPERATOR

log = logging.getLogger(__name__)


def operator_emails() -> list[str]:
    User = get_user_model()
    return sorted({u.email for u in User.objects.filter(is_active=True, groups__name=OPERATOR) if u.email})


def notify_needs_human(task_id: int) -> int:
    task = Task.objects.filter(pk=task_id).first()
    recipients = operator_emails()
    if task is None or not recipients:
        return 0
    base = settings.ORCH_PUBLIC_URL.rstrip("/")
    body = (f"Task #{task.pk} ({task.type}) needs a human.\n\nReason: {task.status_reason}\n\n"
            f"Open it: {base}/tasks/{task.pk}/\nFull context (JSON): {base}/api/tasks/{task.pk}/export\n")
    try:
        return send_mail(f"[orchestrator] task #{task.pk} needs a human", body, settings.DEFAULT_FROM_EMAIL,
                         recipients, fail_silently=False)
    except Exception:
        log.warning("could not email the operators", exc_info=True, extra={"task_id": task_id})
        return 0
