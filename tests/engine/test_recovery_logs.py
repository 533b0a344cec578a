"""Every recovery action is logged with task_id, checkpoint_version, event_id (the progress
event it wrote), resume_strategy and recovery_attempt — as JSON lines. Real recoveries:
a worker takes a task, writes WAL intents through the real protocol and goes quiet; the
sweeper finds its stale heartbeat."""
import json
import logging
import os
import signal
from datetime import timedelta

import pytest
from django.db.models import F

from orchestrator.engine import checkpoint, recovery, services, wal
from orchestrator.engine.lease import claim
from orchestrator.logging import JsonFormatter
from orchestrator.models import IdempotencyRecord, Task, TaskEvent
from orchestrator.tasktypes import get_type
from tests.conftest import wait_for
from tests.support.helpers import write_intent

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.task_types("tests.support.testtypes")]

REQUIRED = ("task_id", "checkpoint_version", "event_id", "resume_strategy", "recovery_attempt")


@pytest.fixture(autouse=True)
def setup(settings, caplog):
    settings.ORCH_STALE_AFTER_SECONDS = 0.1
    caplog.set_level(logging.DEBUG, logger="orchestrator")


def worker_took(task: Task, intents=(), **task_fields):
    """A worker claimed `task`, planned it, wrote these WAL intents (tool, args, idempotent),
    and died: its heartbeat is stale."""
    lease = claim(task.pk)
    assert lease is not None
    task_type = get_type(task.type)
    checkpoint.ensure_plan(lease=lease, task_type=task_type, params=task_type.Params.model_validate(task.params))
    entries = [write_intent(lease=lease, step_id="effect", call_index=i, tool_name=tool, args=args,
                            key=wal.idempotency_key(task.pk, "effect", i), idempotent=idempotent)
               for i, (tool, args, idempotent) in enumerate(intents)]
    Task.objects.filter(pk=task.pk).update(heartbeat_at=F("heartbeat_at") - timedelta(seconds=5), **task_fields)
    return lease, entries


def recovery_records(caplog):
    return [r for r in caplog.records if r.name == "orchestrator.engine.recovery"]


def the_record(caplog, message: str) -> logging.LogRecord:
    found = [r for r in recovery_records(caplog) if r.getMessage() == message]
    assert len(found) == 1, [r.getMessage() for r in recovery_records(caplog)]
    return found[0]


def assert_fields(record: logging.LogRecord, **expected):
    missing = [name for name in REQUIRED if getattr(record, name, None) is None]
    assert not missing, f"{record.getMessage()!r} lacks {missing}"
    for name, value in expected.items():
        assert getattr(record, name) == value, (name, getattr(record, name), value)


def last_event(task_id: int, kind: str) -> TaskEvent:
    return TaskEvent.objects.filter(task_id=task_id, kind=kind).order_by("-seq").first()


def test_a_requeue_logs_the_checkpoint_the_recovery_event_and_the_attempt(caplog):
    task = services.task_create(type="test.effects", params={"kind": "idempotent"})
    worker_took(task)
    assert recovery.sweep() == [task.pk]
    task = Task.objects.get(pk=task.pk)
    record = the_record(caplog, "recovery: re-queued from checkpoint")
    assert_fields(record, task_id=task.pk, checkpoint_version=task.checkpoint_version, recovery_attempt=1,
                  resume_strategy="requeue_from_checkpoint", event_id=last_event(task.pk, "recovery").seq,
                  lease_epoch=task.lease_epoch - 1)
    assert task.checkpoint_version >= 1  # the plan's checkpoint


def test_each_pending_effect_is_logged_with_its_wal_entry_id_and_what_recovery_does(caplog):
    task = services.task_create(type="test.effects", params={"kind": "nonidempotent"})
    _, (email, upsert, recorded) = worker_took(task, [
        ("email.send", {"to": "ann@example.org", "subject": "s", "body": "b"}, False),
        ("db.upsert", {"table": "demo_destination", "columns": ["id", "amount"], "rows": [[1, "1"]]}, True),
        ("db.upsert", {"table": "demo_destination", "columns": ["id", "amount"], "rows": [[2, "2"]]}, True),
    ])
    IdempotencyRecord.objects.create(key=recorded.idempotency_key, tool="db.upsert", result={"rows": 1})  # it happened
    assert recovery.sweep() == [task.pk]
    task = Task.objects.get(pk=task.pk)
    assert task.status == "awaiting_review"
    recovery_seq = last_event(task.pk, "recovery").seq
    by_entry = {r.wal_entry_id: r for r in recovery_records(caplog) if getattr(r, "wal_entry_id", None)}
    assert set(by_entry) == {email.pk, upsert.pk, recorded.pk}
    for entry, strategy in ((email, "open_review"), (upsert, "replay_idempotent"),
                            (recorded, "reuse_recorded_result")):
        assert_fields(by_entry[entry.pk], task_id=task.pk, resume_strategy=strategy, recovery_attempt=1,
                      event_id=recovery_seq, checkpoint_version=task.checkpoint_version)
    final = the_record(caplog, "recovery: awaiting review")
    assert_fields(final, task_id=task.pk, resume_strategy="awaiting_review", recovery_attempt=1,
                  event_id=last_event(task.pk, "status").seq, checkpoint_version=task.checkpoint_version)
    assert not hasattr(final, "wal_entry_id")
    # The review queue's own line names the WAL entry, not a progress event.
    opened = next(r for r in caplog.records if r.name == "review.services" and r.getMessage() == "review opened")
    assert opened.wal_entry_id == email.pk and not hasattr(opened, "event_id")


def test_exhausted_attempts_log_needs_human(caplog, settings):
    settings.ORCH_MAX_RECOVERY_ATTEMPTS = 2
    task = services.task_create(type="test.effects", params={"kind": "idempotent"})
    worker_took(task, recovery_attempts=2)
    assert recovery.sweep() == [task.pk]
    task = Task.objects.get(pk=task.pk)
    assert task.status == "needs_human"
    assert_fields(the_record(caplog, "recovery: needs a human"), task_id=task.pk, resume_strategy="needs_human",
                  recovery_attempt=3, checkpoint_version=task.checkpoint_version,
                  event_id=last_event(task.pk, "status").seq)


def test_invalid_resources_log_needs_human(caplog, tmp_path):
    task = services.task_create(type="test.flaky", params={"mode": "transient", "marker": str(tmp_path / "m"),
                                                           "resource": str(tmp_path / "gone.csv")})
    worker_took(task)
    assert recovery.sweep() == [task.pk]
    task = Task.objects.get(pk=task.pk)
    assert task.status == "needs_human"
    assert_fields(the_record(caplog, "recovery: resources invalid"), task_id=task.pk, resume_strategy="needs_human",
                  recovery_attempt=1, checkpoint_version=task.checkpoint_version,
                  event_id=last_event(task.pk, "status").seq)


@pytest.mark.parametrize("status, control, outcome", [("pausing", "pause", "paused"), ("stopping", "stop", "stopped"),
                                                      ("running", "terminate", "terminated")])
def test_an_operator_request_completed_by_recovery_is_logged(caplog, status, control, outcome):
    task = services.task_create(type="test.effects", params={"kind": "idempotent"})
    worker_took(task, status=status, control=control)
    assert recovery.sweep() == [task.pk]
    task = Task.objects.get(pk=task.pk)
    assert task.status == outcome
    assert_fields(the_record(caplog, "recovery: settled operator request"), task_id=task.pk,
                  resume_strategy=outcome, recovery_attempt=1, checkpoint_version=task.checkpoint_version,
                  event_id=last_event(task.pk, "status").seq)


def test_recovery_that_finds_nothing_to_do_says_so(caplog):
    task = services.task_create(type="test.effects", params={"kind": "idempotent"})
    lease, _ = worker_took(task)
    assert recovery.recover_task(task.pk) is True
    assert recovery.recover_task(task.pk, dead_lease=lease) is False  # a second report of the same death
    record = the_record(caplog, "recovery: nothing to do")
    assert record.task_id == task.pk and record.resume_strategy == "none"


def test_recovery_records_are_json_lines_with_the_context_fields(caplog):
    task = services.task_create(type="test.effects", params={"kind": "idempotent"})
    worker_took(task)
    recovery.sweep()
    line = JsonFormatter().format(the_record(caplog, "recovery: re-queued from checkpoint"))
    assert "\n" not in line
    data = json.loads(line)
    assert list(data)[:4] == ["timestamp", "level", "logger", "message"]
    assert data["level"] == "INFO" and data["logger"] == "orchestrator.engine.recovery"
    assert data["message"] == "recovery: re-queued from checkpoint"
    assert data["task_id"] == task.pk and data["resume_strategy"] == "requeue_from_checkpoint"
    assert {"checkpoint_version", "event_id", "recovery_attempt", "lease_epoch"} <= set(data)
    assert data["timestamp"].endswith("+00:00")


def test_the_configured_handler_writes_json_and_text_is_an_option():
    import subprocess
    import sys

    from tests.conftest import ROOT

    code = ("import django, logging; django.setup(); logging.getLogger('orchestrator.x')"
            ".warning('hello %s', 'there', extra={'task_id': 7, 'wal_entry_id': 3})")
    env = {**{k: v for k, v in os.environ.items() if k != "ORCH_LOG_FORMAT"},
           "DJANGO_SETTINGS_MODULE": "orchestrator.settings"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=60).stderr.strip().splitlines()[-1]
    data = json.loads(out)
    assert (data["level"], data["logger"], data["message"]) == ("WARNING", "orchestrator.x", "hello there")
    assert data["task_id"] == 7 and data["wal_entry_id"] == 3
    text = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**env, "ORCH_LOG_FORMAT": "text"},
                          capture_output=True, text=True, timeout=60).stderr.strip().splitlines()[-1]
    assert text.endswith("WARNING orchestrator.x hello there task_id=7 wal_entry_id=3")


# --- the worker's own lines, from real worker processes -------------------------------------
def json_lines(output: str) -> list[dict]:
    records = []
    for line in output.splitlines():
        if line.startswith("{"):
            try:
                records.append(json.loads(line))
            except ValueError:
                pass
    return records


def logged(cluster, message: str, task_id: int) -> list[dict]:
    return [r for r in json_lines(cluster.output()) if r.get("message") == message and r.get("task_id") == task_id]


@pytest.mark.workers
def test_executor_death_and_worker_shutdown_log_what_recovery_decided(start_workers):
    from tests.engine.test_recovery import stage_processes

    cluster = start_workers(1)
    task = services.task_create(type="demo.pipeline", params={"stages": 2, "seconds_per_stage": 30})
    wait_for(lambda: stage_processes(task.pk), timeout=60, message="a stage subprocess")
    executor = Task.objects.get(pk=task.pk).worker_pid
    os.kill(executor, signal.SIGKILL)  # the executor dies: its worker hands the task to recovery at once
    died = wait_for(lambda: logged(cluster, "executor died: task handed to recovery", task.pk), timeout=30,
                    message="the executor's death to be logged")[0]
    recovered = Task.objects.get(pk=task.pk)
    first_recovery = TaskEvent.objects.filter(task=task, kind="recovery").order_by("seq").first()
    assert died["task_id"] == task.pk and died["resume_strategy"] == "requeue_from_checkpoint"
    assert died["recovery_attempt"] == 1 and died["event_id"] == first_recovery.seq
    assert died["checkpoint_version"] == first_recovery.payload["checkpoint_version"]
    assert died["worker"].endswith(f":{executor}") and died["level"] == "INFO"
    # The worker's recovery line carries the same fields.
    requeued = logged(cluster, "recovery: re-queued from checkpoint", task.pk)[0]
    assert {k: requeued[k] for k in ("task_id", "event_id", "recovery_attempt")} == \
           {k: died[k] for k in ("task_id", "event_id", "recovery_attempt")}

    # The same worker runs it again; then the worker host is shut down: it hands the task back.
    wait_for(lambda: Task.objects.get(pk=task.pk).worker_pid not in (None, executor) and stage_processes(task.pk),
             timeout=60, message="the task to run again")
    os.killpg(cluster.proc.pid, signal.SIGTERM)
    back = wait_for(lambda: logged(cluster, "worker shutting down: task handed back", task.pk), timeout=30,
                    message="the hand-back to be logged")[0]
    handed = TaskEvent.objects.filter(task=task, kind="recovery").order_by("seq").last()
    assert back["task_id"] == task.pk and back["resume_strategy"] == "requeue_from_checkpoint"
    assert back["recovery_attempt"] == 1  # an orderly shutdown is not counted
    assert back["event_id"] == handed.seq and handed.seq > first_recovery.seq
    assert back["checkpoint_version"] == handed.payload["checkpoint_version"]
    assert recovered.recovery_attempts == 1


# --- every line the recovery module writes, not only the sweeper's main path (issue 20, item 11) --
def test_a_wait_whose_deadline_passed_is_logged_with_every_field(caplog):
    task = services.task_create(type="test.effects", params={"kind": "idempotent"})
    Task.objects.filter(pk=task.pk).update(status="waiting", waiting_until=F("created_at") - timedelta(seconds=1),
                                           checkpoint_version=2, recovery_attempts=1)
    assert recovery.wake_expired_waits() == [task.pk]
    task = Task.objects.get(pk=task.pk)
    assert_fields(the_record(caplog, "wait timed out: re-queued"), task_id=task.pk, resume_strategy="wait_timed_out",
                  checkpoint_version=2, recovery_attempt=1, event_id=last_event(task.pk, "status").seq,
                  lease_epoch=task.lease_epoch)


def test_an_unclaimed_task_resent_is_logged_with_every_field(caplog, settings, monkeypatch):
    settings.ORCH_REQUEUE_AFTER_SECONDS = 0
    # The ordinary re-send: the task's hand-over is backdated below while its message is still in
    # the broker, which a look at a Redis list would read as a message taken and never run
    # (requeue_stranded, tests/engine/test_lost_prefetch.py). Without that look here.
    monkeypatch.setattr(recovery.stranded, "look", lambda: None)
    task = services.task_create(type="test.effects", params={"kind": "idempotent"})
    Task.objects.filter(pk=task.pk).update(enqueued_at=F("created_at") - timedelta(seconds=5))
    assert task.pk in recovery.requeue_unclaimed()
    task = Task.objects.get(pk=task.pk)
    record = the_record(caplog, "queued task not claimed: re-sent to the broker")
    # It writes no progress event: event_id is the task's last one, as the task page shows it.
    assert_fields(record, task_id=task.pk, resume_strategy="requeue_unclaimed", recovery_attempt=0,
                  checkpoint_version=task.checkpoint_version, event_id=task.event_seq)
    assert record.waited_seconds >= 5


def test_nothing_to_do_still_names_the_task_state_it_saw(caplog):
    task = services.task_create(type="test.effects", params={"kind": "idempotent"})
    lease, _ = worker_took(task)
    assert recovery.recover_task(task.pk) is True
    assert recovery.recover_task(task.pk, dead_lease=lease) is False
    task = Task.objects.get(pk=task.pk)
    assert_fields(the_record(caplog, "recovery: nothing to do"), task_id=task.pk, resume_strategy="none",
                  recovery_attempt=1, checkpoint_version=task.checkpoint_version, event_id=task.event_seq)


def test_effects_settled_for_an_ended_task_are_logged_with_every_field(caplog):
    """Runner.decide (Stop, Force-terminate) and the watchdog settle the WAL with only the
    task and its lease epoch to hand: the lines still carry every field."""
    task = services.task_create(type="test.effects", params={"kind": "nonidempotent"})
    lease, (email,) = worker_took(task, [("email.send", {"to": "ann@example.org", "subject": "s", "body": "b"}, False)])
    from django.db import transaction

    with transaction.atomic():
        locked = Task.objects.select_for_update().get(pk=task.pk)
        opened = recovery.settle_pending_wal(locked, dead_worker=lease.owner, cause="stopped by an operator",
                                             extra={"task_id": task.pk, "lease_epoch": lease.epoch}, ended=True)
    assert [entry.pk for entry in opened] == [email.pk]
    record = the_record(caplog, "recovery: effect in doubt; opening a review item")
    assert_fields(record, task_id=task.pk, resume_strategy="open_review", wal_entry_id=email.pk,
                  recovery_attempt=0, checkpoint_version=locked.checkpoint_version, event_id=locked.event_seq,
                  lease_epoch=lease.epoch)


def test_every_line_of_the_recovery_module_carries_the_promised_fields(caplog, settings, monkeypatch):
    """Whatever path ran, no line of orchestrator.engine.recovery with a resume_strategy lacks
    one of the fields docs/recovery.md promises."""
    settings.ORCH_REQUEUE_AFTER_SECONDS = 0
    # The unclaimed task's message is lost (a look at the broker would find it waiting there,
    # and a task whose message waits is not re-sent).
    monkeypatch.setattr(recovery.stranded, "look", lambda: None)
    stale = services.task_create(type="test.effects", params={"kind": "nonidempotent"})
    worker_took(stale, [("email.send", {"to": "a@example.org", "subject": "s", "body": "b"}, False),
                        ("db.upsert", {"table": "demo_destination", "columns": ["id"], "rows": [[1]]}, True)])
    waiting = services.task_create(type="test.effects", params={"kind": "idempotent"})
    Task.objects.filter(pk=waiting.pk).update(status="waiting", waiting_until=F("created_at"))
    unclaimed = services.task_create(type="test.effects", params={"kind": "idempotent"})
    Task.objects.filter(pk=unclaimed.pk).update(enqueued_at=F("created_at") - timedelta(seconds=5))
    recovery.sweep()
    recovery.recover_task(stale.pk)  # nothing to do: recovered already
    lines = [r for r in recovery_records(caplog) if getattr(r, "resume_strategy", None)]
    assert {r.resume_strategy for r in lines} >= {"open_review", "replay_idempotent", "awaiting_review",
                                                  "wait_timed_out", "requeue_unclaimed", "none"}
    for record in lines:
        assert_fields(record)
