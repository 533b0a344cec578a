"""The review queue: what waits for a human decision — a side effect whose outcome is
unknown (kind `effect`, with its WAL entry), or a tool call an agent wants to make that
needs approval first (kind `approval`, with the proposed call; no WAL entry exists yet)."""
from django.conf import settings
from django.db import models


class ReviewStatus(models.TextChoices):
    OPEN = "open"
    DECIDED = "decided"


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

    class Meta:
        ordering = ["detected_at", "id"]
        indexes = [models.Index(fields=["status", "detected_at"], name="review_status_detected"),
                   # The admin's list of every item, in this ordering (without it: a sort after a join).
                   models.Index(fields=["detected_at", "id"], name="review_detected_id")]

    def __str__(self):
        return f"review #{self.pk} task {self.task_id} {self.tool} ({self.status})"

    def save(self, *args, **kwargs):
        if not self.tool:
            self.tool = self.wal_entry.tool if self.wal_entry_id else (self.proposal or {}).get("tool", "")
        super().save(*args, **kwargs)

    @property
    def step(self) -> str:
        return self.wal_entry.step_id if self.wal_entry_id else self.step_id
