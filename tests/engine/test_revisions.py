"""Edit parameters and resume (impact preview, invalidation, replan, stale preview) and
rollback to a snapshot version — on the real engine and database."""
from decimal import Decimal

import pytest

from orchestrator.engine import revisions, services
from orchestrator.engine.worker import drive_inline
from orchestrator.models import AuditEntry, Snapshot, Step, Task, WalEntry
from demo.models import DemoDestination, DemoSource

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.task_types("tests.support.testtypes")]


def run(task_id: int) -> Task:
    drive_inline(task_id)
    return Task.objects.get(pk=task_id)


def preview(task_id: int, **params):
    task = Task.objects.get(pk=task_id)
    return revisions.preview_edit(task, services.validate_params(task.type, {**task.params, **params}))[0]


def apply(task_id: int, **params):
    task = Task.objects.get(pk=task_id)
    return revisions.apply_edit(task_id=task_id, new_params=services.validate_params(task.type, {**task.params, **params}),
                                expected_version=task.event_seq, limits={"max_steps": 100_000})


def test_the_seed_story_rate_fixed_after_five_batches():
    task = services.task_create(type="demo.migrate_rows", params={"rows": 20000, "batch_size": 250, "rate": 1.0},
                                limits={"max_steps": 7, "max_subtasks": 1})
    task = run(task.pk)
    assert task.status == "paused" and task.steps_done == 7  # prepare + 6 batches
    done_batches = sorted(Step.objects.filter(task=task, status="done", step_id__startswith="batch")
                          .values_list("step_id", flat=True))
    dry = preview(task.pk, rate=2.0)
    assert dry.param_diff == {"rate": [1.0, 2.0]}
    assert sorted(dry.rerun) == done_batches and dry.kept == ["prepare-source"]
    assert {e["step"] for e in dry.repeated_effects} == set(done_batches) and dry.must_confirm == []
    assert Task.objects.get(pk=task.pk).params["rate"] == 1.0  # the dry run changed nothing

    apply(task.pk, rate=2.0)
    task = run(task.pk)
    assert task.status == "completed"
    assert DemoDestination.objects.count() == 20000
    source_total = sum(DemoSource.objects.filter(id__lte=20000).values_list("amount", flat=True))
    assert sum(DemoDestination.objects.values_list("amount", flat=True)) == 2 * source_total
    # Re-run batches got new idempotency keys (generation 1): the old ones recorded rate 1.0.
    assert WalEntry.objects.filter(task=task, idempotency_key=f"t{task.pk}:batch-0001@1:0", status="done").exists()
    assert Step.objects.get(task=task, step_id="prepare-source").generation == 0


def test_unaffected_invalidated_and_transitive_by_recorded_reads():
    task = run(services.task_create(type="test.diamond", params={"x": 1, "y": 2, "z": 3},
                                    limits={"max_steps": 4, "max_subtasks": 1}).pk)
    assert task.status == "completed"
    Task.objects.filter(pk=task.pk).update(status="paused")
    # z is not declared by `a`, but `a` read it at run time (x is odd): a, b, c are invalid.
    dry = preview(task.pk, z=4)
    assert sorted(dry.rerun) == ["a", "b", "c"] and dry.kept == ["d"]
    # y: only b and what depends on it.
    dry = preview(task.pk, y=5)
    assert sorted(dry.rerun) == ["b", "c"] and sorted(dry.kept) == ["a", "d"]
    apply(task.pk, y=5)
    task = run(task.pk)
    results = dict(Step.objects.filter(task=task).values_list("step_id", "result"))
    assert results == {"a": 4, "b": 20, "c": 21, "d": "d"}
    assert Step.objects.get(task=task, step_id="a").attempts == 1  # kept, not redone


def test_an_edit_that_re_runs_a_sent_email_is_refused_until_the_operator_confirms_the_repeat(smtp, operator):
    task = services.task_create(type="demo.notify", params={"recipients": ["a@example.org", "b@example.org"],
                                                            "subject": "Hi"}, limits={"max_steps": 1, "max_subtasks": 1})
    task = run(task.pk)
    assert task.status == "paused" and len(smtp.received) == 1
    sent_key = WalEntry.objects.get(task=task, step_id="send-001").idempotency_key
    dry = preview(task.pk, subject="Hello")
    assert dry.rerun == ["send-001"] and dry.must_confirm == [sent_key]
    [effect] = dry.repeated_effects
    assert effect["consequence"] == "will be sent again to a@example.org" and not effect["idempotent"]
    with pytest.raises(revisions.RepeatNotConfirmed, match="would perform 1 non-idempotent side effect"):
        apply(task.pk, subject="Hello")
    assert Task.objects.get(pk=task.pk).params["subject"] == "Hi"  # nothing applied
    with pytest.raises(services.InvalidInput, match="not an effect this operation repeats"):
        revisions.apply_edit(task_id=task.pk, new_params={**task.params, "subject": "Hello"},
                             expected_version=task.event_seq, repeat_effects=["t1:nope:0"])

    revisions.apply_edit(task_id=task.pk, new_params={**task.params, "subject": "Hello"},
                         expected_version=Task.objects.get(pk=task.pk).event_seq, limits={"max_steps": 100},
                         repeat_effects=[sent_key], actor=operator)
    audit = AuditEntry.objects.get(task=task, action="effect.repeat_confirmed")
    assert audit.actor == operator and audit.after["idempotency_key"] == sent_key
    assert "will be sent again to a@example.org" in audit.reason
    assert run(task.pk).status == "completed"
    # a@ got the confirmed repeat with the new subject, b@ one email: nothing else repeated
    assert sorted((m["To"], m["Subject"]) for m in smtp.received) == [
        ("a@example.org", "Hello"), ("a@example.org", "Hi"), ("b@example.org", "Hello")]


def test_a_rollback_over_sent_emails_needs_every_repeat_confirmed(smtp):
    task = run(services.task_create(type="demo.notify", params={"recipients": ["a@example.org", "b@example.org",
                                                                            "c@example.org"], "subject": "Hi"},
                                    limits={"max_steps": 2, "max_subtasks": 1}).pk)
    assert task.status == "paused" and len(smtp.received) == 2
    dry = revisions.preview_rollback(task, 1)  # before any email
    assert sorted(dry.rerun) == ["send-001", "send-002"] and len(dry.must_confirm) == 2
    assert {e["consequence"] for e in dry.repeated_effects} == {"will be sent again to a@example.org",
                                                                "will be sent again to b@example.org"}
    with pytest.raises(revisions.RepeatNotConfirmed, match="send-002"):
        revisions.apply_rollback(task_id=task.pk, version=1, expected_version=dry.version,
                                 repeat_effects=dry.must_confirm[:1])
    assert Task.objects.get(pk=task.pk).status == "paused"
    revisions.apply_rollback(task_id=task.pk, version=1, expected_version=dry.version, repeat_effects=dry.must_confirm)
    assert AuditEntry.objects.filter(task=task, action="effect.repeat_confirmed").count() == 2
    Task.objects.filter(pk=task.pk).update(limits={**task.limits, "max_steps": 100})
    assert run(task.pk).status == "completed"
    assert sorted(m["To"] for m in smtp.received) == ["a@example.org", "a@example.org", "b@example.org",
                                                      "b@example.org", "c@example.org"]


def test_a_new_batch_size_replans_the_remaining_batches():
    task = run(services.task_create(type="demo.migrate_rows", params={"rows": 1000, "batch_size": 100, "rate": 1.5},
                                    limits={"max_steps": 4, "max_subtasks": 1}).pk)
    assert task.status == "paused" and task.steps_total == 11
    dry = preview(task.pk, batch_size=250)
    assert dry.kept == ["prepare-source"]
    assert sorted(dry.rerun + dry.removed) == ["batch-0001", "batch-0002", "batch-0003"]
    assert dry.pending == ["batch-0001", "batch-0002", "batch-0003", "batch-0004"]
    apply(task.pk, batch_size=250)
    task = run(task.pk)
    assert task.status == "completed" and task.steps_total == 5
    assert list(Step.objects.filter(task=task).values_list("step_id", flat=True)) == [
        "prepare-source", "batch-0001", "batch-0002", "batch-0003", "batch-0004"]
    source = dict(DemoSource.objects.filter(id__lte=1000).values_list("id", "amount"))
    assert all(a == (source[i] * Decimal("1.5")).quantize(Decimal("0.0001"))
               for i, a in DemoDestination.objects.values_list("id", "amount"))


def test_applying_a_stale_preview_is_refused_with_409():
    task = run(services.task_create(type="test.diamond", params={}, limits={"max_steps": 2, "max_subtasks": 1}).pk)
    stale = preview(task.pk, y=7)
    services.task_resume(task_id=task.pk, limits={"max_steps": 3})  # another operator acts
    services.task_pause(task_id=task.pk)
    task = Task.objects.get(pk=task.pk)
    assert task.status == "paused"
    with pytest.raises(revisions.StalePreview, match="changed since this preview"):
        revisions.apply_edit(task_id=task.pk, new_params={**task.params, "y": 7}, expected_version=stale.version)
    assert Task.objects.get(pk=task.pk).params["y"] == 1


def test_editing_a_running_task_is_refused():
    task = services.task_create(type="test.diamond", params={})
    with pytest.raises(revisions.states.InvalidTransition, match="pause it"):
        preview(task.pk, y=3)


def test_rollback_lists_later_effects_and_resumes_from_the_version():
    task = run(services.task_create(type="demo.migrate_rows", params={"rows": 500, "batch_size": 100, "rate": 1.0},
                                    limits={"max_steps": 4, "max_subtasks": 1}).pk)
    assert task.status == "paused" and task.checkpoint_version == 5  # plan + 4 steps
    target = Snapshot.objects.get(task=task, version=3)  # prepare-source + batch-0001 done
    dry = revisions.preview_rollback(task, 3)
    assert dry.kept == ["prepare-source", "batch-0001"]
    assert sorted(dry.rerun) == ["batch-0002", "batch-0003"]
    assert sorted(e["step"] for e in dry.effects_after) == ["batch-0002", "batch-0003"]
    assert target.state["steps"]["batch-0002"] == "pending"
    revisions.apply_rollback(task_id=task.pk, version=3, expected_version=dry.version)
    task = Task.objects.get(pk=task.pk)
    assert task.status == "queued" and task.steps_done == 2
    Task.objects.filter(pk=task.pk).update(limits={**task.limits, "max_steps": 100})
    task = run(task.pk)
    assert task.status == "completed" and DemoDestination.objects.count() == 500
    assert Step.objects.get(task=task, step_id="batch-0002").generation == 1
    assert Step.objects.get(task=task, step_id="batch-0001").generation == 0


def test_rollback_to_a_pruned_version_is_refused(settings):
    settings.ORCH_SNAPSHOT_KEEP = 3
    task = run(services.task_create(type="demo.migrate_rows", params={"rows": 600, "batch_size": 100},
                                    limits={"max_steps": 6, "max_subtasks": 1}).pk)
    assert Snapshot.objects.filter(task=task).count() == 3
    with pytest.raises(revisions.states.InvalidTransition, match="no snapshot v2"):
        revisions.preview_rollback(task, 2)
