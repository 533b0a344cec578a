"""The admin: a window on the durable state. The engine's services own the writes
(orchestrator/engine/), so the admin shows the harness's records read-only; the WAL and
the audit log can never be added to, changed or deleted here."""
from django.contrib import admin
from django.urls import reverse
from django.utils.html import format_html, format_html_join

from .models import (
    ApiToken, AuditEntry, DemoContractExtraction, DemoDestination, DemoSource, IdempotencyRecord, Snapshot, Step,
    Task, TaskEvent, WalEntry,
)

admin.site.site_header = "Orchestrator administration"
admin.site.site_title = "Orchestrator admin"
admin.site.index_title = "Records"


def _changelist(model, task_id: int) -> str:
    opts = model._meta
    return reverse(f"admin:{opts.app_label}_{opts.model_name}_changelist") + f"?task__id__exact={task_id}"


def task_link(obj):
    if not obj.task_id:
        return "—"
    return format_html('<a href="{}">#{}</a>', reverse("admin:orchestrator_task_change", args=[obj.task_id]),
                       obj.task_id)


task_link.short_description = "task"
task_link.admin_order_field = "task"


class ReadOnlyAdmin(admin.ModelAdmin):
    """Viewing only: the engine writes these rows."""

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False


class AppendOnlyAdmin(ReadOnlyAdmin):
    """Records that are never rewritten or removed (the WAL, the audit log)."""

    def has_delete_permission(self, request, obj=None):
        return False


# --- Task and its parts -------------------------------------------------------------------

class StepInline(admin.TabularInline):
    model = Step
    fields = ("position", "step_id", "title", "status", "attempts", "started_at", "finished_at", "depends_on",
              "reads", "error")
    readonly_fields = fields
    extra = 0
    can_delete = False
    show_change_link = True
    ordering = ("position",)

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False


@admin.register(Task)
class TaskAdmin(admin.ModelAdmin):
    list_display = ("id", "type", "title", "status", "progress", "recovery_attempts", "worker", "created_by",
                    "created_at", "updated_at")
    list_display_links = ("id", "type")
    list_filter = ("status", "type", "created_at")
    search_fields = ("=id", "title", "type", "status_reason")
    date_hierarchy = "created_at"
    list_select_related = ("created_by",)
    inlines = [StepInline]
    fieldsets = (
        (None, {"fields": ("type", "title", "status", "status_reason", "error", "page", "related")}),
        ("Input", {"fields": ("params", "limits")}),
        ("Progress", {"fields": ("steps_done", "steps_total", "tokens_used", "active_seconds", "recovery_attempts",
                                 "checkpoint_version", "event_seq")}),
        ("Worker and lease", {"fields": ("lease_owner", "lease_epoch", "heartbeat_at", "worker_host", "worker_pid",
                                         "control", "control_requested_at")}),
        ("Times", {"fields": ("created_by", "created_at", "updated_at", "started_at", "finished_at")}),
    )
    # Only the title is an operator's free text; everything else goes through the services
    # (state machine, audit), so it is read-only here.
    readonly_fields = ("type", "status", "status_reason", "error", "page", "related", "params", "limits",
                       "steps_done", "steps_total", "tokens_used", "active_seconds", "recovery_attempts",
                       "checkpoint_version", "event_seq", "lease_owner", "lease_epoch", "heartbeat_at",
                       "worker_host", "worker_pid", "control", "control_requested_at", "created_by", "created_at",
                       "updated_at", "started_at", "finished_at")

    def has_add_permission(self, request):
        return False  # tasks are created through the New task page, the API or the CLI

    @admin.display(description="progress")
    def progress(self, obj):
        return f"{obj.steps_done}/{obj.steps_total} ({obj.progress_percent}%)"

    @admin.display(description="worker")
    def worker(self, obj):
        return f"{obj.worker_host}:{obj.worker_pid}" if obj.worker_pid else "—"

    @admin.display(description="task page")
    def page(self, obj):
        if not obj.pk:
            return "—"
        return format_html('<a href="{}">Open the task page</a>', reverse("task_detail", args=[obj.pk]))

    @admin.display(description="records")
    def related(self, obj):
        if not obj.pk:
            return "—"
        links = [(m._meta.verbose_name_plural.capitalize(), _changelist(m, obj.pk))
                 for m in (Step, WalEntry, Snapshot, TaskEvent, AuditEntry)]
        return format_html_join(" · ", '<a href="{1}">{0}</a>', links)


@admin.register(Step)
class StepAdmin(ReadOnlyAdmin):
    list_display = ("id", task_link, "position", "step_id", "title", "status", "attempts", "started_at",
                    "finished_at", "duration")
    list_filter = ("status",)
    search_fields = ("=task__id", "step_id", "title", "error")
    date_hierarchy = "started_at"
    list_select_related = ("task",)

    @admin.display(description="duration (s)")
    def duration(self, obj):
        value = obj.duration_seconds
        return "—" if value is None else f"{value:.2f}"


@admin.register(WalEntry)
class WalEntryAdmin(AppendOnlyAdmin):
    list_display = ("id", task_link, "step_id", "call_index", "tool", "idempotency_key", "idempotent", "status",
                    "worker", "created_at", "completed_at")
    list_filter = ("status", "idempotent", "tool")
    search_fields = ("=task__id", "idempotency_key", "step_id", "tool", "error")
    date_hierarchy = "created_at"
    list_select_related = ("task",)


@admin.register(Snapshot)
class SnapshotAdmin(ReadOnlyAdmin):
    list_display = ("id", task_link, "version", "step_id", "created_at")
    search_fields = ("=task__id", "step_id")
    date_hierarchy = "created_at"
    list_select_related = ("task",)


@admin.register(TaskEvent)
class TaskEventAdmin(AppendOnlyAdmin):
    list_display = ("id", task_link, "seq", "kind", "short_payload", "created_at")
    list_filter = ("kind",)
    search_fields = ("=task__id", "kind")
    date_hierarchy = "created_at"
    list_select_related = ("task",)

    @admin.display(description="payload")
    def short_payload(self, obj):
        text = str(obj.payload)
        return text if len(text) <= 120 else text[:119] + "…"


@admin.register(IdempotencyRecord)
class IdempotencyRecordAdmin(ReadOnlyAdmin):
    list_display = ("key", "tool", "created_at")
    list_filter = ("tool",)
    search_fields = ("key", "tool")
    date_hierarchy = "created_at"


@admin.register(AuditEntry)
class AuditEntryAdmin(AppendOnlyAdmin):
    list_display = ("at", "actor_name", "action", task_link, "ip", "reason")
    list_filter = ("action",)
    search_fields = ("=task__id", "actor_name", "action", "reason")
    date_hierarchy = "at"
    list_select_related = ("task",)


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin):
    """Only the prefix is shown: the token itself is never stored, its hash is not shown.
    Create tokens with `manage.py apitoken USERNAME`; delete one here to revoke it."""

    list_display = ("prefix_display", "user", "created_at", "last_used_at")
    search_fields = ("prefix", "user__username")
    list_select_related = ("user",)
    date_hierarchy = "created_at"
    fields = ("user", "prefix_display", "created_at", "last_used_at")
    readonly_fields = fields

    @admin.display(description="token", ordering="prefix")
    def prefix_display(self, obj):
        return f"{obj.prefix}…"

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False


# --- The demo workloads' tables -----------------------------------------------------------

@admin.register(DemoSource)
class DemoSourceAdmin(admin.ModelAdmin):
    list_display = ("id", "amount")
    search_fields = ("=id",)


@admin.register(DemoDestination)
class DemoDestinationAdmin(admin.ModelAdmin):
    list_display = ("id", "amount")
    search_fields = ("=id",)


@admin.register(DemoContractExtraction)
class DemoContractExtractionAdmin(admin.ModelAdmin):
    list_display = ("contract", task_link, "parties", "dates", "amounts")
    search_fields = ("contract",)
