"""demo.contracts as a batch: a malformed contract is skipped with its error and the
summary reports it; the rest of the batch completes."""
import shutil

import pytest

from orchestrator.engine import services
from orchestrator.engine.worker import drive_inline
from orchestrator.models import Step, Task
from demo.tasktypes.contract_extraction import SAMPLES_DIR

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_malformed_contract_does_not_sink_the_batch(tmp_path, settings):
    for sample in sorted(SAMPLES_DIR.glob("contract_*.txt"))[:3]:
        shutil.copy(sample, tmp_path / sample.name)
    (tmp_path / "contract_02a_scan.txt").write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff garbage from a scanner")
    (tmp_path / "contract_02b_memo.txt").write_text("Meeting notes. Nothing was agreed.\n")
    settings.ORCH_CONTRACTS_DIR = str(tmp_path)

    task = services.task_create(type="demo.contracts", params={"count": 5})
    drive_inline(task.pk)
    task = Task.objects.get(pk=task.pk)
    assert task.status == "completed", task.status_reason
    steps = {s.step_id: s for s in Step.objects.filter(task=task)}
    assert [sid for sid, s in steps.items() if s.status == "skipped"] == ["contract-03", "contract-04"]
    assert "is not UTF-8 text" in steps["contract-03"].error and "no parties found" in steps["contract-04"].error
    summary = steps["summary"].result
    assert summary["contracts"] == 3
    assert [s["step"] for s in summary["skipped"]] == ["contract-03", "contract-04"]
    assert "no parties found" in summary["skipped"][1]["error"]
