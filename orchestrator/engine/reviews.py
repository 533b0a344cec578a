"""What needs a person, the engine's side: the engine opens, expires and closes its own
records of it (ReviewItem, orchestrator/models.py), and the review queue (review/) lists them
and decides them through these services. The engine never imports the review queue, and no
signal stands between them: an effect in doubt is recorded by the code that found it.

- An effect whose outcome is unknown (a non-idempotent tool's WAL entry left `pending` by a
  dead worker, or reported ambiguous by its tool) is never guessed: `effect_open` runs the
  tool's probe, and what the probe cannot settle opens an item of kind `effect`; its task
  waits in `awaiting_review` (the caller's transition).
- An approval (engine/approvals.py opens and revokes it) past its deadline follows its
  fallback at each sweep (`expire_due`).
- `send_decision`: the one way an approval's outcome reaches its waiting step (an
  `approval.decided` inbox event, source `review`, at most one per item).
"""
import logging
from datetime import timedelta

from django.db import transaction
from django.utils import timezone

from ..models import OnExpiry, ReviewItem, ReviewKind, ReviewStatus, Task, TaskStatus as S, WalEntry
from ..notifications import APPROVAL_EXPIRED, REVIEW_OPENED, notify
from ..tools.catalog import get_tool
from . import approvals, inbox, scheduler, states, wal
from .audit import audit
from .events import append_event

# The lines a reviewer's tooling reads keep the logger names they had when the review queue
# wrote them (log queries and alerts filter on them): they are names, not imports.
opened_log = logging.getLogger("review.services")
approvals_log = logging.getLogger("review.approvals")

EXPIRY_BATCH = 500  # items per sweep; the rest at the next one


# --- effects in doubt ------------------------------------------------------------------------

def effect_open(*, entry: WalEntry, reason: str, dead_worker: str = "",
                evidence: dict | None = None) -> ReviewItem | None:
    """Open (or return the open) review item for a WAL entry in doubt; in the caller's transaction.
    `evidence`: what the tool itself saw when the outcome became unknown (its phase, its error),
    added to what the tool can tell about the key.

    The tool's probe runs first (unless the caller ran it: `evidence["probe"]` says what it
    found), so a reviewer sees only what it could not settle: settled, no item is opened
    (None), and a task left awaiting a review that never opened continues after the commit."""
    existing = ReviewItem.objects.filter(wal_entry=entry).first()
    if existing is not None and existing.status == ReviewStatus.OPEN:
        return existing
    if "probe" not in (evidence or {}):
        probed = wal.probe_entry(entry)
        if probed.settled:
            transaction.on_commit(lambda: continue_if_nothing_to_review(entry.task_id))
            return None
        evidence = {**(evidence or {}), "probe": probed.how}
    try:
        gathered = get_tool(entry.tool).evidence(entry.args, key=entry.idempotency_key) or {}
    except Exception as exc:  # evidence is a courtesy; its absence must not block the review
        gathered = {"error": f"could not gather evidence: {exc}"}
    evidence = {**gathered, **(evidence or {})} or None
    if existing is not None:
        # Decided `not_happened` before, performed again with the same key (the same WAL
        # entry: one item per entry) and in doubt again: reopen it (the earlier decision
        # stays in the audit log), or the task would wait with nothing to review.
        existing.status, existing.decision, existing.note, existing.decision_result = ReviewStatus.OPEN, "", "", None
        existing.decided_by, existing.decided_at, existing.detected_at = None, None, timezone.now()
        existing.reason, existing.dead_worker, existing.evidence = reason, dead_worker, evidence
        existing.save()
        opened_log.warning("review reopened", extra={"task_id": entry.task_id, "wal_entry_id": entry.pk,
                                                     "resume_strategy": "awaiting_review"})
        notify(REVIEW_OPENED, task_id=entry.task_id, item_id=existing.pk, tool=entry.tool, reason=reason)
        return existing
    item = ReviewItem.objects.create(task_id=entry.task_id, wal_entry=entry, reason=reason, dead_worker=dead_worker,
                                     evidence=evidence)
    opened_log.warning("review opened", extra={"task_id": entry.task_id, "wal_entry_id": entry.pk,
                                               "resume_strategy": "awaiting_review"})
    notify(REVIEW_OPENED, task_id=entry.task_id, item_id=item.pk, tool=entry.tool, reason=reason)
    return item


def continue_if_nothing_to_review(task_id: int) -> None:
    """A task sent to awaiting_review for effects its tools' probes then settled has nothing
    to wait for: it continues, as after a reviewer's last decision."""
    with transaction.atomic():
        task = states.lock_task(task_id)
        if task.status != S.AWAITING_REVIEW or ReviewItem.objects.filter(task=task, status=ReviewStatus.OPEN).exists():
            return
        states.transition(task, S.QUEUED, reason="the effects in doubt were settled by their probes; continuing",
                          action="review.resume", lease_owner="")
        scheduler.enqueue(task.pk)


# --- approvals: the decision's way back, the deadline ----------------------------------------

def send_decision(task: Task, item: ReviewItem, *, approved: bool, note: str, arguments=None,
                  expired: bool = False, actor=None, ip=None) -> None:
    """Tell the waiting step how approval `item` ended (in the transaction that closes it).
    `arguments`: the edited ones, when a reviewer changed them."""
    proposal = item.proposal or {}
    payload = {"approved": approved, "approval_id": str(item.pk), "call_id": proposal.get("call_id", ""),
               "note": note.strip()[:2000], "expired": expired,
               "arguments_sha256": approvals.arguments_digest(
                   arguments if arguments is not None else (proposal.get("arguments") or {})) if approved else ""}
    if arguments is not None:
        payload["arguments"] = arguments
    inbox.send(task_id=task.pk, type="approval.decided", payload=payload, source=inbox.REVIEW_SOURCE,
               actor=actor, ip=ip, source_event_id=f"review-{item.pk}")


def expire_due(now=None) -> list[int]:
    """Every sweep: open approvals past their deadline follow their fallback. Returns the
    items handled."""
    now = now or timezone.now()
    handled = []
    due = (ReviewItem.objects.filter(status=ReviewStatus.OPEN, kind=ReviewKind.APPROVAL, expires_at__lte=now)
           .order_by("expires_at").values_list("pk", "task_id")[:EXPIRY_BATCH])
    for item_id, task_id in due:
        try:
            with transaction.atomic():
                task = states.lock_task(task_id)
                item = ReviewItem.objects.select_for_update().get(pk=item_id)
                if item.status != ReviewStatus.OPEN or item.expires_at is None or item.expires_at > now:
                    continue  # decided (or handled by another sweeper) meanwhile
                _expire(task, item, now)
            handled.append(item_id)
        except Exception:  # one item's trouble must not stop the others' deadlines
            approvals_log.exception("approval expiry failed", extra={"task_id": task_id})
    return handled


def _expire(task: Task, item: ReviewItem, now) -> None:
    window = ((item.proposal or {}).get("policy") or {}).get("timeout_seconds") or max(
        1.0, (item.expires_at - item.detected_at).total_seconds())
    waited = f"nobody decided within {_duration(window)}"
    if item.on_expiry == OnExpiry.KEEP_WAITING:
        item.expired_at, item.expires_at = now, None
        item.save(update_fields=["expired_at", "expires_at"])
        audit(action="review.approval_expired", task=task, reason=f"{waited}; keeps waiting for a reviewer",
              after={"review": item.pk, "fallback": OnExpiry.KEEP_WAITING})
        append_event(task, "approval_expired", {"review": item.pk, "tool": item.tool, "fallback": "keep_waiting"})
        notify(APPROVAL_EXPIRED, task_id=task.pk, item_id=item.pk, tool=item.tool,
               reason=f"{waited}; it is still waiting for a reviewer", extra={"fallback": OnExpiry.KEEP_WAITING})
        return
    if item.on_expiry == OnExpiry.ESCALATE and not item.escalated_at:
        item.expired_at, item.escalated_at = now, now
        item.expires_at = now + timedelta(seconds=window)
        item.save(update_fields=["expired_at", "escalated_at", "expires_at"])
        audit(action="review.approval_escalated", task=task, reason=f"{waited}; escalated to {item.escalate_to}",
              after={"review": item.pk, "fallback": OnExpiry.ESCALATE, "group": item.escalate_to,
                     "expires_at": item.expires_at.isoformat()})
        append_event(task, "approval_escalated", {"review": item.pk, "tool": item.tool, "group": item.escalate_to})
        notify(APPROVAL_EXPIRED, task_id=task.pk, item_id=item.pk, tool=item.tool, role=item.escalate_to,
               reason=f"{waited}; escalated to {item.escalate_to}", extra={"fallback": OnExpiry.ESCALATE})
        return
    # `reject`, or an escalation nobody in the group decided either: the call does not run.
    escalated = f" (escalated to {item.escalate_to} at {when(item.escalated_at)})" if item.escalated_at else ""
    note = f"the approval expired: {waited}{escalated}; the call did not run"
    item.expired_at = now
    approvals.close(item, status=ReviewStatus.EXPIRED, decision="", note=note, result=None, actor=None, now=now)
    send_decision(task, item, approved=False, note=note, expired=True)
    audit(action="review.approval_expired", task=task, reason=note,
          after={"review": item.pk, "fallback": item.on_expiry or OnExpiry.REJECT})
    notify(APPROVAL_EXPIRED, task_id=task.pk, item_id=item.pk, tool=item.tool, reason=note,
           extra={"fallback": OnExpiry.REJECT})
    approvals_log.info("approval expired", extra={"task_id": task.pk, "step_id": item.step_id})


def when(moment) -> str:
    """A moment as reviewers read it (local time, with its zone)."""
    return timezone.localtime(moment).strftime("%Y-%m-%d %H:%M:%S %Z") if moment else "an unknown time"


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:g} h"
    if seconds >= 60:
        return f"{seconds / 60:g} min"
    return f"{seconds:g} s"
