"""Approval of a tool call before it runs: the step asks, a reviewer decides.

The step's ask opens the approval item itself (`request`, in the step's own transaction: a
ReviewItem of kind `approval`, the engine's record of what needs a person,
orchestrator/models.py); the review queue lists it and decides it through the engine's
services. The engine never imports the review queue. The reviewer's decision comes back into
the task as an `approval.decided` inbox event that only the review queue (or the engine's own
expiry, engine/reviews.py) may send (engine/inbox.py REVIEW_ONLY), naming its approval; the
waiting step takes only the event of its own approval (ctx.request_approval), so two gated
calls decided in any order each get their own decision, applied once.

An approval is bound to the call id and the SHA-256 of the canonical arguments: `bound()`
refuses a decision for another call or with arguments other than those approved.

Its life beyond the decision is the engine's too: a deadline (`Policy`,
ORCH_APPROVAL_TIMEOUT_SECONDS by default) that each sweep enforces (engine/reviews.py
`expire_due`, from engine/recovery.py: the deadline is a column, so it holds with no worker
running and across restarts), and revocation when the call can no longer run (`revoke`: the
task ended, or an edit or rollback reset the step that asked).
"""
import hashlib
import json
import logging
from dataclasses import dataclass
from datetime import timedelta

from django.db import connection, transaction
from django.utils import timezone

from ..conf import harness
from ..models import ReviewItem, ReviewKind, ReviewStatus, Step, Task
from ..notifications import APPROVAL_REQUESTED, notify
from ..primitives.errors import HarnessError
from .audit import audit

# Logged under the names the review queue used (log queries filter on them; not imports).
requested_log = logging.getLogger("review.services")
revoked_log = logging.getLogger("review.approvals")

ON_EXPIRY = ("reject", "keep_waiting", "escalate")


@dataclass(frozen=True)
class Policy:
    """How long an approval waits and what happens then; how many reviewers it needs."""
    timeout_seconds: float | None = None  # None: ORCH_APPROVAL_TIMEOUT_SECONDS
    on_expiry: str = "reject"  # reject | keep_waiting | escalate
    escalate_to: str = ""  # the group whose reviewers take it when escalated
    approvers: int = 1  # 2: two different reviewers must approve the same arguments

    def resolved(self) -> dict:
        if self.on_expiry not in ON_EXPIRY:
            raise ValueError(f"on_expiry must be one of {', '.join(ON_EXPIRY)}, not {self.on_expiry!r}")
        if self.on_expiry == "escalate" and not self.escalate_to:
            raise ValueError("on_expiry=escalate needs escalate_to (a group)")
        timeout = self.timeout_seconds if self.timeout_seconds is not None else harness.approval_timeout_seconds
        return {"timeout_seconds": float(timeout), "on_expiry": self.on_expiry, "escalate_to": self.escalate_to,
                "approvers": max(1, min(2, int(self.approvers)))}


class ApprovalMismatch(HarnessError):
    """A decision that does not bind to the call that waits (another call, other arguments)."""


def canonical(arguments) -> str:
    """The arguments as one canonical JSON text (sorted keys, no spaces): what is digested."""
    return json.dumps(arguments, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def arguments_digest(arguments) -> str:
    return hashlib.sha256(canonical(arguments).encode()).hexdigest()


def request(*, task_id: int, step_id: str, tool: str, arguments: dict, context: str = "", call_id: str = "",
            reason: str = "", generation: int = 0, policy: Policy | None = None, schema: dict | None = None) -> int:
    """Put the proposed call in front of a reviewer (once per step generation, call and
    arguments: asking again returns the same approval); returns the approval's id.
    `schema`: what the caller knows of the tool's arguments ({"schema", "schema_from"}), kept
    with the approval so the page never asks the tool's source (an MCP server) for it."""
    with transaction.atomic():
        return approval_open(task_id=task_id, step_id=step_id, tool=tool, arguments=arguments, context=context,
                             call_id=call_id, arguments_sha256=arguments_digest(arguments), reason=reason,
                             generation=generation, policy=(policy or Policy()).resolved(), schema=schema).pk


def approval_open(*, task_id: int, step_id: str, tool: str, arguments: dict, context: str = "", call_id: str = "",
                  arguments_sha256: str = "", reason: str = "", generation: int = 0, policy: dict | None = None,
                  schema: dict | None = None) -> ReviewItem:
    """One approval item per step generation, call and arguments (asked again, e.g. after a
    crash, the same item; its decision stands). A step that runs again after an edit or a
    rollback (a new generation) gets a new item. `policy` (Policy.resolved()): its deadline,
    its fallback and how many reviewers it needs. In the caller's transaction."""
    for existing in ReviewItem.objects.filter(task_id=task_id, kind=ReviewKind.APPROVAL, step_id=step_id).exclude(
            status=ReviewStatus.REVOKED):
        proposal = existing.proposal or {}
        if (proposal.get("call_id") == call_id and proposal.get("arguments_sha256") == arguments_sha256
                and proposal.get("generation", 0) == generation):
            return existing
    policy = policy or Policy().resolved()
    item = ReviewItem.objects.create(
        task_id=task_id, kind=ReviewKind.APPROVAL, step_id=step_id,
        proposal={"tool": tool, "arguments": arguments, "call_id": call_id, "arguments_sha256": arguments_sha256,
                  "context": context[:20_000], "generation": generation, "policy": policy, **(schema or {})},
        reason=f"{tool} needs approval before it runs" + (f": {reason}" if reason else ""),
        **deadline_fields(policy))
    requested_log.info("approval requested", extra={"task_id": task_id, "step_id": step_id})
    notify(APPROVAL_REQUESTED, task_id=task_id, item_id=item.pk, tool=tool, reason=reason)
    return item


def deadline_fields(policy: dict | None, now=None) -> dict:
    """The ReviewItem fields of an approval's policy (Policy.resolved())."""
    policy = policy or Policy().resolved()
    now = now or timezone.now()
    return {"expires_at": now + timedelta(seconds=policy["timeout_seconds"]), "on_expiry": policy["on_expiry"],
            "escalate_to": policy["escalate_to"], "approvals_required": policy["approvers"]}


def close(item: ReviewItem, *, status: str, decision: str, note: str, result, actor, now) -> None:
    """Close `item` (decided, expired or revoked): the one writer of a closing."""
    item.status, item.decision, item.note = status, decision, note.strip()
    item.decision_result = result
    item.decided_by = actor if getattr(actor, "is_authenticated", False) else None
    item.decided_at = now
    item.save()


def bound(decision: dict, *, approval_id: int, call_id: str, arguments: dict) -> dict:
    """The decision of approval `approval_id`, checked against the call that waits: the same
    call id, and arguments whose digest is the one the reviewer approved. Returns it with
    `arguments` set to what the call may run with."""
    if str(decision.get("approval_id")) != str(approval_id):
        raise ApprovalMismatch(f"decision of approval {decision.get('approval_id')} taken by approval {approval_id}")
    if decision.get("call_id", call_id) != call_id:
        raise ApprovalMismatch(f"approval {approval_id} was decided for call {decision.get('call_id')!r}, "
                               f"not {call_id!r}")
    if not decision.get("approved"):
        return {**decision, "arguments": None}
    runs_with = decision.get("arguments") if decision.get("arguments") is not None else arguments
    if arguments_digest(runs_with) != decision.get("arguments_sha256"):
        raise ApprovalMismatch(f"approval {approval_id}: the arguments differ from those the reviewer approved")
    return {**decision, "arguments": runs_with}


def any_open(task_id: int) -> bool:
    """Whether the task has an open approval (what `revoke` locks and closes when there is):
    committed rows, as the locking read sees them."""
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT 1 FROM {ReviewItem._meta.db_table} WHERE task_id = %s AND kind = %s AND status = %s "
                       f"LIMIT 1", [task_id, ReviewKind.APPROVAL, ReviewStatus.OPEN])
        return cursor.fetchone() is not None


def revoke(*, task_id: int, reason: str, stale_steps_only: bool = False, steps: list[str] | None = None,
           actor=None) -> list[int]:
    """Revoke the task's open approvals, in the caller's transaction (the task row locked): all
    of them (the task ended), those whose step was removed or reset to a new generation by an
    edit or a rollback (`stale_steps_only`), or those of the given steps (an operator skipped
    them). A revoked approval is closed: deciding it is refused. Returns the items revoked."""
    if not any_open(task_id):
        return []  # the common case at every task's end, answered by one plain statement
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
    revoked_log.info("approvals revoked", extra={"task_id": task_id})
    return [i.pk for i in items]
