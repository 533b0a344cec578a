"""The admin of outgoing notifications (docs/notifications.md): webhook subscriptions and their
deliveries. Admins only (superusers), for every permission, viewing included: a subscription
says where the installation's events go, and its URL may be on this host or the private
network (outbox.py says why that is allowed for an admin's choice).

A subscription's secret is made here, shown once (on creation, or by the rotate action) and
never again: the form has no secret field, the lists and pages show only that one is set."""
import json

from django import forms
from django.contrib import admin, messages
from django.urls import reverse
from django.utils.html import format_html
from django.utils.http import urlencode

from . import roles
from .admin_guards import AdminsOnly, GuardedChangelistAdmin
from .engine.audit import audit
from .models import DeliveryStatus, NotificationDelivery, NotificationSubscription
from .notifications import EVENTS
from .notifications import outbox


class SubscriptionForm(forms.ModelForm):
    url = forms.URLField(max_length=500, assume_scheme="https",
                         help_text="where each event is POSTed; any address an admin chooses, this host included")
    events = forms.MultipleChoiceField(choices=[(e, e) for e in EVENTS], required=False,
                                       widget=forms.CheckboxSelectMultiple,
                                       help_text="none ticked: every event")

    class Meta:
        model = NotificationSubscription
        fields = ("name", "url", "events", "enabled")

    def clean_url(self):
        url = self.cleaned_data["url"]
        if not url.lower().startswith(("http://", "https://")):
            raise forms.ValidationError("an http:// or https:// URL")
        return url


@admin.register(NotificationSubscription)
class NotificationSubscriptionAdmin(AdminsOnly, GuardedChangelistAdmin):
    form = SubscriptionForm
    list_display = ("name", "url", "events_taken", "enabled", "deliveries_summary", "created_at")
    list_filter = ("enabled",)
    search_fields = ("name", "url")
    readonly_fields = ("secret_state", "deliveries_summary", "created_at")
    actions = ["rotate_secret"]

    @admin.display(description="events")
    def events_taken(self, obj):
        return ", ".join(obj.events) if obj.events else "all"

    @admin.display(description="secret")
    def secret_state(self, obj):
        return ("set (shown once, when it was made; the rotate action makes a new one)"
                if obj and obj.secret else "made when you save")

    @admin.display(description="deliveries")
    def deliveries_summary(self, obj):
        if not obj or not obj.pk:
            return "—"
        counts = {status: obj.deliveries.filter(status=status).count() for status in DeliveryStatus.values}
        link = (reverse("admin:orchestrator_notificationdelivery_changelist") + "?"
                + urlencode({"subscription__id__exact": obj.pk}))
        return format_html('<a href="{}">{} pending, {} delivered, {} failed</a>', link,
                           counts["pending"], counts["delivered"], counts["failed"])

    def save_model(self, request, obj, form, change):
        secret = None
        if not change:
            secret = obj.secret = outbox.new_secret()
        super().save_model(request, obj, form, change)
        audit(action="notification_subscription.save", actor=request.user, ip=request.META.get("REMOTE_ADDR"),
              after={"name": obj.name, "url": obj.url, "events": obj.events, "enabled": obj.enabled})
        if secret:
            messages.warning(request, f"The signing secret of {obj.name} — shown this once, give it to the "
                                      f"receiver now (it verifies the webhook-signature header with it): {secret}")

    def delete_model(self, request, obj):
        audit(action="notification_subscription.delete", actor=request.user, ip=request.META.get("REMOTE_ADDR"),
              before={"name": obj.name, "url": obj.url})
        super().delete_model(request, obj)

    @admin.action(description="Make a new signing secret (the old one stops at once)")
    def rotate_secret(self, request, queryset):
        for subscription in queryset:
            secret = subscription.secret = outbox.new_secret()
            subscription.save(update_fields=["secret"])
            audit(action="notification_subscription.rotate", actor=request.user, ip=request.META.get("REMOTE_ADDR"),
                  after={"name": subscription.name})
            messages.warning(request, f"The new signing secret of {subscription.name} — shown this once: {secret}")


@admin.register(NotificationDelivery)
class NotificationDeliveryAdmin(AdminsOnly, GuardedChangelistAdmin):
    """What was sent where, and how it went. Read-only; "Deliver again" sends a delivery anew
    (attempts from zero) under its webhook-id."""

    list_display = ("id", "subscription", "event", "status", "attempts", "last_status_code", "error_start",
                    "next_attempt_at", "created_at", "delivered_at")
    list_filter = ("status", "event", "subscription")
    list_select_related = ("subscription",)
    search_fields = ("=message_id",)
    fields = ("subscription", "message_id", "event", "status", "attempts", "last_status_code", "last_error",
              "next_attempt_at", "created_at", "delivered_at", "payload_json")
    readonly_fields = fields
    actions = ["deliver_again"]

    @admin.display(description="last error")
    def error_start(self, obj):
        return (obj.last_error[:80] + "…") if len(obj.last_error) > 80 else obj.last_error

    @admin.display(description="payload (the signed body)")
    def payload_json(self, obj):
        return format_html("<pre>{}</pre>", json.dumps(obj.payload, indent=2, sort_keys=True, ensure_ascii=False))

    def has_add_permission(self, request, *args):
        return False

    def has_change_permission(self, request, obj=None):
        return False  # the action below is the one change an admin makes

    def has_deliver_permission(self, request):
        return roles.is_admin(request.user)

    @admin.action(description="Deliver again (attempts from zero, same webhook-id)", permissions=["deliver"])
    def deliver_again(self, request, queryset):
        count = outbox.deliver_again(list(queryset))
        audit(action="notification_delivery.deliver_again", actor=request.user, ip=request.META.get("REMOTE_ADDR"),
              after={"deliveries": [d.pk for d in queryset]})
        messages.info(request, f"{count} deliver{'y' if count == 1 else 'ies'} queued again.")
