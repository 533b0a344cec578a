"""The audit log: every operator and reviewer action, written in the action's transaction
(shown in the admin; never pruned)."""
from ..models import AuditEntry, Task


def entry_fields(*, action: str, actor=None, ip: str | None = None, task: Task | None = None,
                 before=None, after=None, reason: str = "") -> dict:
    """An entry's fields: the actor's user when signed in (an anonymous or absent one is the
    system's), its name, or "system"."""
    return {"actor": actor if getattr(actor, "is_authenticated", False) else None,
            "actor_name": getattr(actor, "username", "") or "system", "ip": ip, "action": action, "task": task,
            "before": before, "after": after, "reason": reason}


def audit(*, action: str, actor=None, ip: str | None = None, task: Task | None = None,
          before=None, after=None, reason: str = "") -> AuditEntry:
    return AuditEntry.objects.create(**entry_fields(action=action, actor=actor, ip=ip, task=task, before=before,
                                                    after=after, reason=reason))
