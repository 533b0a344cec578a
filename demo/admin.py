"""The demo's tables in the admin, read-only: the workloads write them (through db.upsert)."""
from django.contrib import admin

from .models import DemoContractExtraction, DemoDestination, DemoSource


class ReadOnly(admin.ModelAdmin):
    # No filter or search on a number: a value past 64 bits would reach the database as an error.
    show_full_result_count = False  # demo_source holds 20,000 rows by default: no second COUNT(*)

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(DemoSource)
class DemoSourceAdmin(ReadOnly):
    list_display = ("id", "amount")


@admin.register(DemoDestination)
class DemoDestinationAdmin(ReadOnly):
    list_display = ("id", "amount")


@admin.register(DemoContractExtraction)
class DemoContractExtractionAdmin(ReadOnly):
    list_display = ("contract", "task_id", "parties", "dates", "amounts")
    search_fields = ("contract",)  # text only: an id past 64 bits would be a database error, not a search
