"""A task's history: its WAL, kept snapshots, events (resumable by seq), audit trail, and
everything at once as one JSON document (export)."""
import json

from django.core.serializers.json import DjangoJSONEncoder
from ninja import Router

from .. import roles, selectors
from ..engine import snapshots
from ..models import AuditEntry, WalEntry
from .auth import require
from .common import FOUND, get_task, id_param, responses
from .presenters import audit_out
from .schemas import AuditOut, SnapshotOut, WalOut

router = Router(tags=["history"])
SNAPSHOTS_RETURNED = 50


@router.get("/tasks/{task_id}/wal", response=responses({200: list[WalOut]}, FOUND))
def task_wal(request, task_id: int = id_param("a task id")):
    require(request, roles.VIEWER)
    task = get_task(task_id)
    return list(WalEntry.objects.filter(task=task).order_by("id"))


@router.get("/tasks/{task_id}/snapshots", response=responses({200: list[SnapshotOut]}, FOUND))
def task_snapshots(request, task_id: int = id_param("a task id")):
    """The newest kept versions (at most 50), newest first, each with its full state."""
    require(request, roles.VIEWER)
    task = get_task(task_id)
    return [{"version": snap.version, "step_id": snap.step_id, "state": state, "created_at": snap.created_at}
            for snap, state in snapshots.history(task.pk, SNAPSHOTS_RETURNED)]


@router.get("/tasks/{task_id}/audit", response=responses({200: list[AuditOut]}, FOUND))
def task_audit(request, task_id: int = id_param("a task id")):
    require(request, roles.VIEWER)
    task = get_task(task_id)
    return [audit_out(a) for a in AuditEntry.objects.filter(task=task).order_by("at", "id")]


@router.get("/tasks/{task_id}/export", response=responses({200: dict}, FOUND))
def task_export(request, task_id: int = id_param("a task id")):
    """Everything about a task in one JSON document (task, steps, WAL, last snapshot,
    events, audit, reviews) — what a human needs to investigate a `needs_human` task."""
    require(request, roles.VIEWER)
    get_task(task_id)
    return json.loads(json.dumps(selectors.task_export(task_id), cls=DjangoJSONEncoder))
