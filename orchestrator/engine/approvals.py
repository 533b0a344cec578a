"""Approval of a tool call before it runs: the step asks, a reviewer decides.

The engine does not import the review queue (a layer above it): it sends `approval_requested`,
which the review app connects in its ready() (review.services.open_for_approval), in the
step's own transaction; the receiver answers with the approval's id. The reviewer's decision
comes back into the task as an `approval.decided` inbox event that only the review queue may
send (engine/inbox.py REVIEW_ONLY), naming its approval; the waiting step takes only the event
of its own approval (ctx.request_approval), so two gated calls decided in any order each get
their own decision, applied once.

An approval is bound to the call id and the SHA-256 of the canonical arguments: `bound()`
refuses a decision for another call or with arguments other than those approved.

Its life beyond the decision is the review queue's too, reached the same way (signals the
review app connects): a deadline (`Policy`, ORCH_APPROVAL_TIMEOUT_SECONDS by default) that
each sweep enforces (`expire_due`, from engine/recovery.py: the deadline is a column, so it
holds with no worker running and across restarts), and revocation when the call can no
longer run (`revoke`: the task ended, or an edit or rollback reset the step that asked).
"""
import hashlib
import json
from dataclasses import dataclass

from django.core.exceptions import ImproperlyConfigured
from django.db import transaction
from django.dispatch import Signal

from ..conf import harness
from ..primitives.errors import HarnessError

approval_requested = Signal()
# Sent by every sweep: the review queue applies the fallback of approvals past their deadline.
approvals_due = Signal()
# Sent when approvals can no longer be decided usefully: the receiver revokes the task's open
# approvals (all of them, or those whose step no longer exists or runs as a newer generation).
approvals_void = Signal()

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
            reason: str = "", generation: int = 0, policy: Policy | None = None) -> int:
    """Put the proposed call in front of a reviewer (once per step generation, call and
    arguments: asking again returns the same approval); returns the approval's id."""
    with transaction.atomic():
        answers = approval_requested.send(sender=None, task_id=task_id, step_id=step_id, tool=tool,
                                          arguments=arguments, context=context, call_id=call_id,
                                          arguments_sha256=arguments_digest(arguments), reason=reason,
                                          generation=generation, policy=(policy or Policy()).resolved())
        if not answers:
            raise ImproperlyConfigured("No review queue is installed ('review' in INSTALLED_APPS): a tool call "
                                       "that needs approval cannot wait for a reviewer.")
        return answers[0][1].pk


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


def expire_due(now=None) -> None:
    """Apply the fallback of every open approval past its deadline (each sweep calls this)."""
    approvals_due.send(sender=None, now=now)


def revoke(*, task_id: int, reason: str, stale_steps_only: bool = False, steps: list[str] | None = None,
           actor=None) -> None:
    """Revoke the task's open approvals, in the caller's transaction: all of them (the task
    ended), those whose step was removed or reset to a new generation by an edit or a rollback
    (`stale_steps_only`), or those of the given steps (an operator skipped them). A revoked
    approval is closed: deciding it is refused."""
    approvals_void.send(sender=None, task_id=task_id, reason=reason, stale_steps_only=stale_steps_only, steps=steps,
                        actor=actor)
