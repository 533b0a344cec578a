"""Plans that grow at run time: a step adds steps (a fan-out, a chain that grows itself),
committed with its checkpoint — on the real engine and database. The crash tests (real
kill -9 between a step's effects and its checkpoint) are in test_dynamic_plans_crash.py."""
import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from orchestrator.engine import revisions, services, snapshots
from orchestrator.engine.worker import drive_inline
from orchestrator.models import Snapshot, Step, StepResult, Task, TaskEvent, WalEntry
from demo.models import DemoDestination
from tests.support.helpers import bearer

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.task_types("tests.support.testtypes")]


def run(task_id: int) -> Task:
    drive_inline(task_id)
    return Task.objects.get(pk=task_id)


def resume(task_id: int, **limits) -> Task:
    services.task_resume(task_id=task_id, limits=limits or {"max_steps": 100_000})
    return run(task_id)


def steps_of(task) -> dict[str, Step]:
    return {s.step_id: s for s in Step.objects.filter(task=task).order_by("position")}


def edit(task_id: int, **params) -> revisions.Preview:
    task = Task.objects.get(pk=task_id)
    new = services.validate_params(task.type, {**task.params, **params})
    preview = revisions.preview_edit(task, new)[0]
    applied = revisions.apply_edit(task_id=task_id, new_params=new, expected_version=task.event_seq,
                                   limits={"max_steps": 100_000})
    assert applied.as_dict() == preview.as_dict()
    return preview


def test_a_step_fans_out_and_a_collector_gathers_what_it_added():
    task = run(services.task_create(type="test.growing", params={"items": 4}, limits={"max_subtasks": 2}).pk)
    assert task.status == "completed", task.status_reason
    steps = steps_of(task)
    assert list(steps) == ["discover", "item-0", "item-1", "item-2", "item-3", "collect"]
    assert {sid: s.added_by for sid, s in steps.items()} == {"discover": "", **{f"item-{i}": "discover" for i in range(4)},
                                                           "collect": "discover"}
    assert steps["collect"].depends_on == [f"item-{i}" for i in range(4)]
    assert steps["collect"].result == 0 + 1 + 2 + 3
    assert (task.steps_done, task.steps_total) == (6, 6)
    assert DemoDestination.objects.filter(id__gte=700_000).count() == 5
    # The version that committed `discover` records what it added, and by whom.
    discover_version = TaskEvent.objects.get(task=task, kind="step_done", payload__step="discover").payload["version"]
    state = snapshots.materialize(task.pk, discover_version)
    assert state["steps"] == {"discover": "done", **{f"item-{i}": "pending" for i in range(4)}, "collect": "pending"}
    assert state["added_by"]["collect"] == "discover"


def test_a_chain_grows_itself_one_link_at_a_time():
    task = run(services.task_create(type="test.growing", params={"mode": "chain", "items": 30}).pk)
    assert task.status == "completed", task.status_reason
    steps = steps_of(task)
    assert list(steps) == [f"link-{i}" for i in range(30)]
    assert [s.added_by for s in steps.values()] == [""] + [f"link-{i}" for i in range(29)]
    assert steps["link-29"].result == sum(range(30))
    assert task.steps_total == 30


@pytest.mark.parametrize("mode, message", [
    ("duplicate", "the plan already has a step with that id"),
    ("unknown_dependency", "neither in the plan nor added before it"),
])
def test_a_plan_that_cannot_grow_as_asked_needs_a_human(mode, message):
    task = run(services.task_create(type="test.growing", params={"mode": mode}).pk)
    assert task.status == "needs_human"
    assert message in task.error
    assert list(steps_of(task)) == ["discover"] and task.steps_total == 1
    assert steps_of(task)["discover"].status == "failed"


def test_max_steps_applies_to_added_steps():
    task = run(services.task_create(type="test.growing", params={"mode": "chain", "items": 10},
                                    limits={"max_steps": 4}).pk)
    assert task.status == "paused" and task.paused_by_limit == "max_steps" and task.steps_done == 4
    task = resume(task.pk)
    assert task.status == "completed" and steps_of(task)["link-9"].result == sum(range(10))


def test_an_edit_the_adder_did_not_read_keeps_it_and_what_it_added():
    task = run(services.task_create(type="test.growing", params={"items": 4},
                                    limits={"max_steps": 3, "max_subtasks": 1}).pk)
    assert task.status == "paused" and task.steps_done == 3  # discover, item-0, item-1
    preview = edit(task.pk, factor=2)  # read by the items only
    assert preview.kept == ["discover"] and preview.rerun == ["item-0", "item-1"] and not preview.removed
    task = run(task.pk)
    assert task.status == "completed", task.status_reason
    steps = steps_of(task)
    assert steps["collect"].result == (0 + 1 + 2 + 3) * 2
    assert steps["discover"].generation == 0 and steps["item-0"].generation == 1
    assert WalEntry.objects.filter(task=task, step_id="discover").count() == 1  # not performed again


def test_an_edit_that_invalidates_the_adder_drops_what_it_added_and_it_adds_anew():
    task = run(services.task_create(type="test.growing", params={"items": 3},
                                    limits={"max_steps": 2, "max_subtasks": 1}).pk)
    assert task.status == "paused" and task.steps_done == 2  # discover, item-0
    preview = edit(task.pk, prefix="part")  # read by discover only: its additions change
    assert preview.rerun == ["discover"] and preview.removed == ["item-0"] and preview.kept == []
    # item-0's upsert may be performed again by whatever discover adds now: it is listed.
    assert [e["step"] for e in preview.repeated_effects] == ["discover", "item-0"]
    assert list(steps_of(Task.objects.get(pk=task.pk))) == ["discover"]
    task = run(task.pk)
    assert task.status == "completed", task.status_reason
    steps = steps_of(task)
    assert list(steps) == ["discover", "part-0", "part-1", "part-2", "collect"]
    # What the re-run adder added inherits its generation: new idempotency keys.
    assert steps["part-0"].generation == steps["discover"].generation == 1
    assert WalEntry.objects.get(task=task, step_id="part-0").idempotency_key == f"t{task.pk}:part-0@1:0"


def test_a_type_hook_can_regenerate_what_was_added_on_any_edit(monkeypatch):
    from tests.support.testtypes import Growing

    monkeypatch.setattr(Growing, "regenerate_added_steps", lambda self, old, new: True)
    task = run(services.task_create(type="test.growing", params={"items": 2},
                                    limits={"max_steps": 3, "max_subtasks": 1}).pk)
    preview = edit(task.pk, factor=3)
    assert preview.rerun == ["discover"] and preview.removed == ["item-0", "item-1"]
    task = run(task.pk)
    assert task.status == "completed" and steps_of(task)["collect"].result == (0 + 1) * 3


def raise_max_steps(task_id: int) -> None:
    task = Task.objects.get(pk=task_id)
    Task.objects.filter(pk=task_id).update(limits={**task.limits, "max_steps": 100_000})


def test_rollback_to_before_the_fan_out_drops_what_it_added():
    task = run(services.task_create(type="test.growing", params={"items": 2},
                                    limits={"max_steps": 3, "max_subtasks": 1}).pk)
    assert task.status == "paused"
    preview = revisions.preview_rollback(task, 1)  # v1: the plan, before anything ran
    assert preview.kept == [] and preview.rerun == ["discover", "item-0", "item-1"]
    revisions.apply_rollback(task_id=task.pk, version=1, expected_version=task.event_seq)
    assert list(steps_of(Task.objects.get(pk=task.pk))) == ["discover"]
    raise_max_steps(task.pk)
    task = run(task.pk)
    assert task.status == "completed" and steps_of(task)["collect"].result == 1
    assert steps_of(task)["item-0"].generation == 1  # added anew by the re-run discover


def test_rollback_to_a_version_after_the_fan_out_keeps_the_adder_and_its_steps():
    task = run(services.task_create(type="test.growing", params={"items": 2},
                                    limits={"max_steps": 3, "max_subtasks": 1}).pk)
    discover_version = TaskEvent.objects.get(task=task, kind="step_done", payload__step="discover").payload["version"]
    preview = revisions.preview_rollback(task, discover_version)
    assert preview.kept == ["discover"] and preview.rerun == ["item-0", "item-1"]
    revisions.apply_rollback(task_id=task.pk, version=discover_version, expected_version=task.event_seq)
    assert list(steps_of(Task.objects.get(pk=task.pk))) == ["discover", "item-0", "item-1", "collect"]
    raise_max_steps(task.pk)
    task = run(task.pk)
    assert task.status == "completed" and steps_of(task)["collect"].result == 1


def test_snapshots_are_deltas_between_full_rows_and_every_version_reads_whole(settings, monkeypatch):
    settings.ORCH_SNAPSHOT_FULL_EVERY = 4
    settings.ORCH_SNAPSHOT_KEEP = 100
    # Look at the rows as a run leaves them before it ends (the end of a run compacts them).
    monkeypatch.setattr(snapshots, "compact", lambda task, state: None)
    task = run(services.task_create(type="test.long", params={"steps": 10}, limits={"max_subtasks": 1}).pk)
    rows = dict(Snapshot.objects.filter(task=task).values_list("version", "full"))
    assert rows == {v: (v == 1 or v % 4 == 0) for v in range(1, 12)}
    for version in range(1, 12):
        state = snapshots.materialize(task.pk, version)
        done = version - 1  # v1 is the plan; each later version finished one more step
        assert state["steps"] == {f"s{i:05d}": "done" if i < done else "pending" for i in range(10)}, version
        assert state["counters"]["steps_done"] == done and state["params"] == {"steps": 10, "factor": 1}
    assert Snapshot.objects.get(task=task, version=6).state == {
        "steps": {"s00004": "done"}, "status": "running",
        "counters": {"steps_done": 5, "tokens_used": 0, "active_seconds": pytest.approx(
            Snapshot.objects.get(task=task, version=6).state["counters"]["active_seconds"])}}


def test_a_task_at_rest_keeps_exactly_the_last_versions_as_full_rows(settings):
    settings.ORCH_SNAPSHOT_FULL_EVERY = 4
    settings.ORCH_SNAPSHOT_KEEP = 3
    task = run(services.task_create(type="test.long", params={"steps": 20},
                                    limits={"max_steps": 13, "max_subtasks": 1}).pk)
    assert task.status == "paused"
    assert list(Snapshot.objects.filter(task=task).order_by("version").values_list("version", "full")) == [
        (12, True), (13, True), (14, True)]
    assert snapshots.kept_versions(task.pk) == [12, 13, 14]
    preview = revisions.preview_rollback(task, 12)
    assert preview.rerun == ["s00011", "s00012"]


def test_a_large_result_is_stored_apart_and_loaded_only_by_a_run_that_needs_it(settings, make_user, client):
    settings.ORCH_RESULT_INLINE_BYTES = 1000
    task = run(services.task_create(type="test.growing", params={"items": 2, "big_result_bytes": 5000},
                                    limits={"max_steps": 1, "max_subtasks": 1}).pk)
    discover = steps_of(task)["discover"]
    assert discover.result is None and discover.result_stored_apart and discover.result_bytes > 5000
    assert len(StepResult.objects.get(task=task, step_id="discover").data["padding"]) == 5000

    def run_and_capture(max_steps):
        services.task_resume(task_id=task.pk, limits={"max_steps": max_steps})
        with CaptureQueriesContext(connection) as queries:
            drive_inline(task.pk)
        return [q["sql"] for q in queries.captured_queries if StepResult._meta.db_table in q["sql"]]

    # The items depend on discover: their run loads its result...
    assert run_and_capture(3)
    assert steps_of(task)["item-1"].status == "done"
    # ...collect does not: the run that only has collect left never reads it.
    assert run_and_capture(100) == []
    task = Task.objects.get(pk=task.pk)
    assert task.status == "completed" and steps_of(task)["collect"].result == 1

    headers = bearer(make_user("vera", "viewer"))
    detail = client.get(f"/api/tasks/{task.pk}", **headers).json()
    step = next(s for s in detail["steps"] if s["id"] == "discover")
    assert step["result"] is None and step["result_stored_apart"] is True and step["added_by"] == ""
    loaded = client.get(f"/api/tasks/{task.pk}/steps/discover/result", **headers)
    assert loaded.status_code == 200 and len(loaded.json()["result"]["padding"]) == 5000
    assert client.get(f"/api/tasks/{task.pk}/steps/nope/result", **headers).status_code == 404


def test_an_edit_on_a_10000_step_task_keeps_the_first_half(settings):
    settings.ORCH_SLICE_SECONDS = 3600  # one run to the limit, without handing over between slices

    def run(task_id):  # as an isolated executor runs it
        drive_inline(task_id, watched=True)
        return Task.objects.get(pk=task_id)

    task = run(services.task_create(type="test.long", params={"steps": 10_000},
                                    limits={"max_steps": 5_005, "max_subtasks": 1}).pk)
    assert task.status == "paused" and task.steps_done == 5_005
    task = Task.objects.get(pk=task.pk)
    new = services.validate_params(task.type, {**task.params, "factor": 3})
    preview = revisions.preview_edit(task, new)[0]
    assert len(preview.kept) == 5_000 and preview.rerun == [f"s{i:05d}" for i in range(5_000, 5_005)]
    assert len(preview.pending) == 5_000
    revisions.apply_edit(task_id=task.pk, new_params=new, expected_version=task.event_seq,
                         limits={"max_steps": 5_010})
    task = run(task.pk)  # continues from the kept half: ten more steps, then the limit pauses it again
    assert task.status == "paused" and task.steps_done == 5_010
    assert Step.objects.get(task=task, step_id="s05009").result == 5_009 * 3
    assert Step.objects.get(task=task, step_id="s05004").generation == 1  # re-run: new keys
    assert Step.objects.get(task=task, step_id="s05009").generation == 0  # never ran before
    assert Step.objects.get(task=task, step_id="s04999").result == 4_999
    assert Step.objects.filter(task=task, status="done").count() == 5_010
    assert Snapshot.objects.filter(task=task).count() == settings.ORCH_SNAPSHOT_KEEP


def test_an_edit_writes_only_the_step_rows_it_changes():
    # 1,000 steps, 505 done; the edit of `factor` resets the five done steps of the second half.
    # Before, every row was saved by its own UPDATE (1,000 statements).
    task = run(services.task_create(type="test.long", params={"steps": 1_000},
                                    limits={"max_steps": 505, "max_subtasks": 1}).pk)
    assert task.status == "paused" and task.steps_done == 505
    before = {s.step_id: (s.result, s.generation) for s in Step.objects.filter(task=task)}
    new = services.validate_params(task.type, {**task.params, "factor": 3})
    with CaptureQueriesContext(connection) as queries:
        revisions.apply_edit(task_id=task.pk, new_params=new, expected_version=task.event_seq)
    step_writes = [q["sql"] for q in queries if q["sql"].lstrip().upper().startswith(("UPDATE", "INSERT"))
                   and "orchestrator_step\"" in q["sql"].split("SET")[0].split("VALUES")[0]]
    assert len(step_writes) == 1, step_writes  # one batch: the five reset rows
    after = {s.step_id: (s.result, s.generation, s.status) for s in Step.objects.filter(task=task)}
    reset = {step_id for step_id, (result, generation, status) in after.items()
             if (result, generation) != before[step_id]}
    assert reset == {f"s{i:05d}" for i in range(500, 505)}
    assert all(after[step_id] == (None, 1, "pending") for step_id in reset)
