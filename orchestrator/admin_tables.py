"""Admin changelists that stay usable on a year of records (tens of millions of progress events,
WAL rows and idempotency records on PostgreSQL; `bench/list.py` measures them).

Django's admin, left alone, pays for a big table three times per page: a `COUNT(*)` of the
whole table (and another of the filtered list), a `SELECT DISTINCT` of every value for each
"all values" filter, and a `DISTINCT date_trunc(…)` scan for the date drill-down. A table of
50,000,000 rows turns each into seconds. `LargeTableAdmin` replaces them:

- the count comes from `EstimatedCountPaginator`: exact up to EXACT_COUNT_UP_TO rows (a bounded
  `COUNT` over `LIMIT`), the planner's estimate past that (shown as "about N"), and such a list
  pages through its first EXACT_COUNT_UP_TO rows only: a page a million rows deep would be an
  `OFFSET` of a million (narrow the list by task or date to go further);
- "all values" filters become `RecentValuesFilter`: the values of the newest RECENT_ROWS rows
  (read through the primary key's index), plus the chosen one;
- the date drill-down is left out (`date_hierarchy = None`); date filters (today, past 7 days,
  this month, this year) are kept, they cost one indexed range each;
- search uses indexed lookups only (`search_fields` of the subclass name them: a task id, the
  start of an idempotency key), never `icontains` over millions of rows.
"""
import json
from functools import cached_property

from django.contrib import admin
from django.core.paginator import Paginator
from django.db import connections
from django.db.models import Q
from django.utils.text import smart_split, unescape_string_literal

EXACT_COUNT_UP_TO = 10_000
RECENT_ROWS = 10_000


class EstimatedCountPaginator(Paginator):
    """Exact counts for short lists, the planner's estimate for long ones (PostgreSQL; SQLite
    counts exactly, its tables being the small, single-machine kind)."""

    estimated = False  # the template says "about" when set

    @cached_property
    def count(self) -> int:
        queryset = self.object_list
        bounded = queryset.order_by()[:EXACT_COUNT_UP_TO + 1].count()
        if bounded <= EXACT_COUNT_UP_TO:
            return bounded
        if connections[queryset.db].vendor != "postgresql":
            return queryset.count()
        self.estimated = True
        return max(bounded, planner_estimate(queryset))

    @cached_property
    def num_pages(self) -> int:
        pages = super().num_pages
        return min(pages, -(-EXACT_COUNT_UP_TO // self.per_page)) if self.estimated else pages


def planner_estimate(queryset) -> int:
    """How many rows PostgreSQL's planner expects `queryset` to return (EXPLAIN, not run)."""
    sql, params = queryset.order_by().query.sql_with_params()
    with connections[queryset.db].cursor() as cursor:
        cursor.execute(f"EXPLAIN (FORMAT JSON) {sql}", params)
        plan = cursor.fetchone()[0]
    plan = json.loads(plan) if isinstance(plan, str) else plan
    return int(plan[0]["Plan"]["Plan Rows"])


class RecentValuesFilter(admin.AllValuesFieldListFilter):
    """An "all values" filter whose choices are the values of the newest RECENT_ROWS rows: a
    `SELECT DISTINCT` over every row of a table of millions would run on each page view."""

    def __init__(self, field, request, params, model, model_admin, field_path):
        super().__init__(field, request, params, model, model_admin, field_path)
        rows = model._default_manager.all()
        oldest_recent = rows.order_by("-pk").values_list("pk", flat=True)[RECENT_ROWS - 1:RECENT_ROWS].first()
        if oldest_recent is not None:  # otherwise the table is short: all its rows are recent
            rows = rows.filter(pk__gte=oldest_recent)
        recent = (rows.exclude(**{f"{field_path}__isnull": True}).values_list(field_path, flat=True)
                  .distinct().order_by(field_path))
        chosen = [v for v in (self.lookup_val or []) if v]
        self.lookup_choices = sorted(set(recent) | set(chosen))


class IndexedSearch:
    """A search box that only asks what an index answers. `search_lookups` pairs a lookup
    with the kind of term it takes: `int` lookups see only whole numbers (a task id), `str`
    lookups every term; a term no lookup takes matches nothing. (Django's own search would
    cast an id column to text, `task_id::varchar = '123'`, which reads every row.)"""

    search_lookups: tuple[tuple[str, type], ...] = (("task_id", int),)
    search_help_text = "A task id."

    def get_search_results(self, request, queryset, search_term):
        if not search_term:
            return queryset, False
        for bit in smart_split(search_term):
            if bit.startswith(('"', "'")) and bit[0] == bit[-1]:
                bit = unescape_string_literal(bit)
            bit = bit.replace("\x00", "")
            number = bit.lstrip("#")
            alternatives = [Q(**{lookup: int(number)}) for lookup, kind in self.search_lookups
                            if kind is int and number.isdigit() and int(number) < 2**63]
            alternatives += [Q(**{lookup: bit}) for lookup, kind in self.search_lookups if kind is str]
            if not alternatives:
                return queryset.none(), False
            query = alternatives[0]
            for alternative in alternatives[1:]:
                query |= alternative
            queryset = queryset.filter(query)
        return queryset, False


class LargeTableAdmin(IndexedSearch):
    """Mixin for a changelist over a table that grows with every step (see the module's
    docstring): put it first in the bases, and name the indexed `search_lookups`."""

    paginator = EstimatedCountPaginator
    show_full_result_count = False
    date_hierarchy = None
