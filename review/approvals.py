"""Approvals of tool calls, the reviewer's side: deciding (once), two-person approval.

The engine asks and opens the item (orchestrator/engine/approvals.py), applies its deadline's
fallback and revokes it (engine/reviews.py, engine/approvals.py); this module decides it,
through the engine's services. The step waits for an `approval.decided` event naming the item,
bound to the call id and the SHA-256 of the arguments it may run with.
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

from django.db import transaction
from django.utils import timezone
from jsonschema.validators import validator_for
from pydantic import ValidationError

from orchestrator import roles
from orchestrator.agent import toolbox
from orchestrator.engine import approvals as engine_approvals, reviews, states
from orchestrator.engine.audit import audit
from orchestrator.engine.services import FieldError, InvalidInput
from orchestrator.models import Task
from orchestrator.primitives.errors import HarnessError

from .models import ApprovalVote, Decision, ReviewItem, ReviewStatus

log = logging.getLogger(__name__)

# What the engine does with an approval beyond its decision, under the names this module had.
close = engine_approvals.close
deadline_fields = engine_approvals.deadline_fields
_when = reviews.when


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


# What an approval keeps of its tool when it opens (the agent passes it to the engine).
tool_schema = toolbox.approval_schema


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
            reviews.send_decision(task, item, approved=False, note=note, actor=actor, ip=ip)
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
        reviews.send_decision(task, item, approved=True, note=note, arguments=runs_with if edited else None,
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


# --- the deadline and revocation: the engine's (engine/reviews.py, engine/approvals.py) -------

def expire_due_approvals(sender=None, *, now=None, **kwargs) -> list[int]:
    """Apply the fallback of open approvals past their deadline now (each sweep does it:
    engine/reviews.py expire_due). Returns the items handled."""
    return reviews.expire_due(now)

