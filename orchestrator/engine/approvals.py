"""Approval of a tool call before it runs: the step asks, a reviewer decides.

The engine does not import the review queue (a layer above it): it sends `approval_requested`,
which the review app connects in its ready() (review.services.open_for_approval), in the
step's own transaction. The reviewer's decision comes back into the task as an
`approval.decided` inbox event, which the waiting step takes (ctx.request_approval).
"""
from django.core.exceptions import ImproperlyConfigured
from django.db import transaction
from django.dispatch import Signal

approval_requested = Signal()
# The step took its decision (from the queue, or sent by another system as approval.decided):
# an item still open in the queue is closed with it.
approval_taken = Signal()


def request(*, task_id: int, step_id: str, tool: str, arguments: dict, context: str = "",
            call_id: str = "") -> None:
    """Put the proposed call in front of a reviewer (once per step: asking again is a no-op)."""
    with transaction.atomic():
        if not approval_requested.send(sender=None, task_id=task_id, step_id=step_id, tool=tool,
                                       arguments=arguments, context=context, call_id=call_id):
            raise ImproperlyConfigured("No review queue is installed ('review' in INSTALLED_APPS): a tool call "
                                       "that needs approval cannot wait for a reviewer.")


def taken(*, task_id: int, step_id: str, decision: dict) -> None:
    approval_taken.send(sender=None, task_id=task_id, step_id=step_id, decision=decision)
