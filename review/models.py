"""The review queue: what waits for a human decision — a side effect whose outcome is
unknown (kind `effect`, with its WAL entry), or a tool call an agent wants to make that
needs approval first (kind `approval`, with the proposed call; no WAL entry exists yet)."""
from django.conf import settings
from django.db import models


class ReviewStatus(models.TextChoices):
    OPEN = "open"
    DECIDED = "decided"
    # An approval nobody decided in time, whose fallback was `reject`: not a rejection (nobody
    # said no), and the model is told so. Closed: a decision afterwards is refused.
    EXPIRED = "expired"
    # An approval whose call can no longer run: its task was stopped, terminated or ended, or
    # rolled back (or edited) past its step. Closed, with the reason in `note`.
    REVOKED = "revoked"


class OnExpiry(models.TextChoices):
    """What an approval nobody decided in time does (per tool, AgentParams.approval_rules)."""
    REJECT = "reject", "expire: the call does not run and the model reads that the approval expired"
    KEEP_WAITING = "keep_waiting", "keep waiting for a reviewer (marked overdue)"
    ESCALATE = "escalate", "escalate to another group's reviewers, for one more timeout; then expire"


class ReviewKind(models.TextChoices):
    EFFECT = "effect", "side effect in doubt"
    APPROVAL = "approval", "tool call to approve"


class Decision(models.TextChoices):
    HAPPENED = "happened", "It happened (keep its result, do not repeat)"
    NOT_HAPPENED = "not_happened", "It did not happen (perform it again, same key)"
    SKIP = "skip", "Skip it (continue without it)"
    ABORT_TASK = "abort_task", "Abort the task"
    APPROVE = "approve", "Approve (the call runs, through the WAL)"
    EDIT_APPROVE = "edit_approve", "Edit the arguments and approve"
    REJECT = "reject", "Reject (the note is the tool's result the model reads)"


DECISIONS_BY_KIND = {
    ReviewKind.EFFECT: (Decision.HAPPENED, Decision.NOT_HAPPENED, Decision.SKIP, Decision.ABORT_TASK),
    ReviewKind.APPROVAL: (Decision.APPROVE, Decision.EDIT_APPROVE, Decision.REJECT),
}


class ReviewItem(models.Model):
    task = models.ForeignKey("orchestrator.Task", on_delete=models.CASCADE, related_name="review_items")
    kind = models.CharField(max_length=20, choices=ReviewKind.choices, default=ReviewKind.EFFECT)
    wal_entry = models.OneToOneField("orchestrator.WalEntry", on_delete=models.CASCADE, related_name="review_item",
                                     null=True, blank=True)
    # An approval: the step that asked and the call it proposes {"tool", "arguments", "call_id", "context"}.
    step_id = models.CharField(max_length=200, blank=True)
    proposal = models.JSONField(null=True, blank=True)
    # The tool the item is about (its WAL entry's, or the proposal's), kept on the row so the
    # queue filters by tool without reading a WAL row per item. Filled by save().
    tool = models.CharField(max_length=100, blank=True)
    status = models.CharField(max_length=20, choices=ReviewStatus.choices, default=ReviewStatus.OPEN)
    # Why it is in doubt: which worker died, when, and what recovery saw.
    reason = models.TextField()
    dead_worker = models.CharField(max_length=200, blank=True)
    detected_at = models.DateTimeField(auto_now_add=True)
    evidence = models.JSONField(null=True, blank=True)
    decision = models.CharField(max_length=20, choices=Decision.choices, blank=True)
    decision_result = models.JSONField(null=True, blank=True)
    note = models.TextField(blank=True)
    decided_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                   related_name="review_decisions")
    decided_at = models.DateTimeField(null=True, blank=True)
    # --- approvals only (review.services, engine/approvals.py) ---
    # The deadline: past it, the sweeper applies `on_expiry` (expire_due_approvals).
    expires_at = models.DateTimeField(null=True, blank=True)
    on_expiry = models.CharField(max_length=20, choices=OnExpiry.choices, blank=True)
    escalate_to = models.CharField(max_length=150, blank=True)  # a group name, for on_expiry=escalate
    expired_at = models.DateTimeField(null=True, blank=True)  # the deadline passed (whatever the fallback)
    # Escalated: from then on only reviewers in `escalate_to` (and admins) may decide it.
    escalated_at = models.DateTimeField(null=True, blank=True)
    # Two-person approval: how many different reviewers must approve the same arguments.
    approvals_required = models.PositiveSmallIntegerField(default=1)

    class Meta:
        ordering = ["detected_at", "id"]
        indexes = [models.Index(fields=["status", "detected_at"], name="review_status_detected"),
                   # The admin's list of every item, in this ordering (without it: a sort after a join).
                   models.Index(fields=["detected_at", "id"], name="review_detected_id"),
                   # The sweeper's question every pass: open approvals past their deadline.
                   models.Index(fields=["status", "expires_at"], name="review_status_expires")]

    def __str__(self):
        return f"review #{self.pk} task {self.task_id} {self.tool} ({self.status})"

    def save(self, *args, **kwargs):
        if not self.tool:
            self.tool = self.wal_entry.tool if self.wal_entry_id else (self.proposal or {}).get("tool", "")
        super().save(*args, **kwargs)

    @property
    def step(self) -> str:
        return self.wal_entry.step_id if self.wal_entry_id else self.step_id


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
