"""Prometheus metrics, computed when scraped from the database (GET /metrics, orchestrator/web/metrics.py).

Workers are separate processes (and hosts), so nothing is counted in process memory: each
scrape asks the database, and every web process answers the same figures whichever one
Prometheus reaches (no multiprocess directory). Every query is an aggregate, bounded by an
index (or by a primary-key window: `STEP_WINDOW_ROWS`); Python only loops over the rows of
one window (step durations) and over the groups the aggregates return.

The metric names (docs/deployment.md, "Metrics"; deploy/grafana-dashboard.json uses them):

- `orch_tasks{status,type}`: tasks by status and type.
- `orch_tasks_stalled{type}`: running tasks whose current step has made no progress for
  ORCH_STALL_FACTOR × the p95 of their type's step durations (engine/stalls.py: the same test
  as the task list's badge), by type; a type with tasks running and none stalled reads 0.
- `orch_step_duration_seconds{task_type,quantile}`: p50 / p95 / max (quantile "1") of the
  durations of steps done in the last `STEP_DURATION_WINDOW_SECONDS`, and
  `orch_step_duration_sample_steps{task_type}`: how many steps that sample holds.
- `orch_steps_finished_per_second{status}`: steps finished (done, failed, skipped) over the
  last `STEP_RATE_WINDOW_SECONDS`.
- `orch_recoveries_last_hour`: recoveries started (the progress log's `recovery` events);
  `orch_tasks_recovering` and `orch_recovery_oldest_age_seconds`: recoveries in progress.
- `orch_review_open_items{kind}` and `orch_review_oldest_open_age_seconds{kind}`: the review
  queue (kind `effect`: a side effect in doubt; `approval`: a tool call to approve).
- `orch_inbox_pending_events{priority}` (inbox depth) and `orch_inbox_shed_events{priority}`
  (events refused by backpressure, kept as `shed` rows).
- `orch_llm_tokens_total{model,kind}` (prompt, completion, cached), `orch_llm_cost_total{model}`,
  `orch_llm_calls_total{model,outcome}`: the attempts ledger (ModelCallAttempt).
- `orch_queue_waiting_tasks` and `orch_queue_oldest_age_seconds`: tasks waiting for a worker
  to claim them (queued, or running with no lease holder), and the longest wait since the
  task was last handed to the broker.
- `orch_sweeper_retention_age_seconds`: since the newest retention run (the sweeper loop runs
  one every ORCH_RETAIN_EVERY_SECONDS; the loop keeps no other durable heartbeat), and
  `orch_sweep_schedule_lag_seconds`: how far the worker cluster's scheduled sweep is overdue.
- `orch_metrics_scrape_seconds`: how long this scrape's queries took.
"""
import threading
import time
from collections import defaultdict
from datetime import timedelta

from django.apps import apps
from django.db.models import Count, Max, Min, Sum
from django.db.models.functions import Coalesce
from django.utils import timezone
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import CollectorRegistry

from .engine import stalls

from .models import (
    InboundEvent, InboundState, ModelCallAttempt, RetentionRun, ReviewItem, ReviewStatus, Step, StepStatus, Task,
    TaskEvent, TaskStatus,
)

# Step figures read the newest rows of the step table only (a primary-key range): plan rows are
# written when a task starts running, so recently finished steps are among them unless a task
# planned this many steps ago is still running. No index on finished_at is kept for this (every
# step commit would write it).
STEP_WINDOW_ROWS = 20_000
STEP_RATE_WINDOW_SECONDS = 60
STEP_DURATION_WINDOW_SECONDS = 300
QUANTILES = (("0.5", 0.5), ("0.95", 0.95), ("1", 1.0))
RECOVERY_WINDOW_SECONDS = 3600
# Ledger rows older than this are folded into the running totals once (see LedgerTotals).
LEDGER_SETTLE_SECONDS = 120
SWEEP_FUNC = "orchestrator.engine.recovery.sweep"  # the worker cluster's schedule (migration 0005)


def quantile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    position = q * (len(sorted_values) - 1)
    low = int(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


class LedgerTotals:
    """Tokens, cost and calls by (model, outcome) since the ledger began, without summing the
    whole ledger at each scrape: rows settled for LEDGER_SETTLE_SECONDS are added to totals
    kept in this process once (a primary-key range each time), and the newer rows are summed
    at each scrape. The ledger is append-only (engine/llm_ledger.py inserts, never updates), so
    the counters only grow; a process's first scrape sums the ledger once."""

    FIELDS = ("prompt", "completion", "cached", "cost", "calls")

    def __init__(self):
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self.folded_up_to = 0
        self.folded: dict[tuple[str, str], dict[str, float]] = {}

    @staticmethod
    def _sums(rows) -> dict[tuple[str, str], dict[str, float]]:
        grouped = (rows.values("model", "outcome").order_by()
                   .annotate(prompt=Sum("prompt_tokens"), completion=Sum("completion_tokens"),
                             cached=Sum("cached_tokens"), cost=Sum("cost"), calls=Count("id")))
        return {(g["model"], g["outcome"]): {f: float(g[f] or 0) for f in LedgerTotals.FIELDS} for g in grouped}

    @staticmethod
    def _add(into: dict, sums: dict) -> None:
        for key, values in sums.items():
            slot = into.setdefault(key, dict.fromkeys(LedgerTotals.FIELDS, 0.0))
            for name, value in values.items():
                slot[name] += value

    def totals(self, now) -> dict[tuple[str, str], dict[str, float]]:
        with self.lock:
            newest = ModelCallAttempt.objects.aggregate(top=Max("pk"))["top"] or 0
            if newest < self.folded_up_to:
                self.reset()  # the table was emptied (a restored database, a test's rollback)
            settled = (ModelCallAttempt.objects.filter(pk__gt=self.folded_up_to,
                                                       created_at__lt=now - timedelta(seconds=LEDGER_SETTLE_SECONDS))
                       .aggregate(top=Max("pk"))["top"])
            if settled:
                self._add(self.folded, self._sums(ModelCallAttempt.objects.filter(
                    pk__gt=self.folded_up_to, pk__lte=settled)))
                self.folded_up_to = settled
            result = {key: dict(values) for key, values in self.folded.items()}
            self._add(result, self._sums(ModelCallAttempt.objects.filter(pk__gt=self.folded_up_to)))
            return result


ledger = LedgerTotals()


def _age(now, moment) -> float:
    return max(0.0, (now - moment).total_seconds()) if moment else 0.0


class DatabaseCollector:
    """A prometheus_client collector whose `collect` reads the figures above from the database."""

    def collect(self):
        started = time.perf_counter()
        now = timezone.now()
        yield from self.tasks()
        yield from self.stalled(now)
        yield from self.steps(now)
        yield from self.recoveries(now)
        yield from self.reviews(now)
        yield from self.inbox()
        yield from self.llm(now)
        yield from self.queue(now)
        yield from self.sweeper(now)
        yield GaugeMetricFamily("orch_metrics_scrape_seconds", "How long this scrape's database queries took.",
                                value=time.perf_counter() - started)

    def tasks(self):
        family = GaugeMetricFamily("orch_tasks", "Tasks by status and type.", labels=["status", "type"])
        for row in Task.objects.order_by().values("status", "type").annotate(n=Count("id")):
            family.add_metric([row["status"], row["type"]], row["n"])
        yield family

    def stalled(self, now):
        family = GaugeMetricFamily("orch_tasks_stalled",
                                   "Running tasks with no progress for ORCH_STALL_FACTOR x the p95 of their type's "
                                   "step durations, by type.", labels=["type"])
        tasks = stalls.running_tasks()
        counts = dict.fromkeys(sorted({t.type for t in tasks}), 0)
        for task, _, _ in stalls.stalled_among(tasks, now):
            counts[task.type] += 1
        for type_name, n in counts.items():
            family.add_metric([type_name], n)
        yield family

    def steps(self, now):
        top = Step.objects.aggregate(top=Max("pk"))["top"] or 0
        window = Step.objects.filter(pk__gt=top - STEP_WINDOW_ROWS)
        rate = GaugeMetricFamily("orch_steps_finished_per_second",
                                 f"Steps finished over the last {STEP_RATE_WINDOW_SECONDS} s, per second.",
                                 labels=["status"])
        finished = dict(window.filter(finished_at__gte=now - timedelta(seconds=STEP_RATE_WINDOW_SECONDS))
                        .order_by().values_list("status").annotate(n=Count("id")))
        for status in (StepStatus.DONE, StepStatus.FAILED, StepStatus.SKIPPED):
            rate.add_metric([status], finished.get(status, 0) / STEP_RATE_WINDOW_SECONDS)
        yield rate

        durations = defaultdict(list)
        for task_type, began, ended in (
                window.filter(status=StepStatus.DONE, started_at__isnull=False,
                              finished_at__gte=now - timedelta(seconds=STEP_DURATION_WINDOW_SECONDS))
                .values_list("task__type", "started_at", "finished_at").iterator()):
            durations[task_type].append(max(0.0, (ended - began).total_seconds()))
        figures = GaugeMetricFamily(
            "orch_step_duration_seconds",
            f"Durations of the steps done in the last {STEP_DURATION_WINDOW_SECONDS} s, by task type "
            f"(quantile 1 is the longest).", labels=["task_type", "quantile"])
        sample = GaugeMetricFamily("orch_step_duration_sample_steps",
                                   "How many steps orch_step_duration_seconds was computed from.", labels=["task_type"])
        for task_type, values in sorted(durations.items()):
            values.sort()
            for label, q in QUANTILES:
                figures.add_metric([task_type, label], quantile(values, q))
            sample.add_metric([task_type], len(values))
        yield figures
        yield sample

    def recoveries(self, now):
        recent = TaskEvent.objects.filter(kind="recovery",
                                          created_at__gte=now - timedelta(seconds=RECOVERY_WINDOW_SECONDS)).count()
        yield GaugeMetricFamily("orch_recoveries_last_hour",
                                "Recoveries started in the last hour (a task whose worker died, re-run from its "
                                "checkpoint).", value=recent)
        recovering = Task.objects.filter(recovering_since__isnull=False).aggregate(
            n=Count("id"), oldest=Min("recovering_since"))
        yield GaugeMetricFamily("orch_tasks_recovering", "Recoveries in progress (not running again yet).",
                                value=recovering["n"])
        yield GaugeMetricFamily("orch_recovery_oldest_age_seconds",
                                "Age of the oldest recovery in progress (0: none).",
                                value=_age(now, recovering["oldest"]))

    def reviews(self, now):
        rows = {row["kind"]: row for row in ReviewItem.objects.filter(status=ReviewStatus.OPEN).order_by()
                .values("kind").annotate(n=Count("id"), oldest=Min("detected_at"))}
        items = GaugeMetricFamily("orch_review_open_items",
                                  "Open review items: effect (a side effect in doubt), approval (a tool call to "
                                  "approve).", labels=["kind"])
        oldest = GaugeMetricFamily("orch_review_oldest_open_age_seconds",
                                   "Age of the oldest open review item (0: none).", labels=["kind"])
        for kind in ("effect", "approval"):
            row = rows.get(kind, {"n": 0, "oldest": None})
            items.add_metric([kind], row["n"])
            oldest.add_metric([kind], _age(now, row["oldest"]))
        yield items
        yield oldest

    def inbox(self):
        counts = {(row["state"], row["priority"]): row["n"] for row in InboundEvent.objects.filter(
            state__in=(InboundState.PENDING, InboundState.SHED)).order_by()
            .values("state", "priority").annotate(n=Count("id"))}
        pending = GaugeMetricFamily("orch_inbox_pending_events",
                                    "Events sent into tasks and not consumed yet (inbox depth), by priority.",
                                    labels=["priority"])
        shed = GaugeMetricFamily("orch_inbox_shed_events",
                                 "Events refused by backpressure (429), as kept, by priority.", labels=["priority"])
        for priority in range(5):
            pending.add_metric([str(priority)], counts.get((InboundState.PENDING, priority), 0))
            shed.add_metric([str(priority)], counts.get((InboundState.SHED, priority), 0))
        yield pending
        yield shed

    def llm(self, now):
        tokens = CounterMetricFamily("orch_llm_tokens", "Tokens of model calls by model, as billed or estimated.",
                                     labels=["model", "kind"])
        cost = CounterMetricFamily("orch_llm_cost", "What model calls cost at their profile's prices.",
                                   labels=["model"])
        calls = CounterMetricFamily("orch_llm_calls", "Model call attempts by model and outcome.",
                                    labels=["model", "outcome"])
        by_model = defaultdict(lambda: dict.fromkeys(LedgerTotals.FIELDS, 0.0))
        for (model, outcome), values in sorted(ledger.totals(now).items()):
            calls.add_metric([model, outcome], values["calls"])
            LedgerTotals._add(by_model, {model: values})
        for model, values in sorted(by_model.items()):
            for kind in ("prompt", "completion", "cached"):
                tokens.add_metric([model, kind], values[kind])
            cost.add_metric([model], values["cost"])
        yield tokens
        yield cost
        yield calls

    def queue(self, now):
        waiting = (Task.objects.filter(status__in=(TaskStatus.QUEUED, TaskStatus.RUNNING), lease_owner="")
                   .aggregate(n=Count("id"), oldest=Min(Coalesce("enqueued_at", "created_at"))))
        yield GaugeMetricFamily("orch_queue_waiting_tasks", "Tasks waiting for a worker to claim them.",
                                value=waiting["n"])
        yield GaugeMetricFamily("orch_queue_oldest_age_seconds",
                                "The longest a waiting task has waited since it was last handed to the broker "
                                "(0: none waits).", value=_age(now, waiting["oldest"]))

    def sweeper(self, now):
        retention = GaugeMetricFamily("orch_sweeper_retention_age_seconds",
                                      "Since the newest retention run (the sweeper loop runs one every "
                                      "ORCH_RETAIN_EVERY_SECONDS; no sample: none ever ran).")
        last = RetentionRun.objects.order_by("-pk").values_list("started_at", flat=True).first()
        if last is not None:
            retention.add_metric([], _age(now, last))
        yield retention
        schedule = GaugeMetricFamily("orch_sweep_schedule_lag_seconds",
                                     "How far the worker cluster's scheduled sweep is overdue (0: on time; no "
                                     "sample: no such schedule).")
        next_run = (apps.get_model("django_q", "Schedule").objects.filter(func=SWEEP_FUNC)
                    .aggregate(next=Min("next_run"))["next"])
        if next_run is not None:
            schedule.add_metric([], _age(now, next_run))
        yield schedule


registry = CollectorRegistry(auto_describe=False)
registry.register(DatabaseCollector())


def exposition() -> tuple[bytes, str]:
    """The scrape's body and content type."""
    return generate_latest(registry), CONTENT_TYPE_LATEST
