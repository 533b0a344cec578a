"""Plans that grow at run time, crashed with a real kill -9: the worker dies after the
adding step's effects and before (or inside) the checkpoint that would add its steps. The
recovered task adds them exactly once and completes, with every effect exactly once."""
import pytest

from orchestrator.engine import services
from orchestrator.models import Step, TaskEvent, WalEntry
from demo.models import DemoDestination
from tests.support.helpers import settle

pytestmark = [pytest.mark.workers, pytest.mark.django_db(transaction=True)]


@pytest.mark.parametrize("point", ["before_checkpoint", "mid_checkpoint"])
def test_a_fan_out_killed_before_its_checkpoint_adds_each_step_once(point, start_workers, settings, tmp_path):
    settings.ORCH_EXTRA_TASK_TYPES = ["tests.support.testtypes"]
    start_workers(1, ORCH_EXTRA_TASK_TYPES="tests.support.testtypes", ORCH_FAULTS=f"{point}@discover:kill-once",
                  ORCH_VAR_DIR=tmp_path)
    task = services.task_create(type="test.growing", params={"items": 5})
    task = settle(task.pk)
    assert (tmp_path / "faults" / f"{point}@discover").exists(), "the crash did not happen"
    assert task.status == "completed", task.status_reason
    assert task.recovery_attempts == 1
    steps = list(Step.objects.filter(task=task).order_by("position").values_list("step_id", "added_by"))
    assert steps == [("discover", "")] + [(f"item-{i}", "discover") for i in range(5)] + [("collect", "discover")]
    assert task.steps_total == 7
    done = list(TaskEvent.objects.filter(task=task, kind="step_done").values_list("payload__step", flat=True))
    assert sorted(done) == sorted(sid for sid, _ in steps)  # each step committed once
    # discover's upsert ran before the crash and was not performed again: one WAL entry, done.
    assert list(WalEntry.objects.filter(task=task, step_id="discover").values_list("status", flat=True)) == ["done"]
    assert WalEntry.objects.filter(task=task).count() == 6
    assert DemoDestination.objects.filter(id__gte=700_000 + task.pk * 1000, id__lt=700_000 + (task.pk + 1) * 1000
                                          ).count() == 6
    assert Step.objects.get(task=task, step_id="collect").result == sum(range(5))


def test_a_chain_that_grows_itself_killed_mid_way_has_one_copy_of_each_link(start_workers, settings, tmp_path):
    settings.ORCH_EXTRA_TASK_TYPES = ["tests.support.testtypes"]
    start_workers(1, ORCH_EXTRA_TASK_TYPES="tests.support.testtypes",
                  ORCH_FAULTS="before_checkpoint@link-3:kill-once", ORCH_VAR_DIR=tmp_path)
    task = services.task_create(type="test.growing", params={"mode": "chain", "items": 8})
    task = settle(task.pk)
    assert (tmp_path / "faults" / "before_checkpoint@link-3").exists(), "the crash did not happen"
    assert task.status == "completed" and task.recovery_attempts == 1
    assert list(Step.objects.filter(task=task).order_by("position").values_list("step_id", flat=True)) == [
        f"link-{i}" for i in range(8)]
    assert Step.objects.get(task=task, step_id="link-7").result == sum(range(8))
