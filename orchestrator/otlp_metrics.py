"""The figures of GET /metrics (orchestrator/metrics.py), pushed over OTLP where an endpoint is
configured: `OTEL_EXPORTER_OTLP_METRICS_ENDPOINT`, or `OTEL_EXPORTER_OTLP_ENDPOINT` (then
`/v1/metrics` is appended), OTLP over HTTP, every `OTEL_METRIC_EXPORT_INTERVAL` ms (60,000 by
default; the exporter reads its headers and timeout from the OTEL_* variables too).

The sweeper (`manage.py recover --loop`) pushes them: the figures come from the database, as a
scrape's do, so one process per installation is enough, and the web processes, which answer
scrapes, push nothing (several would send the same figures under different resources).
Several sweepers each push theirs, told apart by `service.instance.id`.

Each Prometheus family becomes one OTel instrument of the same name: a gauge family an
observable gauge, a counter family an observable counter (cumulative, as Prometheus counts it);
the samples' labels become the attributes. The database is read once per export, not once per
instrument. When it cannot be read (an outage), that export carries no data points and one
warning is logged per outage, not one per export.
"""
import logging
import os
import threading
import time
import uuid

from prometheus_client.core import CounterMetricFamily

from . import telemetry
from .telemetry import truthy

log = logging.getLogger(__name__)

_provider = None
_lock = threading.Lock()


def endpoint_configured(environ=None) -> bool:
    env = os.environ if environ is None else environ
    return bool(env.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")) \
        and not truthy(env.get("OTEL_SDK_DISABLED"))


class FiguresOnce:
    """The collector's families, read at most once per `fresh_for` seconds: every instrument's
    callback of one export reads the same collection."""

    def __init__(self, collector, fresh_for: float):
        self.collector, self.fresh_for = collector, fresh_for
        self.read_at, self.families, self.failing = 0.0, {}, False
        self._lock = threading.Lock()

    def family(self, name: str):
        with self._lock:
            if time.monotonic() - self.read_at >= self.fresh_for:
                self.read_at = time.monotonic()
                self.families = self._read()
            return self.families.get(name)

    def _read(self) -> dict:
        from django.db import close_old_connections

        try:
            families = {family.name: family for family in self.collector.collect()}
        except Exception as exc:  # the database away: this export has no data points
            if not self.failing:
                log.warning("metrics over OTLP: could not read the figures from the database: %s: %s",
                            type(exc).__name__, exc)
            self.failing = True
            close_old_connections()
            return {}
        if self.failing:
            log.warning("metrics over OTLP: the database answers again")
        self.failing = False
        return families


def observations(figures: FiguresOnce, name: str, counter: bool):
    from opentelemetry.metrics import Observation

    family = figures.family(name)
    if family is None:
        return []
    # A counter family's samples are `<name>_total` (and `<name>_created`, left out).
    wanted = f"{name}_total" if counter else name
    return [Observation(sample.value, dict(sample.labels)) for sample in family.samples if sample.name == wanted]


def start(environ=None) -> bool:
    """Start pushing the metrics when an OTLP endpoint is configured; True when it does. Safe to
    call more than once."""
    global _provider
    env = os.environ if environ is None else environ
    if not endpoint_configured(env):
        return False
    with _lock:
        if _provider is not None:
            return True
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
        from opentelemetry.sdk.resources import SERVICE_INSTANCE_ID

        from .metrics import DatabaseCollector

        interval_ms = float(env.get("OTEL_METRIC_EXPORT_INTERVAL") or 60_000)
        resource = telemetry.resource(env, **{SERVICE_INSTANCE_ID: f"sweeper-{os.getpid()}-{uuid.uuid4().hex[:8]}"})
        provider = MeterProvider(resource=resource, metric_readers=[
            PeriodicExportingMetricReader(OTLPMetricExporter(), export_interval_millis=interval_ms)])
        meter = provider.get_meter("orchestrator")
        collector = DatabaseCollector()
        figures = FiguresOnce(collector, fresh_for=min(interval_ms / 2000, 5.0))
        for family in collector.collect():  # the names (a family is yielded even with no sample)
            counter = isinstance(family, CounterMetricFamily)
            callback = (lambda options, name=family.name, counter=counter: observations(figures, name, counter))
            create = meter.create_observable_counter if counter else meter.create_observable_gauge
            create(family.name, callbacks=[callback], description=family.documentation)
        _provider = provider
        log.info("metrics over OTLP: pushing every %.0f s", interval_ms / 1000)
    return True


def shutdown() -> None:
    """Push what is pending and stop (the sweeper's exit)."""
    global _provider
    with _lock:
        if _provider is not None:
            _provider.shutdown()
            _provider = None
