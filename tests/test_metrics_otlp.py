"""The metrics over OTLP (orchestrator/otlp_metrics.py): a real sweeper process with an OTLP
endpoint configured pushes the figures of GET /metrics to a real HTTP receiver, read with
OpenTelemetry's own protobuf messages; without an endpoint nothing is pushed."""
import gzip
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

from orchestrator import otlp_metrics
from orchestrator.engine import services
from tests.conftest import wait_for

pytestmark = pytest.mark.task_types("tests.support.testtypes")


class Receiver(ThreadingHTTPServer):
    """An OTLP/HTTP collector: keeps every metrics export it is sent, answers 200 to all."""

    def __init__(self):
        self.exports: list[ExportMetricsServiceRequest] = []
        self.paths: list[str] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                receiver.paths.append(self.path)
                if self.path == "/v1/metrics":
                    request = ExportMetricsServiceRequest()
                    request.ParseFromString(body)
                    receiver.exports.append(request)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def points(self, name: str) -> list[tuple[dict, float, object]]:
        """(attributes, value, the metric) of every data point of `name` received so far."""
        found = []
        for export in self.exports:
            for resource_metrics in export.resource_metrics:
                for scope in resource_metrics.scope_metrics:
                    for metric in scope.metrics:
                        if metric.name != name:
                            continue
                        data = metric.gauge if metric.HasField("gauge") else metric.sum
                        for point in data.data_points:
                            attributes = {a.key: a.value.string_value for a in point.attributes}
                            value = point.as_double if point.HasField("as_double") else point.as_int
                            found.append((attributes, value, metric))
        return found


@pytest.fixture
def receiver():
    server = Receiver()
    yield server
    server.shutdown()


def test_the_sweeper_pushes_the_metrics_to_the_otlp_endpoint(receiver, start_sweeper):
    for _ in range(2):
        services.task_create(type="test.interruptible", params={"mode": "sleep", "steps": 1, "seconds": 0.1})
    sweeper = start_sweeper(OTEL_EXPORTER_OTLP_ENDPOINT=receiver.url, OTEL_METRIC_EXPORT_INTERVAL=300,
                            OTEL_SERVICE_NAME="orchestrator-test")

    def queued_tasks():
        values = [value for attributes, value, _ in receiver.points("orch_tasks")
                  if attributes == {"status": "queued", "type": "test.interruptible"}]
        return values and values[-1] == 2

    try:
        wait_for(queued_tasks, timeout=30, message="orch_tasks over OTLP")
    except AssertionError as timeout:
        raise AssertionError(f"{timeout}; received {receiver.paths[:5]}; the sweeper said:\n"
                             f"{sweeper.output()[-3000:]}") from None
    assert "/v1/metrics" in receiver.paths
    # The same families as GET /metrics: gauges as gauges, counters as monotonic sums.
    (_, _, queue_age), *_ = receiver.points("orch_queue_oldest_age_seconds")
    assert queue_age.HasField("gauge")
    names = {m.name for e in receiver.exports for r in e.resource_metrics for s in r.scope_metrics for m in s.metrics}
    assert {"orch_tasks", "orch_review_open_items", "orch_inbox_pending_events", "orch_queue_waiting_tasks"} <= names
    resource = {a.key: a.value.string_value for a in receiver.exports[-1].resource_metrics[0].resource.attributes}
    assert resource["service.name"] == "orchestrator-test" and resource["service.instance.id"].startswith("sweeper-")


def test_a_counter_family_is_pushed_as_a_monotonic_sum_of_its_total(monkeypatch):
    """orch_llm_tokens_total{model,kind} and the like: the `_total` sample, cumulative."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    class Collector:
        def collect(self):
            tokens = CounterMetricFamily("orch_llm_tokens", "tokens", labels=["model"])
            tokens.add_metric(["m1"], 42)
            gauge = GaugeMetricFamily("orch_queue_waiting_tasks", "waiting")
            gauge.add_metric([], 3)
            yield tokens
            yield gauge

    figures = otlp_metrics.FiguresOnce(Collector(), fresh_for=60)
    [tokens] = otlp_metrics.observations(figures, "orch_llm_tokens", counter=True)
    assert (tokens.value, dict(tokens.attributes)) == (42, {"model": "m1"})
    [waiting] = otlp_metrics.observations(figures, "orch_queue_waiting_tasks", counter=False)
    assert waiting.value == 3


def test_a_database_that_cannot_be_read_gives_no_points_and_one_warning_per_outage(caplog):
    class Failing:
        fail = True

        def collect(self):
            if self.fail:
                raise RuntimeError("connection refused")
            yield from ()

    collector = Failing()
    figures = otlp_metrics.FiguresOnce(collector, fresh_for=0)
    with caplog.at_level("WARNING", logger="orchestrator.otlp_metrics"):
        assert otlp_metrics.observations(figures, "orch_tasks", counter=False) == []
        assert otlp_metrics.observations(figures, "orch_tasks", counter=False) == []
        collector.fail = False
        assert otlp_metrics.observations(figures, "orch_tasks", counter=False) == []
    messages = [r.getMessage() for r in caplog.records]
    assert len([m for m in messages if "could not read" in m]) == 1
    assert any("answers again" in m for m in messages)


def test_no_endpoint_no_push():
    assert not otlp_metrics.endpoint_configured({})
    assert not otlp_metrics.endpoint_configured({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x", "OTEL_SDK_DISABLED": "true"})
    assert otlp_metrics.endpoint_configured({"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://x/v1/metrics"})
    assert otlp_metrics.start({}) is False
