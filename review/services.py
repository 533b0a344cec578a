"""Review decisions: the reviewer's side of the items the engine opens.

A side effect whose outcome is unknown (a non-idempotent tool's WAL entry left `pending`
by a dead worker) is never guessed: the engine opens a ReviewItem for it (its own record,
orchestrator/engine/reviews.py) and the task waits in `awaiting_review`. A reviewer
decides, here, through the engine's services (the WAL, the task's transitions); when the
task's last open item is decided, the task continues by itself. An effect left unknown by a task that then ended (a Stop or a
Force-terminate cut it in flight) is reviewed too: on an ended task the decision records
what happened, for the audit and the export, and never runs anything or moves the task.
"""
import logging

from django.db import transaction
from django.utils import timezone

from orchestrator.engine import approvals, reviews, scheduler, states, wal
from orchestrator.engine.audit import audit
from orchestrator.engine.events import append_event
from orchestrator.engine.services import FieldError, InvalidInput
from orchestrator.models import IdempotencyRecord, TaskStatus as S, WalStatus
from orchestrator.tools.catalog import get_tool

from . import approvals as approval_decisions
from .approvals import DecisionRefused, ReviewClosed, closed_message  # noqa: F401 - the API's and pages' errors
from .models import DECISIONS_BY_KIND, Decision, ReviewItem, ReviewKind, ReviewStatus

log = logging.getLogger(__name__)


# Opening an item is the engine's (engine/reviews.py, engine/approvals.py); this name stays
# for the code and the tests that open one by hand.
review_open = reviews.effect_open


def open_for_approval(sender=None, *, task_id: int, step_id: str, tool: str, arguments: dict, context: str = "",
                      call_id: str = "", arguments_sha256: str = "", reason: str = "", generation: int = 0,
                      policy: dict | None = None, **kwargs) -> ReviewItem:
    """Open (or return) the approval item of a proposed call, as a step's ask does
    (engine/approvals.py approval_open), with what the agent's toolbox knows of the tool."""
    return approvals.approval_open(task_id=task_id, step_id=step_id, tool=tool, arguments=arguments,
                                   context=context, call_id=call_id, arguments_sha256=arguments_sha256,
                                   reason=reason, generation=generation, policy=policy,
                                   schema=approval_decisions.tool_schema(tool))


def review_decide(*, item_id: int, decision: str, note: str, result=None, actor=None, ip: str | None = None,
                  arguments_sha256: str = "") -> ReviewItem:
    """Decide review item `item_id`. An approval: `approve`, `edit_approve` (`result`: the
    corrected arguments, checked by the tool's argument model) or `reject` (review/approvals.py;
    `arguments_sha256`: the digest of the arguments the reviewer was shown, refused if they
    changed since). An effect in doubt: `happened`, `not_happened`, `skip` or `abort_task`.
    A closed item's decision is refused (ReviewClosed: who closed it and when)."""
    kind = ReviewItem.objects.filter(pk=item_id).values_list("kind", flat=True).first() or ReviewKind.EFFECT
    allowed = [d.value for d in DECISIONS_BY_KIND[kind]]
    errors = []
    if decision not in allowed:
        errors.append(FieldError("decision", f"must be one of {', '.join(allowed)}"))
    # An approval speaks for itself (who and when are audited); a rejection is what the model
    # reads, and an effect's decision records what the reviewer checked: those need a note.
    if not (note or "").strip() and decision not in (Decision.APPROVE, Decision.EDIT_APPROVE):
        errors.append(FieldError("note", "a note is required: say what you checked" if kind == ReviewKind.EFFECT
                                 else "a note is required: the model reads it as the reason"))
    if decision == Decision.EDIT_APPROVE and not isinstance(result, dict):
        errors.append(FieldError("result", "edit-and-approve needs the corrected arguments as a JSON object"))
    if errors:
        raise InvalidInput(errors)
    if kind == ReviewKind.APPROVAL:
        return approval_decisions.decide(item_id=item_id, decision=decision, note=note or "", arguments=result,
                                         actor=actor, ip=ip, shown_sha256=arguments_sha256)
    with transaction.atomic():
        item = ReviewItem.objects.select_related("wal_entry").get(pk=item_id)
        task = states.lock_task(item.task_id)
        item = ReviewItem.objects.select_for_update(of=("self",)).select_related("wal_entry").get(pk=item_id)
        if item.status != ReviewStatus.OPEN:
            raise ReviewClosed(closed_message(item))
        entry = item.wal_entry
        before = {"wal_status": entry.status, "task_status": task.status}
        now = timezone.now()
        # A task that has ended (stopped, terminated, failed) runs nothing again: the decision
        # records what happened, for the audit and the export; it never re-executes the effect.
        ended = task.status in states.TERMINAL
        if decision == Decision.HAPPENED:
            recorded = result if result is not None else get_tool(entry.tool).confirmed_result(
                entry.args, key=entry.idempotency_key)
            wal.settle(entry.pk, WalStatus.DONE, result=recorded, now=now)
            IdempotencyRecord.objects.get_or_create(key=entry.idempotency_key,
                                                    defaults={"tool": entry.tool, "result": recorded})
        elif decision == Decision.NOT_HAPPENED:
            # `failed` means "did not happen": the step performs it again with the same key
            # (if the task goes on: an ended one does not).
            wal.settle(entry.pk, WalStatus.FAILED, now=now,
                       error=f"reviewer: did not happen ({note.strip()[:200]})"
                             + (f"; the task had {task.status}: not performed again" if ended else ""))
        elif decision == Decision.SKIP:
            wal.settle(entry.pk, WalStatus.SKIPPED, now=now, error=f"reviewer: skipped ({note.strip()[:200]})")
        _close(item, decision, note, result, actor, now)
        audit(action="review.decide", actor=actor, ip=ip, task=task, reason=note,
              before=before, after={"review": item.pk, "decision": decision, "wal_entry": entry.pk,
                                    "idempotency_key": entry.idempotency_key, "result": result})
        if decision == Decision.ABORT_TASK:
            for other in ReviewItem.objects.filter(task=task, status=ReviewStatus.OPEN).exclude(pk=item.pk):
                _close(other, Decision.ABORT_TASK, f"closed with review #{item.pk}: {note}", None, actor, now)
            if task.status not in states.TERMINAL:
                states.transition(task, S.FAILED, reason=f"aborted by reviewer: {note.strip()[:300]}", actor=actor,
                                  ip=ip, action="review.abort_task", error=f"aborted in review #{item.pk}: {note}")
        elif task.status == S.AWAITING_REVIEW and not ReviewItem.objects.filter(task=task, status=ReviewStatus.OPEN).exists():
            states.transition(task, S.QUEUED, reason="every review decided; continuing", actor=actor, ip=ip,
                              action="review.resume", lease_owner="")
            scheduler.enqueue(task.pk)
        if ended:
            # No transition follows: this event is what tells the task's live pages (its
            # "unreviewed effect" badge) and its event log that the effect was decided.
            append_event(task, "effect_reviewed", {
                "review": item.pk, "decision": decision, "wal_entry": entry.pk, "tool": entry.tool,
                "idempotency_key": entry.idempotency_key, "task_status": task.status,
                "open_reviews": ReviewItem.objects.filter(task=task, status=ReviewStatus.OPEN).count()})
    log.info("review decided: %s", decision, extra={"task_id": task.pk, "wal_entry_id": entry.pk,
                                                    "resume_strategy": f"review:{decision}"})
    return item


def _close(item: ReviewItem, decision: str, note: str, result, actor, now) -> None:
    approvals.close(item, status=ReviewStatus.DECIDED, decision=decision, note=note, result=result, actor=actor,
                    now=now)
