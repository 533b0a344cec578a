"""Traces: a span per run, step, checkpoint, effect and recovery, with the task's context
as attributes and steps inside their run. A provider with an in-memory exporter is
installed for the test only; without one, tracing is off and costs nothing."""
import json
import os
import subprocess
import sys
from datetime import timedelta

import pytest
from django.db.models import F
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from orchestrator import telemetry
from orchestrator.engine import recovery, services
from orchestrator.engine.lease import claim
from orchestrator.engine.worker import drive_inline
from orchestrator.models import Task, TaskEvent, WalEntry
from tests.conftest import ROOT, wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.task_types("tests.support.testtypes")]


@pytest.fixture
def exporter():
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    with telemetry.use_provider(provider):
        yield memory
    provider.shutdown()


def named(spans, name: str) -> list:
    return [s for s in spans if s.name == name]


def test_an_inline_run_has_step_checkpoint_and_effect_spans_inside_its_run_span(exporter):
    task = services.task_create(type="test.effects", params={"kind": "idempotent"})
    assert drive_inline(task.pk) == "completed"
    task = Task.objects.get(pk=task.pk)
    spans = exporter.get_finished_spans()

    (run,) = named(spans, "orchestrator.task.run")
    assert run.parent is None  # drive_inline: the run is the root
    assert dict(run.attributes) == {"task_id": task.pk, "lease_epoch": task.lease_epoch, "worker": run.attributes["worker"],
                                    "checkpoint_version": 0, "recovery_attempt": 0, "outcome": "completed"}

    steps = {s.attributes["step_id"]: s for s in named(spans, "orchestrator.step")}
    assert set(steps) == {"prepare", "effect", "finish"}
    for step in steps.values():
        assert step.parent.span_id == run.context.span_id  # from the pool thread, inside the run
        assert step.context.trace_id == run.context.trace_id
        assert step.attributes["task_id"] == task.pk and step.attributes["lease_epoch"] == task.lease_epoch
        assert step.attributes["attempt"] == 1
        assert run.start_time <= step.start_time and step.end_time <= run.end_time

    checkpoints = {s.attributes["step_id"]: s for s in named(spans, "orchestrator.checkpoint")}
    assert set(checkpoints) == set(steps)
    assert all(c.parent.span_id == run.context.span_id for c in checkpoints.values())
    versions = sorted(c.attributes["checkpoint_version"] for c in checkpoints.values())
    assert versions == [task.checkpoint_version - 2, task.checkpoint_version - 1, task.checkpoint_version]

    (effect,) = named(spans, "orchestrator.effect")
    entry = WalEntry.objects.get(task=task)
    assert effect.parent.span_id == steps["effect"].context.span_id
    assert effect.attributes["tool"] == "db.upsert" and effect.attributes["step_id"] == "effect"
    assert effect.attributes["wal_entry_id"] == entry.pk
    assert effect.attributes["idempotency_key"] == entry.idempotency_key
    assert effect.attributes["task_id"] == task.pk and effect.attributes["lease_epoch"] == task.lease_epoch


def test_a_recovery_span_carries_its_decision_and_the_resumed_run_its_attempt(exporter, settings):
    settings.ORCH_STALE_AFTER_SECONDS = 0.1
    task = services.task_create(type="test.effects", params={"kind": "idempotent"})
    dead = claim(task.pk)  # a worker took it and died without a heartbeat
    Task.objects.filter(pk=task.pk).update(status="running", heartbeat_at=F("heartbeat_at") - timedelta(seconds=5))
    assert recovery.sweep() == [task.pk]

    (span,) = named(exporter.get_finished_spans(), "orchestrator.recovery")
    recovered = Task.objects.get(pk=task.pk)
    event = TaskEvent.objects.get(task=task, kind="recovery")
    assert span.parent is None
    attributes = dict(span.attributes)
    assert {k: attributes[k] for k in ("task_id", "checkpoint_version", "event_id", "lease_epoch",
                                       "recovery_attempt", "resume_strategy", "recovered")} == {
        "task_id": task.pk, "checkpoint_version": recovered.checkpoint_version, "event_id": event.seq,
        "lease_epoch": dead.epoch, "recovery_attempt": 1, "resume_strategy": "requeue_from_checkpoint",
        "recovered": True}
    assert attributes["count_attempt"] is True and "cause" not in attributes  # the sweeper's default cause
    assert [e.name for e in span.events] == ["recovery: re-queued from checkpoint"]
    assert span.events[0].attributes["resume_strategy"] == "requeue_from_checkpoint"

    exporter.clear()
    assert drive_inline(task.pk) == "completed"
    (run,) = named(exporter.get_finished_spans(), "orchestrator.task.run")
    assert run.attributes["recovery_attempt"] == 1
    assert run.attributes["lease_epoch"] == Task.objects.get(pk=task.pk).lease_epoch == dead.epoch + 2  # fenced, claimed
    assert all(s.parent.span_id == run.context.span_id for s in named(exporter.get_finished_spans(), "orchestrator.step"))


def test_a_recovery_with_effects_in_doubt_records_one_event_per_entry(exporter, settings):
    from orchestrator.engine import checkpoint, wal
    from orchestrator.tasktypes import get_type
    from tests.support.helpers import write_intent

    settings.ORCH_STALE_AFTER_SECONDS = 0.1
    task = services.task_create(type="test.effects", params={"kind": "nonidempotent"})
    lease = claim(task.pk)
    task_type = get_type(task.type)
    checkpoint.ensure_plan(lease=lease, task_type=task_type, params=task_type.Params.model_validate(task.params))
    entry = write_intent(lease=lease, step_id="effect", call_index=0, tool_name="email.send",
                         args={"to": "a@example.org", "subject": "s", "body": "b"},
                         key=wal.idempotency_key(task.pk, "effect", 0), idempotent=False)
    Task.objects.filter(pk=task.pk).update(heartbeat_at=F("heartbeat_at") - timedelta(seconds=5))
    exporter.clear()
    assert recovery.sweep() == [task.pk]
    (span,) = named(exporter.get_finished_spans(), "orchestrator.recovery")
    assert span.attributes["resume_strategy"] == "awaiting_review"  # the decision, not the last entry's
    assert "wal_entry_id" not in span.attributes
    doubt, final = span.events
    assert doubt.attributes["wal_entry_id"] == entry.pk and doubt.attributes["resume_strategy"] == "open_review"
    assert final.name == "recovery: awaiting review"


def test_without_a_provider_the_wrappers_are_plain_calls():
    with telemetry.use_provider(None):  # as in the test settings (no OTEL_* variables)
        assert not telemetry.tracing_enabled()
        plain_calls()


def plain_calls():
    calls = []

    def execute(runner, ctx):
        calls.append((runner, ctx))
        return "ran"

    sentinel = object()  # has no task_id, lease, ...: a wrapper that looked would fail
    assert telemetry.traced_step(execute)(sentinel, sentinel) == "ran"
    assert telemetry.traced_run(lambda runner: "ran")(sentinel) == "ran"
    assert telemetry.traced_effect(lambda **kw: kw["x"])(x="ran", lease=sentinel) == "ran"
    assert telemetry.in_current_trace(execute) is execute
    assert not hasattr(sentinel, "_trace_context")
    assert calls == [(sentinel, sentinel)]


def python(code: str, **env) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "ORCH_OTEL", "ORCH_LOG"))}
    base["DJANGO_SETTINGS_MODULE"] = "orchestrator.settings"
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**base, **env}, capture_output=True,
                          text=True, timeout=60)


CHECK = """
import django; django.setup()
from django.conf import settings
from opentelemetry import trace
from orchestrator import telemetry
provider = trace.get_tracer_provider()
processors = [type(p).__name__ for p in getattr(getattr(provider, "_active_span_processor", None),
                                                "_span_processors", ())]
print(telemetry.tracing_enabled(), type(provider).__name__, processors,
      any("opentelemetry" in m for m in settings.MIDDLEWARE))
telemetry.traced_drive(lambda task_id: "done")(42)
"""


def test_configure_installs_a_provider_only_when_asked():
    off = python(CHECK)
    assert off.returncode == 0, off.stderr
    assert off.stdout.splitlines()[0] == "False ProxyTracerProvider [] False"

    console = python(CHECK, ORCH_OTEL_CONSOLE="1")
    assert console.returncode == 0, console.stderr
    lines = console.stdout.splitlines()
    assert lines[0] == "True TracerProvider ['SimpleSpanProcessor'] True"
    span = json.loads(lines[1])  # one JSON object per line
    assert span["name"] == "orchestrator.task.drive"
    assert span["attributes"] == {"task_id": 42, "outcome": "done"}
    assert span["resource"]["attributes"]["service.name"] == "orchestrator"

    otlp = python(CHECK.replace('telemetry.traced_drive(lambda task_id: "done")(42)', ""),
                  OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:9", OTEL_SERVICE_NAME="orch-test")
    assert otlp.returncode == 0, otlp.stderr
    assert otlp.stdout.splitlines()[0] == "True TracerProvider ['BatchSpanProcessor'] True"


@pytest.mark.workers
def test_spans_from_the_forked_executor_join_the_workers_trace(start_workers):
    """The executor is forked from the worker: its run and step spans are exported (flushed
    before os._exit) and are children of the worker's drive span."""
    cluster = start_workers(1, ORCH_OTEL_CONSOLE="1")
    task = services.task_create(type="demo.pipeline", params={"stages": 2, "seconds_per_stage": 0.1})
    wait_for(lambda: Task.objects.get(pk=task.pk).status == "completed", timeout=60, message="the task to complete")

    def spans():
        found = []
        for line in cluster.output().splitlines():
            if line.startswith('{"name": "orchestrator.'):
                found.append(json.loads(line))
        return found

    def of_task(found, name):  # (a Redis broker may hand this worker other tests' leftovers first)
        return [s for s in named_json(found, name) if s["attributes"].get("task_id") == task.pk]

    wait_for(lambda: of_task(spans(), "orchestrator.task.drive"), timeout=10, message="the drive span")
    everything = spans()
    (drive,) = of_task(everything, "orchestrator.task.drive")
    (run,) = of_task(everything, "orchestrator.task.run")
    steps = of_task(everything, "orchestrator.step")
    assert run["parent_id"] == drive["context"]["span_id"]
    assert run["context"]["trace_id"] == drive["context"]["trace_id"]
    assert {s["attributes"]["step_id"] for s in steps} == {"stage-01", "stage-02"}
    assert all(s["parent_id"] == run["context"]["span_id"] for s in steps)
    # The SDK refreshed its process-dependent resource in the forked executor.
    instance = "service.instance.id"
    assert run["resource"]["attributes"][instance] != drive["resource"]["attributes"][instance]
    assert drive["attributes"]["outcome"] == "executor finished"


def named_json(spans, name):
    return [s for s in spans if s["name"] == name]


def test_queries_outside_any_span_are_not_traced_and_polls_can_be_quieted(exporter):
    from opentelemetry import trace
    from opentelemetry.instrumentation.utils import is_instrumentation_enabled
    from opentelemetry.sdk.trace.sampling import Decision

    sampler = telemetry._sampler()
    root = trace.set_span_in_context(trace.INVALID_SPAN)
    assert sampler.should_sample(root, 1, "SELECT", trace.SpanKind.CLIENT).decision == Decision.DROP
    assert sampler.should_sample(root, 1, "orchestrator.recovery").decision == Decision.RECORD_AND_SAMPLE
    with trace.get_tracer("t", tracer_provider=TracerProvider()).start_as_current_span("orchestrator.task.run"):
        assert sampler.should_sample(None, 1, "SELECT", trace.SpanKind.CLIENT).decision == Decision.RECORD_AND_SAMPLE
    with telemetry.quiet():
        assert not is_instrumentation_enabled()
    assert is_instrumentation_enabled()
