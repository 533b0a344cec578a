"""The review queue: side effects whose outcome is unknown wait here for a human."""
from django.conf import settings
from django.db import models


class ReviewStatus(models.TextChoices):
    OPEN = "open"
    DECIDED = "decided"


class Decision(models.TextChoices):
    HAPPENED = "happened", "It happened (keep its result, do not repeat)"
    NOT_HAPPENED = "not_happened", "It did not happen (perform it again, same key)"
    SKIP = "skip", "Skip it (continue without it)"
    ABORT_TASK = "abort_task", "Abort the task"


class ReviewItem(models.Model):
    task = models.ForeignKey("orchestrator.Task", on_delete=models.CASCADE, related_name="review_items")
    wal_entry = models.OneToOneField("orchestrator.WalEntry", on_delete=models.CASCADE, related_name="review_item")
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
        indexes = [models.Index(fields=["status", "detected_at"], name="review_status_detected")]

    def __str__(self):
        return f"review #{self.pk} task {self.task_id} {self.wal_entry.tool} ({self.status})"
