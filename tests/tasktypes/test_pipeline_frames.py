"""A preemption frame of demo.pipeline records the pipeline's scratch files and they are
deleted when the frame is popped (issue 20, item 11: `temp_files` was always empty). Real
engine and database, real stage subprocesses (inline runner)."""
import os
from pathlib import Path

import pytest

from orchestrator.engine import inbox, preemption, services, snapshots
from orchestrator.engine.worker import drive_inline
from orchestrator.models import InboundEvent, Step, Task
from demo.tasktypes.pipeline import work_dir
from tests.support import helpers

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def preempt_during(monkeypatch):
    return helpers.preempt_during(monkeypatch, "demo.pipeline")


@pytest.fixture
def pops(monkeypatch):
    """What each pop found and left of the files its frame lists."""
    seen = []
    real = preemption.remove_temp_files

    def spy(frame):
        listed = frame["references"]["temp_files"]
        before = {path for path in listed if os.path.exists(path)}
        removed = real(frame)
        seen.append({"listed": listed, "before": before, "after": {p for p in listed if os.path.exists(p)},
                     "removed": removed})
        return removed

    monkeypatch.setattr(preemption, "remove_temp_files", spy)
    return seen


def test_the_frame_lists_the_interrupted_stage_and_the_recheck_scripts_and_the_pop_deletes_them(
        preempt_during, pops, settings):
    settings.ORCH_SNAPSHOT_KEEP = 100
    sent = preempt_during("stage-03", {"subtask": "recheck", "args": {"stage": 2}, "reason": "numbers look off"})
    task = services.task_create(type="demo.pipeline", params={"stages": 4, "seconds_per_stage": 0.05})
    assert drive_inline(task.pk) == "completed"
    task = Task.objects.get(pk=task.pk)
    event = InboundEvent.objects.get(pk=sent[0].event.pk)
    assert event.outcome.startswith("pushed frame 1: subtask recheck runs first"), event.outcome
    recheck = f"recheck-02-e{event.seq}"
    directory = work_dir(task.pk)
    [frame] = snapshots.materialize(task.pk, event.consumed_in_version)["stack"]
    assert frame["interrupted"] == ["stage-03"]
    expected = {str(directory / name) for name in ("stage-03.py", "stage-03.json.tmp", f"{recheck}.py",
                                                   f"{recheck}.json.tmp")}
    assert set(frame["references"]["temp_files"]) == expected
    assert frame["references"]["temp_files_policy"] == "deleted when the frame is popped"
    # At the pop: the interrupted stage's script and the recheck's were there, and are gone.
    [popped] = pops
    assert popped["before"] == {str(directory / "stage-03.py"), str(directory / f"{recheck}.py")}
    assert popped["after"] == set() and popped["removed"] == 2
    # The recheck ran on stage 2's output; stage 3 ran again afterwards (writing its script anew).
    assert Step.objects.get(task=task, step_id=recheck).result == {
        "recheck": 2, **{k: Step.objects.get(task=task, step_id="stage-02").result[k]
                         for k in ("count", "mean", "stdev")}}
    assert not (directory / f"{recheck}.py").exists()
    assert (directory / "stage-03.py").exists() and (directory / "stage-04.json").exists()
    assert task.stack == []


def test_a_file_already_gone_or_not_removable_never_fails_the_pop(tmp_path, caplog):
    stuck = tmp_path / "dir-not-file"
    stuck.mkdir()
    plain = tmp_path / "plain.py"
    plain.write_text("x")
    frame = {"references": {"temp_files": [str(tmp_path / "never-written.py"), str(plain), str(stuck)]}}
    assert preemption.remove_temp_files(frame) == 1
    assert not plain.exists() and stuck.exists()
    assert any("could not be removed" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("args, reason", [({"stage": 9}, "args.stage must be a stage number from 1 to 3"),
                                          ({"stage": "2"}, "args.stage must be a stage number"),
                                          ({"stage": 3}, "depends on ['stage-03'], which have not run")])
def test_a_recheck_that_does_not_fit_is_rejected_with_its_reason_and_lists_no_files(args, reason):
    task = services.task_create(type="demo.pipeline", params={"stages": 3, "seconds_per_stage": 0.05})
    sent = inbox.send(task_id=task.pk, type="preempt", payload={"subtask": "recheck", "args": args},
                      source="operator").event
    assert drive_inline(task.pk) == "completed"
    event = InboundEvent.objects.get(pk=sent.pk)
    assert event.state == "rejected" and reason in event.outcome, event.outcome
    assert Task.objects.get(pk=task.pk).stack == []
    assert not list(Path(work_dir(task.pk)).glob("recheck-*"))
