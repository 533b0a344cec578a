"""The review queue in the admin: read-only. Decisions go through the review page or the
API (review.services.review_decide), which validate them, apply them to the WAL and the
task, and audit who decided what and why; an admin edit would bypass all of that."""
from django.contrib import admin
from django.urls import reverse
from django.utils.html import format_html

from orchestrator.admin import ReadOnlyAdmin, TaskFilter, TaskRecordAdmin, task_link

from .models import ApprovalVote, ReviewItem
from .selectors import tool_names


class ToolFilter(admin.SimpleListFilter):
    """By tool, from the registries: an "all values" filter would read the distinct tools
    of a year of items on every view."""

    title = "tool"
    parameter_name = "tool"

    def lookups(self, request, model_admin):
        return [(name, name) for name in tool_names()]

    def queryset(self, request, queryset):
        value = self.value()
        return queryset if not value else queryset.filter(tool=value)


@admin.register(ReviewItem)
class ReviewItemAdmin(TaskRecordAdmin):
    list_display = ("id", task_link, "kind", "step", "tool", "idempotency_key", "status", "decision", "dead_worker",
                    "detected_at", "decided_by", "decided_at")
    list_display_links = ("id",)
    list_filter = (TaskFilter, "kind", "status", "decision", ToolFilter, "detected_at",
                   ("decided_by", admin.RelatedOnlyFieldListFilter))
    search_fields = ("=task__id", "wal_entry__idempotency_key", "note", "reason", "dead_worker")
    date_hierarchy = "detected_at"
    list_select_related = ("task", "wal_entry", "decided_by")
    fieldsets = (
        (None, {"fields": ("kind", "status", "page", "records", "wal_entry_link", "proposal")}),
        ("In doubt", {"fields": ("reason", "dead_worker", "detected_at", "evidence")}),
        ("Decision", {"fields": ("decision", "note", "decision_result", "decided_by", "decided_at")}),
        ("Approval", {"fields": ("expires_at", "on_expiry", "escalate_to", "expired_at", "escalated_at",
                                 "approvals_required", "votes_given")}),
    )
    readonly_fields = ("kind", "proposal", "status", "page", "records", "wal_entry_link", "reason", "dead_worker", "detected_at",
                       "evidence", "decision", "note", "decision_result", "decided_by", "decided_at", "expires_at",
                       "on_expiry", "escalate_to", "expired_at", "escalated_at", "approvals_required", "votes_given")

    @admin.display(description="two-person approval votes")
    def votes_given(self, obj):
        votes = list(obj.votes.all())
        if not votes:
            return "—"
        return format_html("<br>".join(["{} {} at {} ({})"] * len(votes)), *[
            part for v in votes for part in (v.reviewer_name, v.get_decision_display(), v.at, v.arguments_sha256[:12])])

    @admin.display(description="step", ordering="wal_entry__step_id")
    def step(self, obj):
        return obj.step

    @admin.display(description="idempotency key", ordering="wal_entry__idempotency_key")
    def idempotency_key(self, obj):
        return obj.wal_entry.idempotency_key if obj.wal_entry_id else "(approval: not run yet)"

    @admin.display(description="WAL entry")
    def wal_entry_link(self, obj):
        if not obj.wal_entry_id:
            return "—"
        return format_html('<a href="{}">{}</a>', reverse("admin:orchestrator_walentry_change",
                                                          args=[obj.wal_entry_id]), obj.wal_entry)

    @admin.display(description="review page")
    def page(self, obj):
        return format_html('<a href="{}">Open the review page</a>', reverse("review:detail", args=[obj.pk]))


@admin.register(ApprovalVote)
class ApprovalVoteAdmin(ReadOnlyAdmin):
    """Two-person approval: each reviewer's approval of an item's arguments (written by
    review.approvals only)."""
    list_display = ("id", "item", "reviewer_name", "decision", "arguments_sha256", "at")
    list_filter = ("decision", "at")
    search_fields = ("=item__id", "reviewer_name", "arguments_sha256")
    list_select_related = ("item",)
    readonly_fields = ("item", "reviewer", "reviewer_name", "decision", "arguments", "arguments_sha256", "note", "at")
