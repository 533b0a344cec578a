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
"""
import hashlib
import json

from django.core.exceptions import ImproperlyConfigured
from django.db import transaction
from django.dispatch import Signal

approval_requested = Signal()


class ApprovalMismatch(Exception):
    """A decision that does not bind to the call that waits (another call, other arguments)."""


def canonical(arguments) -> str:
    """The arguments as one canonical JSON text (sorted keys, no spaces): what is digested."""
    return json.dumps(arguments, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def arguments_digest(arguments) -> str:
    return hashlib.sha256(canonical(arguments).encode()).hexdigest()


def request(*, task_id: int, step_id: str, tool: str, arguments: dict, context: str = "", call_id: str = "",
            reason: str = "") -> int:
    """Put the proposed call in front of a reviewer (once per step, call and arguments: asking
    again returns the same approval); returns the approval's id."""
    with transaction.atomic():
        answers = approval_requested.send(sender=None, task_id=task_id, step_id=step_id, tool=tool,
                                          arguments=arguments, context=context, call_id=call_id,
                                          arguments_sha256=arguments_digest(arguments), reason=reason)
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
