"""What every admin class of the harness stands on: who may open it, and a changelist that
turns a filter value the database cannot take into an invalid lookup instead of a 500. A module
of its own, so that the admin modules (admin.py and the admin_* it loads) import it, not each other."""
from django.contrib import admin
from django.contrib.admin.options import IncorrectLookupParameters
from django.db import DataError, transaction

from . import roles


class AdminsOnly:
    """Every permission, viewing included, for superusers only (a staff user's model
    permissions do not open it): for what reaches outside the harness or holds its secrets."""

    def has_module_permission(self, request):
        return roles.is_admin(request.user)

    def has_view_permission(self, request, obj=None):
        return roles.is_admin(request.user)

    def has_add_permission(self, request, *args):
        return roles.is_admin(request.user)

    def has_change_permission(self, request, obj=None):
        return roles.is_admin(request.user)

    def has_delete_permission(self, request, obj=None):
        return roles.is_admin(request.user)


class GuardedChangelistAdmin(admin.ModelAdmin):
    """A changelist whose filter values the database cannot take (an id or a year past
    64 bits: OverflowError on SQLite, DataError on PostgreSQL) is treated like any other
    invalid lookup: the admin redirects to the unfiltered list with `?e=1`, instead of a 500.
    The savepoint keeps a PostgreSQL transaction usable after the failed query."""

    def get_changelist_instance(self, request):
        try:
            with transaction.atomic(using=self.model.objects.db):
                return super().get_changelist_instance(request)
        except (OverflowError, DataError) as exc:
            raise IncorrectLookupParameters(f"a filter value is out of range: {exc}") from exc
