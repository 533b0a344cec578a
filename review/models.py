"""The review queue: what waits for a human decision — a side effect whose outcome is
unknown (kind `effect`, with its WAL entry), or a tool call an agent wants to make that
needs approval first (kind `approval`, with the proposed call; no WAL entry exists yet).

The item itself is the engine's record (orchestrator/models.py: the engine opens, expires and
revokes it, and never imports this app); its table and migrations keep this app's label. The
votes of a two-person approval are the reviewers' own, and live here."""
from django.conf import settings
from django.db import models

from orchestrator.models import (  # noqa: F401 - the queue's names for the engine's record
    DECISIONS_BY_KIND, Decision, OnExpiry, ReviewItem, ReviewKind, ReviewStatus,
)


class ApprovalVote(models.Model):
    """One reviewer's approval of an approval item that needs two (approvals_required=2):
    bound to the arguments they approved (an edit is an approval of the edited arguments).
    The call runs once two different reviewers approved the same digest; the same person
    cannot approve the same arguments twice (unique constraint)."""
    item = models.ForeignKey(ReviewItem, on_delete=models.CASCADE, related_name="votes")
    reviewer = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL,
                                 related_name="approval_votes")
    reviewer_name = models.CharField(max_length=150)  # kept if the account is deleted
    decision = models.CharField(max_length=20, choices=Decision.choices)
    arguments = models.JSONField()
    arguments_sha256 = models.CharField(max_length=64)
    note = models.TextField(blank=True)
    at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["at", "id"]
        constraints = [models.UniqueConstraint(fields=["item", "reviewer", "arguments_sha256"],
                                               name="approval_vote_once_per_reviewer")]

    def __str__(self):
        return f"vote on review #{self.item_id} by {self.reviewer_id} ({self.decision})"
