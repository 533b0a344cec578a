"""Approvals of tool calls, the reviewer's side: deciding (once), two-person approval, the
deadline and its fallback, revocation. The only code that settles an approval item.

The engine asks (orchestrator/engine/approvals.py) and the step waits for an `approval.decided`
event naming the item, bound to the call id and the SHA-256 of the arguments it may run with.
Every way an item closes sends at most one such event (source_event_id `review-<id>`) in the
transaction that closes it, with the task row locked first and the item row next:
- decided: approve, edit-and-approve (the edited arguments, validated by the tool's own
  argument model, are what the digest binds), or reject;
- expired (the deadline passed and the tool's fallback is `reject`): not a rejection — the
  model reads that the approval expired; `keep_waiting` leaves it open, marked overdue;
  `escalate` hands it to another group's reviewers for one more timeout, then it expires;
- revoked: the task ended, or an edit or rollback reset the step that asked. No event: the
  call cannot run any more.
A second decision of a closed item is refused with who closed it and when (ReviewClosed, 409):
a double click or two reviewers at once never make a second effect.

Who may decide: the reviewer role (admins hold every role); an escalated item only reviewers
in its group (or an admin); with two-person approval, two different reviewers must approve
the same arguments (the same person twice is refused). Every decision, vote, expiry,
escalation and revocation is audited.
"""
import logging
from datetime import timedelta

from django.db import transaction
from django.utils import timezone
from jsonschema.validators import validator_for
from pydantic import ValidationError

from orchestrator import roles
from orchestrator.agent import toolbox
from orchestrator.engine import approvals as engine_approvals, inbox, states
from orchestrator.engine.audit import audit
from orchestrator.engine.events import append_event
from orchestrator.engine.services import FieldError, InvalidInput
from orchestrator.models import Step, Task
from orchestrator.notifications import APPROVAL_EXPIRED, notify

from .models import ApprovalVote, Decision, OnExpiry, ReviewItem, ReviewKind, ReviewStatus
from orchestrator.primitives.errors import HarnessError

log = logging.getLogger(__name__)

EXPIRY_BATCH = 500  # items per sweep; the rest at the next one


class DecisionRefused(HarnessError):
    """A decision that changes nothing; `status` is the HTTP status that says why."""
    status = 409


class ReviewClosed(DecisionRefused):
    """The item was decided, expired or revoked already (HTTP 409)."""


class SameReviewer(DecisionRefused):
    """Two-person approval: this reviewer approved these arguments already (HTTP 409)."""


class StaleArguments(DecisionRefused):
    """The arguments changed since the reviewer loaded them (another reviewer's edit) (HTTP 409)."""


class ReviewForbidden(DecisionRefused):
    """This user may not decide this item (HTTP 403)."""
    status = 403


def _when(moment) -> str:
    return timezone.localtime(moment).strftime("%Y-%m-%d %H:%M:%S %Z") if moment else "an unknown time"


def closed_message(item: ReviewItem) -> str:
    """What a decision of a closed item is told: who closed it, when, how."""
    if item.status == ReviewStatus.EXPIRED:
        return (f"Approval #{item.pk} expired at {_when(item.decided_at)}: nobody decided it within its deadline, "
                f"so the call did not run and the model was told so. Nothing was changed.")
    if item.status == ReviewStatus.REVOKED:
        return (f"Approval #{item.pk} was revoked at {_when(item.decided_at)} ({item.note}); the call can no longer "
                f"run. Nothing was changed.")
    who = item.decided_by.get_username() if item.decided_by_id else "the system"
    return (f"Review #{item.pk} was already decided ({item.decision}) by {who} at {_when(item.decided_at)}. "
            f"Nothing was changed.")


def close(item: ReviewItem, *, status: str, decision: str, note: str, result, actor, now) -> None:
    item.status, item.decision, item.note = status, decision, note.strip()
    item.decision_result = result
    item.decided_by = actor if getattr(actor, "is_authenticated", False) else None
    item.decided_at = now
    item.save()


def may_decide(item: ReviewItem, user) -> str:
    """Why `user` may not decide `item` now ("" if they may). `user` None is the installation
    itself (the command line, code)."""
    if user is None:
        return ""
    if not roles.has_role(user, roles.REVIEWER):
        return "Deciding review items needs the reviewer role; ask an administrator to add you to the 'reviewer' group."
    if item.escalated_at and not roles.is_admin(user) and not user.groups.filter(name=item.escalate_to).exists():
        return (f"Approval #{item.pk} was escalated to the group '{item.escalate_to}' at {_when(item.escalated_at)}: "
                f"only reviewers in that group (or an admin) may decide it now.")
    return ""


def proposed_arguments(item: ReviewItem) -> dict:
    return (item.proposal or {}).get("arguments") or {}


def standing_arguments(item: ReviewItem) -> dict:
    """The arguments an approval would run with now: the latest edit (two-person approval:
    a reviewer's edit stands for the next reviewer to approve), else the proposal's."""
    edit = latest_edit(item)
    return edit.arguments if edit is not None else proposed_arguments(item)


def latest_edit(item: ReviewItem) -> ApprovalVote | None:
    """The last reviewer's edit of a two-person approval still open (read from `votes.all()`,
    so that a list prefetches them)."""
    edits = [v for v in item.votes.all() if v.decision == Decision.EDIT_APPROVE] if item.pk else []
    return max(edits, key=lambda v: (v.at, v.pk), default=None)


def tool_schema(tool: str) -> dict:
    """What an approval keeps of its tool when it opens (in the worker, which has just found
    the tool): the JSON schema of its arguments, and whether a pydantic model of this process
    checks them. The page and the decision then never need to reach the tool's source (an MCP
    server) from the web process."""
    found = toolbox.find_tool(tool)
    if found is None:
        return {}
    return {"schema": found.parameters_schema(), "schema_from": "model" if found.Args is not None else "json_schema"}


def argument_schema(item: ReviewItem) -> dict | None:
    """The JSON schema the edit form is generated from (None: unknown, edited as a JSON object)."""
    proposal = item.proposal or {}
    if "schema" in proposal:
        return proposal["schema"]
    kept = tool_schema(item.tool)  # an item opened before the schema was kept with it
    return kept.get("schema")


def validated_arguments(item: ReviewItem, arguments, *, field: str = "arguments") -> dict:
    """Edited arguments checked as the call will check them when it runs: by the tool's own
    argument model (returned as that model reads them), or by its JSON schema (an MCP tool's);
    InvalidInput names each wrong field."""
    if not isinstance(arguments, dict):
        raise InvalidInput([FieldError("result", "edit-and-approve needs the corrected arguments as a JSON object")])
    proposal = item.proposal or {}
    model = None
    if proposal.get("schema_from", "model") == "model":
        found = toolbox.find_tool(item.tool)
        model = found.Args if found is not None else None
    if model is not None:
        try:
            return model.model_validate(arguments).model_dump(mode="json", exclude_unset=True)
        except ValidationError as exc:
            raise InvalidInput([FieldError(".".join([field, *map(str, e["loc"])]), e["msg"])
                                for e in exc.errors()]) from None
    schema = proposal.get("schema")
    if schema:
        problems = []
        for error in validator_for(schema)(schema).iter_errors(arguments):
            where = list(error.absolute_path)
            if error.validator == "required":
                where = [p for p in error.validator_value if p not in (error.instance or {})][:1]
            elif error.validator == "additionalProperties":
                where = [p for p in (error.instance or {}) if p not in (error.schema.get("properties") or {})][:1]
            problems.append(FieldError(".".join([field, *map(str, where)]), error.message))
        if problems:
            raise InvalidInput(problems)
    return arguments


def deadline_fields(policy: dict | None, now=None) -> dict:
    """The ReviewItem fields of an approval's policy (engine.approvals.Policy.resolved())."""
    policy = policy or engine_approvals.Policy().resolved()
    now = now or timezone.now()
    return {"expires_at": now + timedelta(seconds=policy["timeout_seconds"]), "on_expiry": policy["on_expiry"],
            "escalate_to": policy["escalate_to"], "approvals_required": policy["approvers"]}


def _send_decision(task: Task, item: ReviewItem, *, approved: bool, note: str, arguments=None,
                   expired: bool = False, actor=None, ip=None) -> None:
    proposal = item.proposal or {}
    payload = {"approved": approved, "approval_id": str(item.pk), "call_id": proposal.get("call_id", ""),
               "note": note.strip()[:2000], "expired": expired,
               "arguments_sha256": engine_approvals.arguments_digest(
                   arguments if arguments is not None else proposed_arguments(item)) if approved else ""}
    if arguments is not None:
        payload["arguments"] = arguments
    inbox.send(task_id=task.pk, type="approval.decided", payload=payload, source=inbox.REVIEW_SOURCE,
               actor=actor, ip=ip, source_event_id=f"review-{item.pk}")


# --- deciding ------------------------------------------------------------------------------

def decide(*, item_id: int, decision: str, note: str, arguments=None, actor=None, ip=None,
           shown_sha256: str = "") -> ReviewItem:
    """Approve, edit-and-approve or reject approval `item_id` (the decision was checked to be
    one of those by review_decide). `shown_sha256`: the digest of the arguments the reviewer
    was shown; if they changed since (another reviewer's edit), nothing is decided."""
    with transaction.atomic():
        task = states.lock_task(ReviewItem.objects.values_list("task_id", flat=True).get(pk=item_id))
        item = ReviewItem.objects.select_for_update().get(pk=item_id)
        if item.status != ReviewStatus.OPEN:
            raise ReviewClosed(closed_message(item))
        why_not = may_decide(item, actor)
        if why_not:
            raise ReviewForbidden(why_not)
        standing = standing_arguments(item)
        if shown_sha256 and shown_sha256 != engine_approvals.arguments_digest(standing):
            raise StaleArguments(f"The arguments of approval #{item.pk} changed since you loaded them (another "
                                 f"reviewer edited them). Nothing was decided: review the current arguments again.")
        now = timezone.now()
        if decision == Decision.REJECT:
            close(item, status=ReviewStatus.DECIDED, decision=decision, note=note, result=None, actor=actor, now=now)
            _send_decision(task, item, approved=False, note=note, actor=actor, ip=ip)
            audit(action="review.approval", actor=actor, ip=ip, task=task, reason=note,
                  before={"proposal": item.proposal}, after={"review": item.pk, "decision": decision})
            log.info("approval rejected", extra={"task_id": task.pk, "step_id": item.step_id})
            return item
        runs_with = validated_arguments(item, arguments) if decision == Decision.EDIT_APPROVE else standing
        digest = engine_approvals.arguments_digest(runs_with)
        if item.approvals_required > 1 and not _second_person(task, item, decision, runs_with, digest, note,
                                                             actor, ip):
            return item
        edited = digest != engine_approvals.arguments_digest(proposed_arguments(item))
        final = Decision.EDIT_APPROVE if edited else Decision.APPROVE
        close(item, status=ReviewStatus.DECIDED, decision=final, note=note, result=runs_with if edited else None,
              actor=actor, now=now)
        _send_decision(task, item, approved=True, note=note, arguments=runs_with if edited else None,
                       actor=actor, ip=ip)
        audit(action="review.approval", actor=actor, ip=ip, task=task, reason=note,
              before={"proposal": item.proposal},
              after={"review": item.pk, "decision": final, "arguments": runs_with if edited else None,
                     "arguments_sha256": digest,
                     "approved_by": list(item.votes.filter(arguments_sha256=digest).values_list("reviewer_name",
                                                                                              flat=True))})
    log.info("approval decided: %s", final, extra={"task_id": task.pk, "step_id": item.step_id})
    return item


def _second_person(task: Task, item: ReviewItem, decision: str, runs_with: dict, digest: str, note: str,
                   actor, ip) -> bool:
    """Record `actor`'s approval of `runs_with`; whether enough different reviewers have now
    approved these very arguments for the call to run."""
    if not getattr(actor, "is_authenticated", False):
        raise ReviewForbidden(f"Approval #{item.pk} needs {item.approvals_required} different reviewers: it is "
                              f"decided by people with accounts, not by the installation.")
    earlier = item.votes.filter(reviewer=actor, arguments_sha256=digest).first()
    if earlier is not None:
        raise SameReviewer(f"You approved these arguments of #{item.pk} already, at {_when(earlier.at)}: another "
                           f"reviewer must approve them too (two-person approval). Nothing was changed.")
    ApprovalVote.objects.create(item=item, reviewer=actor, reviewer_name=actor.get_username(), decision=decision,
                                arguments=runs_with, arguments_sha256=digest, note=note.strip())
    approvers = set(item.votes.filter(arguments_sha256=digest).values_list("reviewer_id", flat=True))
    enough = len(approvers) >= item.approvals_required
    audit(action="review.approval_vote", actor=actor, ip=ip, task=task, reason=note,
          after={"review": item.pk, "decision": decision, "arguments_sha256": digest,
                 "arguments": runs_with if decision == Decision.EDIT_APPROVE else None,
                 "approvers": len(approvers), "required": item.approvals_required, "runs": enough})
    return enough


# --- the deadline --------------------------------------------------------------------------

def expire_due_approvals(sender=None, *, now=None, **kwargs) -> list[int]:
    """The receiver of the engine's `approvals_due` (every sweep): open approvals past their
    deadline follow their fallback. Returns the items handled."""
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
            log.exception("approval expiry failed", extra={"task_id": task_id})
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
    escalated = f" (escalated to {item.escalate_to} at {_when(item.escalated_at)})" if item.escalated_at else ""
    note = f"the approval expired: {waited}{escalated}; the call did not run"
    item.expired_at = now
    close(item, status=ReviewStatus.EXPIRED, decision="", note=note, result=None, actor=None, now=now)
    _send_decision(task, item, approved=False, note=note, expired=True)
    audit(action="review.approval_expired", task=task, reason=note,
          after={"review": item.pk, "fallback": item.on_expiry or OnExpiry.REJECT})
    notify(APPROVAL_EXPIRED, task_id=task.pk, item_id=item.pk, tool=item.tool, reason=note,
           extra={"fallback": OnExpiry.REJECT})
    log.info("approval expired", extra={"task_id": task.pk, "step_id": item.step_id})


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:g} h"
    if seconds >= 60:
        return f"{seconds / 60:g} min"
    return f"{seconds:g} s"


# --- revocation ----------------------------------------------------------------------------

def revoke_approvals(sender=None, *, task_id: int, reason: str, stale_steps_only: bool = False,
                     steps: list[str] | None = None, actor=None, **kwargs) -> list[int]:
    """The receiver of the engine's `approvals_void`, in the caller's transaction (the task row
    locked): close the task's open approvals as revoked — all, those whose step is gone or runs
    as a newer generation (`stale_steps_only`: an edit or a rollback went past them), or those
    of the given `steps` (skipped by an operator)."""
    items = ReviewItem.objects.select_for_update().filter(task_id=task_id, kind=ReviewKind.APPROVAL,
                                                          status=ReviewStatus.OPEN)
    items = list(items.filter(step_id__in=steps) if steps is not None else items)
    if stale_steps_only and items:
        generations = dict(Step.objects.filter(task_id=task_id, step_id__in=[i.step_id for i in items])
                           .values_list("step_id", "generation"))
        items = [i for i in items if generations.get(i.step_id) != (i.proposal or {}).get("generation", 0)]
    if not items:
        return []
    now = timezone.now()
    task = Task.objects.get(pk=task_id)
    for item in items:
        close(item, status=ReviewStatus.REVOKED, decision="", note=reason[:500], result=None, actor=actor, now=now)
        audit(action="review.approval_revoked", actor=actor, task=task, reason=reason[:500],
              after={"review": item.pk, "tool": item.tool, "step": item.step_id})
    log.info("approvals revoked", extra={"task_id": task_id})
    return [i.pk for i in items]
