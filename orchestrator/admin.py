"""The admin: a window on the durable state for auditors. The engine's services own the
writes (orchestrator/engine/), so the admin shows the harness's records read-only; the WAL
and the audit log can never be added to, changed or deleted here — neither directly nor
through a cascade (a task cannot be deleted here: that would delete its WAL and detach its
audit entries).

Every record links to its task and to the task's other records (steps, WAL, snapshots,
events, audit); a changelist opened from such a link shows the task as an active filter."""
from django.contrib import admin, messages
from django.contrib.admin.options import IncorrectLookupParameters
from django.urls import reverse
from django.utils.html import format_html, format_html_join
from django.utils.http import urlencode

from . import selectors
from .admin_guards import AdminsOnly, GuardedChangelistAdmin  # noqa: F401 (the admin_* modules' base, here too)
from .admin_tables import LargeTableAdmin, RecentValuesFilter
from .engine import webhooks
from .engine.audit import audit
from .models import (
    AgentMemory, AgentMessage, ApiToken, AuditEntry, IdempotencyRecord, ModelCallAttempt,
    InboundEvent, RetentionRun, ReviewItem, Snapshot, Step, StepResult, Task, TaskEvent, WalEntry, WebhookRejection,
    WebhookSource,
)

admin.site.site_header = "Orchestrator administration"
admin.site.site_title = "Orchestrator admin"
admin.site.index_title = "Records"


TASK_PARAM = "task__id__exact"
MAX_ID = 2**63 - 1  # ids are signed 64-bit


def _changelist(model, task_id: int, **extra) -> str:
    opts = model._meta
    return (reverse(f"admin:{opts.app_label}_{opts.model_name}_changelist") + "?"
            + urlencode({TASK_PARAM: task_id, **extra}))


def _change(obj) -> str:
    opts = obj._meta
    return reverse(f"admin:{opts.app_label}_{opts.model_name}_change", args=[obj.pk])


def task_records(task_id: int | None):
    """Links to every kind of record of one task, with how many there are."""
    if not task_id:
        return "—"
    links = [("Task #%s" % task_id, reverse("admin:orchestrator_task_change", args=[task_id]))]
    for model in TASK_RECORD_MODELS:
        count = model.objects.filter(task_id=task_id).count()
        links.append((f"{model._meta.verbose_name_plural.capitalize()} ({count})", _changelist(model, task_id)))
    links.append(("Task page", reverse("task_detail", args=[task_id])))
    return format_html_join(" · ", '<a href="{1}">{0}</a>', links)


class TaskFilter(admin.SimpleListFilter):
    """The task a changelist is narrowed to (the links from a task use it); shown only
    while one is chosen, so that a list of thousands of tasks is never rendered."""

    title = "task"
    parameter_name = TASK_PARAM

    def lookups(self, request, model_admin):
        value = self.value()
        if value is None:
            return []
        # The admin drops a filter without choices *and* its parameter, which would list
        # every task's records as if they were this one's: refuse a bad id instead.
        if not str(value).isdigit() or not 1 <= int(value) <= MAX_ID:
            raise IncorrectLookupParameters(f"not a task id: {value!r}")
        task = Task.objects.filter(pk=value).only("id", "type", "status").first()
        return [(str(value), str(task) if task else f"#{value} (deleted)")]

    def queryset(self, request, queryset):
        value = self.value()
        return queryset if value is None else queryset.filter(task_id=int(value))


def task_link(obj):
    if not obj.task_id:
        return "—"
    return format_html('<a href="{}">#{}</a>', reverse("admin:orchestrator_task_change", args=[obj.task_id]),
                       obj.task_id)


task_link.short_description = "task"
task_link.admin_order_field = "task"


class ReadOnlyAdmin(GuardedChangelistAdmin):
    """Viewing only: the engine writes these rows, and removing one would corrupt a task's
    durable state (a step, a snapshot, an idempotency record that prevents a second
    side effect), so they cannot be deleted here either."""

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


class TaskRecordAdmin(ReadOnlyAdmin):
    """A record that belongs to a task: filterable by task, linked to the task's others."""

    readonly_fields = ("records",)

    @admin.display(description="task records")
    def records(self, obj):
        return task_records(obj.task_id)


class AppendOnlyAdmin(TaskRecordAdmin):
    """Records that are never rewritten or removed (the WAL, the audit log, the progress
    log), whatever ReadOnlyAdmin allows; not even a superuser may."""

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False

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
class TaskAdmin(LargeTableAdmin, GuardedChangelistAdmin):
    list_display = ("id", "type", "title", "status", "progress", "recovery_attempts", "worker", "created_by",
                    "created_at", "updated_at")
    list_display_links = ("id", "type")
    list_filter = ("status", ("type", RecentValuesFilter), ("control", RecentValuesFilter), "created_at",
                   "finished_at", "created_by")
    search_fields = ("title", "type", "id")  # what the task list searches (selectors.task_text_query)
    search_help_text = "Words of the title, the type, or the task id (as on the task list)."

    def get_search_results(self, request, queryset, search_term):
        term = search_term.strip().replace("\x00", "")
        return (queryset.filter(selectors.task_text_query(term)) if term else queryset), False
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

    def has_delete_permission(self, request, obj=None):
        # Deleting a task would cascade to its WAL, steps, snapshots and events and detach
        # its audit entries: the history an auditor relies on. Stop or terminate it instead.
        return False

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
        return task_records(obj.pk)


@admin.register(Step)
class StepAdmin(LargeTableAdmin, TaskRecordAdmin):
    list_display = ("id", task_link, "position", "step_id", "title", "status", "attempts", "started_at",
                    "finished_at", "duration")
    list_filter = (TaskFilter, "status", "started_at", "finished_at")
    search_fields = ("task",)
    list_select_related = ("task",)
    readonly_fields = ("records", "wal")

    @admin.display(description="WAL entries of this step")
    def wal(self, obj):
        count = WalEntry.objects.filter(task_id=obj.task_id, step_id=obj.step_id).count()
        return format_html('<a href="{}">{} WAL entr{}</a>', _changelist(WalEntry, obj.task_id, step_id=obj.step_id),
                           count, "y" if count == 1 else "ies")

    @admin.display(description="duration (s)")
    def duration(self, obj):
        value = obj.duration_seconds
        return "—" if value is None else f"{value:.2f}"


@admin.register(WalEntry)
class WalEntryAdmin(LargeTableAdmin, AppendOnlyAdmin):
    list_display = ("id", task_link, "step_id", "call_index", "tool", "idempotency_key", "idempotent", "status",
                    "worker", "created_at", "completed_at")
    list_filter = (TaskFilter, "status", "idempotent", ("tool", RecentValuesFilter), "created_at")
    search_fields = ("task", "idempotency_key")
    search_lookups = (("task_id", int), ("idempotency_key__startswith", str))
    search_help_text = "A task id, or the start of an idempotency key (t<task>:<step>:<n>)."
    list_select_related = ("task",)
    readonly_fields = ("records", "step_link", "idempotency_record")

    @admin.display(description="step")
    def step_link(self, obj):
        step = Step.objects.filter(task_id=obj.task_id, step_id=obj.step_id).first()
        if step is None:
            return obj.step_id or "—"
        return format_html('<a href="{}">{}</a>', _change(step), step)

    @admin.display(description="idempotency record")
    def idempotency_record(self, obj):
        record = IdempotencyRecord.objects.filter(key=obj.idempotency_key).first()
        if record is None:
            return "—"
        return format_html('<a href="{}">{}</a>', _change(record), record)


@admin.register(Snapshot)
class SnapshotAdmin(LargeTableAdmin, TaskRecordAdmin):
    list_display = ("id", task_link, "version", "full", "step_id", "created_at")
    list_filter = (TaskFilter, "full", "created_at")
    search_fields = ("task",)
    list_select_related = ("task",)


@admin.register(WebhookSource)
class WebhookSourceAdmin(GuardedChangelistAdmin):
    """Outside systems that post signed events (POST /api/hooks/<name>/tasks/<id>/events).
    A secret is shown once, when it is made (on creation, or by the rotate action)."""

    list_display = ("name", "enabled", "allowed_types", "task_types", "priority_ceiling", "secrets_kept",
                    "last_used_at", "created_at")
    list_filter = ("enabled", "created_at")
    search_fields = ("name",)
    date_hierarchy = "created_at"
    exclude = ("secrets",)
    readonly_fields = ("secrets_kept", "last_used_at", "created_at")
    actions = ["rotate_secret", "revoke_secrets_now"]

    @admin.display(description="secrets")
    def secrets_kept(self, obj):
        return len(obj.secrets or [])

    def save_model(self, request, obj, form, change):
        secret = None
        if not change:
            secret = webhooks.new_secret()
            obj.secrets = [secret]
        super().save_model(request, obj, form, change)
        audit(action="webhook_source.save", actor=request.user, ip=request.META.get("REMOTE_ADDR"),
              after={"name": obj.name, "allowed_types": obj.allowed_types, "task_types": obj.task_types,
                     "priority_ceiling": obj.priority_ceiling, "enabled": obj.enabled})
        if secret:
            messages.warning(request, f"The secret of {obj.name} — shown this once, copy it to the sender now: {secret}")

    @admin.action(description="Rotate the secret (the previous ones keep working until dropped)")
    def rotate_secret(self, request, queryset):
        for source in queryset:
            secret = webhooks.rotate(source)
            audit(action="webhook_source.rotate", actor=request.user, ip=request.META.get("REMOTE_ADDR"),
                  after={"name": source.name, "secrets_kept": len(source.secrets)})
            messages.warning(request, f"The new secret of {source.name} — shown this once: {secret}")

    @admin.action(description="Revoke every secret now and make a new one (a leaked secret: the old ones stop "
                              "working at once)")
    def revoke_secrets_now(self, request, queryset):
        for source in queryset:
            secret = webhooks.revoke_now(source, actor=request.user, ip=request.META.get("REMOTE_ADDR"))
            messages.warning(request, f"Every previous secret of {source.name} is refused from now on. Its new "
                                      f"secret — shown this once, give it to the sender: {secret}")


@admin.register(WebhookRejection)
class WebhookRejectionAdmin(ReadOnlyAdmin):
    """Rejected webhook requests, counted per source, reason and client address (a repeat
    within an hour raises the count; engine/webhooks.py)."""

    list_display = ("id", "source", "asked_for", "reason", "ip", "count", "first_at", "last_at", "last_task_id")
    list_filter = ("reason", "source", "last_at")
    search_fields = ("source", "asked_for", "ip")
    date_hierarchy = "last_at"


@admin.register(InboundEvent)
class InboundEventAdmin(LargeTableAdmin, TaskRecordAdmin):
    """Events sent into tasks (their inboxes), with what each task did with them."""

    list_display = ("id", task_link, "seq", "type", "priority", "source", "actor_name", "state", "outcome",
                    "created_at", "consumed_at")
    list_filter = (TaskFilter, "state", ("priority", RecentValuesFilter), ("type", RecentValuesFilter), "created_at")
    search_fields = ("task",)
    list_select_related = ("task",)


@admin.register(RetentionRun)
class RetentionRunAdmin(ReadOnlyAdmin):
    """What each run of the retention rules pruned, and when (engine/retention.py)."""

    list_display = ("started_at", "finished_at", "tasks", "stream_events_deleted", "events_deleted", "wal_deleted",
                    "idempotency_deleted", "notifications_deleted", "webhook_rejections_deleted", "error")
    list_filter = ("started_at",)
    date_hierarchy = "started_at"


@admin.register(AgentMessage)
class AgentMessageAdmin(LargeTableAdmin, TaskRecordAdmin):
    """Agents' dialogs, message by message, as the model saw them (read-only)."""

    list_display = ("id", task_link, "turn", "order", "role", "name", "interrupted", "prompt_tokens",
                    "completion_tokens", "created_at")
    list_filter = (TaskFilter, "role", "interrupted", "created_at")
    search_fields = ("task",)
    list_select_related = ("task",)


@admin.register(ModelCallAttempt)
class ModelCallAttemptAdmin(LargeTableAdmin, TaskRecordAdmin):
    """The ledger of every model call attempt (tokens, cost, outcome), with its sums per model,
    per task type and per day over the rows the filters select."""

    change_list_template = "admin/orchestrator/modelcallattempt/change_list.html"
    list_display = ("id", task_link, "step_id", "purpose", "profile", "model", "outcome", "prompt_tokens",
                    "completion_tokens", "cached_tokens", "estimated", "cost", "created_at")
    list_filter = (TaskFilter, "outcome", ("purpose", RecentValuesFilter), "estimated", ("profile", RecentValuesFilter),
                   "created_at")
    list_select_related = ("task",)
    SUMS_SHOWN = 50  # rows of each sum table (the busiest first)
    SUMS_DEFAULT_DAYS = 30  # summed when no date or task narrows the list (a year of rows is millions)

    def changelist_view(self, request, extra_context=None):
        from datetime import timedelta

        from django.utils import timezone

        response = super().changelist_view(request, extra_context=extra_context)
        changelist = getattr(response, "context_data", {}).get("cl")
        if changelist is not None:
            rows, scope = changelist.queryset, "the attempts selected"
            if not any(k.startswith("created_at") or k == TASK_PARAM for k in request.GET):
                rows = rows.filter(created_at__gte=timezone.now() - timedelta(days=self.SUMS_DEFAULT_DAYS))
                scope = f"the attempts selected in the last {self.SUMS_DEFAULT_DAYS} days (narrow by date for others)"
            response.context_data["ledger_sums"] = ledger_sums(rows, self.SUMS_SHOWN)
            response.context_data["ledger_sums_scope"] = scope
        return response


def ledger_sums(rows, shown: int) -> list[tuple[str, list[dict]]]:
    """The selected attempts summed per model, per task type and per day (most tokens first)."""
    from django.db.models import Count, F, Sum
    from django.db.models.functions import TruncDate

    def by(label: str, **group):
        summed = (rows.order_by().annotate(**group).values("key").annotate(
            attempts=Count("id"), prompt=Sum("prompt_tokens"), completion=Sum("completion_tokens"),
            cached=Sum("cached_tokens"), cost=Sum("cost")).order_by("-prompt")[:shown])
        return label, list(summed)

    return [by("model", key=F("model")), by("task type", key=F("task__type")),
            by("day", key=TruncDate("created_at"))]


@admin.register(AgentMemory)
class AgentMemoryAdmin(ReadOnlyAdmin):
    """Agents' long-term memory (facts kept across tasks, written by memory_write through the WAL)."""

    list_display = ("key", "task", "updated_at")
    search_fields = ("key", "value")
    date_hierarchy = "updated_at"

    def has_delete_permission(self, request, obj=None):
        return True  # forgetting a fact is an operator's call; the WAL keeps the write that made it


@admin.register(StepResult)
class StepResultAdmin(LargeTableAdmin, TaskRecordAdmin):
    """Large step results, stored apart from their Step rows (read-only like every task record)."""

    list_display = ("id", task_link, "step_id", "created_at")
    list_filter = (TaskFilter, "created_at")
    search_fields = ("task",)
    list_select_related = ("task",)


@admin.register(TaskEvent)
class TaskEventAdmin(LargeTableAdmin, AppendOnlyAdmin):
    list_display = ("id", task_link, "seq", "kind", "short_payload", "created_at")
    list_filter = (TaskFilter, ("kind", RecentValuesFilter), "created_at")
    search_fields = ("task",)
    list_select_related = ("task",)

    @admin.display(description="payload")
    def short_payload(self, obj):
        text = str(obj.payload)
        return text if len(text) <= 120 else text[:119] + "…"


@admin.register(IdempotencyRecord)
class IdempotencyRecordAdmin(LargeTableAdmin, ReadOnlyAdmin):
    list_display = ("key", "tool", "created_at")
    list_filter = (("tool", RecentValuesFilter), "created_at")
    search_fields = ("key",)
    search_lookups = (("key__startswith", str),)
    search_help_text = "The start of an idempotency key (t<task>:<step>:<n>)."
    readonly_fields = ("wal_entry",)

    @admin.display(description="WAL entry")
    def wal_entry(self, obj):
        entry = WalEntry.objects.filter(idempotency_key=obj.key).first()
        if entry is None:
            return "—"
        return format_html('<a href="{}">{}</a> of task <a href="{}">#{}</a>', _change(entry), entry,
                           reverse("admin:orchestrator_task_change", args=[entry.task_id]), entry.task_id)


@admin.register(AuditEntry)
class AuditEntryAdmin(LargeTableAdmin, AppendOnlyAdmin):
    list_display = ("at", "actor_name", "action", task_link, "ip", "reason")
    list_filter = (TaskFilter, ("action", RecentValuesFilter), "at", "actor")
    search_fields = ("actor_name", "action", "reason", "ip")
    search_help_text = "Words of the actor, the action, the reason or the IP address; or a task id."

    def get_search_results(self, request, queryset, search_term):
        # The audit log is searched by its words (a scan, bounded by the page's LIMIT when
        # matches are common), and a number is also a task id (its index).
        found, _ = admin.ModelAdmin.get_search_results(self, request, queryset, search_term)
        number = search_term.strip().lstrip("#")
        if number.isdigit() and int(number) < 2**63:
            found = found | queryset.filter(task_id=int(number))
        return found, False
    list_select_related = ("task",)


@admin.register(ApiToken)
class ApiTokenAdmin(GuardedChangelistAdmin):
    """Only the prefix is shown: the token itself is never stored, its hash is not shown.
    Create tokens with `manage.py apitoken USERNAME`; delete one here to revoke it."""

    list_display = ("prefix_display", "user", "created_at", "last_used_at", "expires_at", "expired")
    search_fields = ("prefix", "user__username")
    list_filter = ("created_at", "last_used_at", "expires_at")
    list_select_related = ("user",)
    date_hierarchy = "created_at"
    fields = ("user", "prefix_display", "created_at", "last_used_at", "expires_at", "expired")
    readonly_fields = fields

    @admin.display(description="expired", boolean=True)
    def expired(self, obj):
        return obj.is_expired()

    @admin.display(description="token", ordering="prefix")
    def prefix_display(self, obj):
        return f"{obj.prefix}…"

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False


# Every kind of record a task has, in the order the links show them.
TASK_RECORD_MODELS = (Step, WalEntry, Snapshot, TaskEvent, AuditEntry, ReviewItem)

# Model profiles (their keys are secrets): a module of their own.
from . import admin_profiles  # noqa: E402,F401

# Outgoing notifications (webhook subscriptions and their deliveries): admins only.
from . import admin_notifications  # noqa: E402,F401

# MCP servers (their headers and environment are secrets): admins only.
from . import admin_mcp  # noqa: E402,F401
