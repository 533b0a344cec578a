"""Traces (OpenTelemetry) and the recovery context that logs and spans share.

Tracing is off unless asked for: `configure()` (called from the app's ready()) installs a
TracerProvider only when `OTEL_EXPORTER_OTLP_ENDPOINT` (or `..._TRACES_ENDPOINT`) is set
(OTLP over HTTP, batched) or `ORCH_OTEL_CONSOLE=1` (spans printed to stdout, synchronously).
Otherwise `_tracer` stays None and every traced function below is called directly: no
span objects, no attribute dicts, one extra Python call on the hot path.

Spans (names and attributes):

- `orchestrator.task.drive` (worker.drive_task, in the django-q2 worker): task_id, outcome.
- `orchestrator.task.run` (Runner.run, in the executor or inline): task_id, lease_epoch,
  worker, checkpoint_version (the checkpoint it starts from), recovery_attempt, outcome.
- `orchestrator.step` (Runner.execute, in a pool thread; parent: the run span): task_id,
  step_id, lease_epoch, generation, attempt.
- `orchestrator.checkpoint` (checkpoint.commit_step; parent: the run span): task_id,
  step_id, lease_epoch, checkpoint_version (the version the step committed).
- `orchestrator.effect` (wal.perform; parent: the step span): task_id, step_id,
  lease_epoch, tool, call_index, wal_entry_id, idempotency_key.
- `orchestrator.recovery` (recovery.recover_task): task_id, cause, recovered, and what
  recovery logged: checkpoint_version, event_id, lease_epoch, recovery_attempt,
  resume_strategy (the last decision), with one span event per log record.

Fork safety: the executor is forked from the worker. The SDK's BatchSpanProcessor
re-creates its export thread and empties its queue in a forked child
(os.register_at_fork), the TracerProvider refreshes its process-dependent resource
attributes there, and SimpleSpanProcessor has no thread at all. The executor leaves with
os._exit (no atexit hooks), so it calls `flush()` first; an executor killed with SIGKILL
(Force-terminate) loses its unexported spans, while the worker's drive span records the
outcome.
"""
import contextvars
import functools
import logging
import os
import threading
from contextlib import contextmanager

from opentelemetry import context as otel_context, trace

from .conf import TRUE_WORDS
from .logging import CONTEXT_FIELDS

log = logging.getLogger(__name__)

TRACER_NAME = "orchestrator"

_tracer = None  # None: tracing is off and every wrapper below is a plain call
_provider = None  # the provider configure() installed (flushed by flush())
_lock = threading.Lock()

# Fields a log record sets on the current span (a record's last word wins: recovery logs
# its decision last). The others (step_id, wal_entry_id, worker) go to span events only.
SPAN_FIELDS = ("task_id", "checkpoint_version", "event_id", "lease_epoch", "recovery_attempt", "resume_strategy")
# Fields capture_context() collects: what a recovery decided, for its caller's log line.
OUTCOME_FIELDS = ("task_id", "checkpoint_version", "event_id", "lease_epoch", "recovery_attempt", "resume_strategy")


def truthy(value: str | None) -> bool:
    """conf.boolean's true words; anything else is false (OTEL_SDK_DISABLED is OpenTelemetry's,
    which reads an unknown value as false; ORCH_OTEL_CONSOLE was already refused at start-up
    by conf.from_environment if it was not true or false)."""
    return (value or "").strip().lower() in TRUE_WORDS


def tracing_enabled() -> bool:
    return _tracer is not None


# --- configuration ------------------------------------------------------------------------
def configure(environ=None) -> bool:
    """Install the TracerProvider the environment asks for; True when tracing is on.
    Safe to call more than once (the first call that installs one wins)."""
    global _provider
    env = os.environ if environ is None else environ
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    console = truthy(env.get("ORCH_OTEL_CONSOLE"))
    if not (endpoint or console) or truthy(env.get("OTEL_SDK_DISABLED")):
        return False
    with _lock:
        if _provider is not None:
            return True
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor

        provider = TracerProvider(resource=resource(env),
                                  sampler=_sampler())
        if endpoint:
            # The exporter reads the endpoint, headers and timeout from the OTEL_* variables.
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        if console:
            # One JSON object per line, like the logs.
            provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter(
                formatter=lambda span: span.to_json(indent=None) + "\n")))
        trace.set_tracer_provider(provider)
        _provider = provider
        _set_tracer(provider)
        _instrument_libraries(provider)
    return True


def resource(env, **attributes):
    """The OpenTelemetry resource of this process's traces and metrics: `service.name` is
    "orchestrator" unless OTEL_SERVICE_NAME or OTEL_RESOURCE_ATTRIBUTES name it (the SDK reads
    those itself), plus `attributes`."""
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource

    named = env.get("OTEL_SERVICE_NAME") or "service.name=" in env.get("OTEL_RESOURCE_ATTRIBUTES", "")
    return Resource.create({**attributes, **({} if named else {SERVICE_NAME: "orchestrator"})})


def _sampler():
    """Every span, except SQL queries that belong to nothing: a running task's supervisor
    polls its row ten times a second, a sweeper every few seconds; traced, those would
    drown the traces that matter. Queries inside a request, run, step or recovery are kept."""
    from opentelemetry.sdk.trace.sampling import ALWAYS_ON, Decision, ParentBased, Sampler, SamplingResult

    class NoOrphanQueries(Sampler):
        def should_sample(self, parent_context, trace_id, name, kind=None, attributes=None, links=None,
                          trace_state=None):
            if kind == trace.SpanKind.CLIENT:  # database calls (the only client spans here)
                return SamplingResult(Decision.DROP)
            return ALWAYS_ON.should_sample(parent_context, trace_id, name, kind, attributes, links, trace_state)

        def get_description(self) -> str:
            return "NoOrphanQueries"

    return ParentBased(root=NoOrphanQueries())


def _instrument_libraries(provider) -> None:
    """Request spans (Django) and SQL spans (psycopg, PostgreSQL only)."""
    try:
        from opentelemetry.instrumentation.django import DjangoInstrumentor

        if not DjangoInstrumentor().is_instrumented_by_opentelemetry:
            DjangoInstrumentor().instrument(tracer_provider=provider)
    except Exception:  # tracing must never stop the app from starting
        log.warning("could not instrument Django for tracing", exc_info=True)
    try:
        from opentelemetry.instrumentation.psycopg import PsycopgInstrumentor

        if not PsycopgInstrumentor().is_instrumented_by_opentelemetry:
            PsycopgInstrumentor().instrument(tracer_provider=provider)
    except Exception:
        log.warning("could not instrument psycopg for tracing", exc_info=True)


def _set_tracer(provider):
    global _tracer
    previous = _tracer
    _tracer = None if provider is None else provider.get_tracer(TRACER_NAME)
    return previous


@contextmanager
def use_provider(provider):
    """Send this module's spans to `provider` inside the block (tests: an in-memory
    exporter) without touching the global provider; restores the previous state."""
    previous = _set_tracer(provider)
    try:
        yield provider
    finally:
        global _tracer
        _tracer = previous


@contextmanager
def quiet():
    """No library spans (SQL) inside the block: for polls inside a traced operation."""
    if _tracer is None:
        yield
        return
    from opentelemetry.instrumentation.utils import suppress_instrumentation

    with suppress_instrumentation():
        yield


def flush(timeout_millis: int = 5000) -> None:
    """Export what is queued (before os._exit, which skips the SDK's atexit hook)."""
    provider = _provider
    if provider is not None:
        try:
            provider.force_flush(timeout_millis)
        except Exception:
            log.debug("could not flush spans", exc_info=True)


# --- attributes ----------------------------------------------------------------------------
def _attribute(value):
    if isinstance(value, (bool, int, float)):
        return value
    return str(value)  # str subclasses too (TaskStatus choices): their plain value


def _attributes(fields: dict, names) -> dict:
    return {name: _attribute(fields[name]) for name in names if fields.get(name) is not None}


def _task_attributes(task_id: int) -> dict:
    """The checkpoint a run starts from and the recovery attempts so far (one query; only
    when tracing)."""
    from .models import Task

    row = Task.objects.filter(pk=task_id).values("checkpoint_version", "recovery_attempts").first()
    if row is None:
        return {}
    return {"checkpoint_version": row["checkpoint_version"], "recovery_attempt": row["recovery_attempts"]}


# --- spans -----------------------------------------------------------------------------------
def in_current_trace(fn):
    """`fn`, to run in another thread under the current span (subtasks' effects belong to
    their step); `fn` itself when tracing is off."""
    if _tracer is None:
        return fn
    parent = otel_context.get_current()

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        token = otel_context.attach(parent)
        try:
            return fn(*args, **kwargs)
        finally:
            otel_context.detach(token)

    return wrapper


def traced_drive(drive):
    """worker.drive_task(task_id): the worker's span of one delivery of a task."""

    @functools.wraps(drive)
    def wrapper(task_id, *args, **kwargs):
        if _tracer is None:
            return drive(task_id, *args, **kwargs)
        with _tracer.start_as_current_span("orchestrator.task.drive", attributes={"task_id": task_id}) as span:
            outcome = drive(task_id, *args, **kwargs)
            span.set_attribute("outcome", str(outcome))
            return outcome

    return wrapper


def traced_run(run):
    """Runner.run(): one run (slice) of a task; the parent of its step and checkpoint spans."""

    @functools.wraps(run)
    def wrapper(runner, *args, **kwargs):
        if _tracer is None:
            return run(runner, *args, **kwargs)
        lease = runner.lease
        attributes = {"task_id": lease.task_id, "lease_epoch": lease.epoch, "worker": lease.owner,
                      **_task_attributes(lease.task_id)}
        with _tracer.start_as_current_span("orchestrator.task.run", attributes=attributes) as span:
            # Steps run in pool threads, which do not inherit this thread's context.
            runner._trace_context = otel_context.get_current()
            outcome = run(runner, *args, **kwargs)
            span.set_attribute("outcome", str(outcome))
            return outcome

    return wrapper


def traced_step(execute):
    """Runner.execute(ctx): one execution of a step, in a pool thread."""

    @functools.wraps(execute)
    def wrapper(runner, ctx, *args, **kwargs):
        if _tracer is None:
            return execute(runner, ctx, *args, **kwargs)
        attributes = {"task_id": ctx.task_id, "step_id": ctx.step_id, "lease_epoch": ctx.lease.epoch,
                      "generation": ctx.generation}
        plan = getattr(runner, "plan", None)
        if plan is not None:
            attributes["attempt"] = plan.attempts.get(ctx.step_id, 0) + 1
        with _tracer.start_as_current_span("orchestrator.step", context=getattr(runner, "_trace_context", None),
                                           attributes=attributes):
            return execute(runner, ctx, *args, **kwargs)

    return wrapper


def traced_checkpoint(commit):
    """checkpoint.commit_step(...): the step's checkpoint commit; returns the new version."""

    @functools.wraps(commit)
    def wrapper(*args, **kwargs):
        if _tracer is None:
            return commit(*args, **kwargs)
        lease = kwargs.get("lease")
        attributes = {"step_id": str(kwargs.get("step_id"))}
        if lease is not None:
            attributes.update(task_id=lease.task_id, lease_epoch=lease.epoch)
        with _tracer.start_as_current_span("orchestrator.checkpoint", attributes=attributes) as span:
            version = commit(*args, **kwargs)
            if isinstance(version, int):
                span.set_attribute("checkpoint_version", version)
            return version

    return wrapper


def traced_effect(perform):
    """wal.perform(...): one side effect under the WAL protocol."""

    @functools.wraps(perform)
    def wrapper(*args, **kwargs):
        if _tracer is None:
            return perform(*args, **kwargs)
        lease = kwargs.get("lease")
        attributes = {"step_id": str(kwargs.get("step_id")), "tool": str(kwargs.get("tool_name")),
                      "call_index": int(kwargs.get("call_index") or 0)}
        if lease is not None:
            attributes.update(task_id=lease.task_id, lease_epoch=lease.epoch)
        completed = kwargs.get("completed")
        already = len(completed) if completed is not None else 0
        with _tracer.start_as_current_span("orchestrator.effect", attributes=attributes) as span:
            result = perform(*args, **kwargs)
            if completed is not None and len(completed) > already:
                effect = completed[-1]
                span.set_attributes({"wal_entry_id": effect.entry_id, "idempotency_key": effect.key})
            return result

    return wrapper


def traced_recovery(recover):
    """recovery.recover_task(task_id, ...): its decision arrives through ContextLogger."""

    @functools.wraps(recover)
    def wrapper(task_id, *args, **kwargs):
        if _tracer is None:
            return recover(task_id, *args, **kwargs)
        attributes = {"task_id": task_id, "count_attempt": bool(kwargs.get("count_attempt", True))}
        if kwargs.get("cause"):
            attributes["cause"] = str(kwargs["cause"])
        dead_lease = kwargs.get("dead_lease")
        if dead_lease is not None:
            attributes["dead_lease_epoch"] = dead_lease.epoch
        with _tracer.start_as_current_span("orchestrator.recovery", attributes=attributes) as span:
            recovered = recover(task_id, *args, **kwargs)
            span.set_attribute("recovered", bool(recovered))
            return recovered

    return wrapper


# --- logs that also feed spans and their callers ------------------------------------------
_capture: contextvars.ContextVar = contextvars.ContextVar("orchestrator_log_capture", default=None)


class ContextLogger(logging.LoggerAdapter):
    """A logger whose records' context fields (`extra=`) also reach, whatever the log level,
    the current span (attributes and an event per record) and an active capture_context().
    Used where the log line *is* the record of a decision (recovery)."""

    def __init__(self, logger: logging.Logger):
        super().__init__(logger, {})

    def process(self, msg, kwargs):
        return msg, kwargs  # keep the caller's extra (Python 3.11's adapter would replace it)

    def log(self, level, msg, *args, **kwargs):
        extra = kwargs.get("extra")
        if extra:
            observe(msg, args, extra)
        kwargs.setdefault("stacklevel", 2)  # the caller's file and line, not this one
        super().log(level, msg, *args, **kwargs)


def observe(msg, args, fields: dict) -> None:
    """Hand a record's context fields to the capture and the current span (if recording)."""
    captured = _capture.get()
    if captured is not None:
        captured.update({name: fields[name] for name in OUTCOME_FIELDS if fields.get(name) is not None})
    if _tracer is None:
        return
    span = trace.get_current_span()
    if not span.is_recording():
        return
    span.set_attributes(_attributes(fields, SPAN_FIELDS))
    try:
        name = str(msg) % args if args else str(msg)
    except (TypeError, ValueError):
        name = str(msg)
    span.add_event(name, attributes=_attributes(fields, CONTEXT_FIELDS))


@contextmanager
def capture_context(task_id: int | None = None):
    """Collect the context fields that ContextLogger records inside the block log (the last
    value of each): what recover_task decided, for the caller's own log line. With
    `task_id`, fields no record gave are read from the task row after the block
    (resume_strategy `none`: recovery had nothing to do)."""
    captured: dict = {}
    token = _capture.set(captured)
    try:
        yield captured
    finally:
        _capture.reset(token)
    if task_id is not None and any(name not in captured for name in OUTCOME_FIELDS):
        from .models import Task

        row = Task.objects.filter(pk=task_id).values("checkpoint_version", "event_seq", "recovery_attempts",
                                                     "lease_epoch").first() or {}
        for name, column in (("checkpoint_version", "checkpoint_version"), ("event_id", "event_seq"),
                             ("recovery_attempt", "recovery_attempts"), ("lease_epoch", "lease_epoch")):
            if name not in captured and column in row:
                captured[name] = row[column]
        captured.setdefault("task_id", task_id)
        captured.setdefault("resume_strategy", "none")
