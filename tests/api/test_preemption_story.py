"""The contracts preemption story over real HTTP (daphne) with a real worker: 20 contracts;
after 8 the operator sends "re-parse contract #5 first with the strict extractor"; contract 5
is re-parsed next, then 9-20 continue, nothing done twice, the summary uses the re-parse."""
import json
import urllib.request

import pytest

from orchestrator.auth import token_issue
from orchestrator.models import InboundEvent, Step, Task
from tests.conftest import wait_for
from tests.support.helpers import done_order, settle

pytestmark = [pytest.mark.workers, pytest.mark.django_db(transaction=True)]


def call(port: int, token: str, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method,
                                     data=json.dumps(body).encode() if body is not None else None,
                                     headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def test_contracts_preempted_after_8_reparse_5_first_then_9_to_20_and_the_summary_uses_it(
        start_web, start_workers, make_user):
    token = token_issue(user=make_user("olga", "operator"))
    _, port = start_web()
    start_workers(1)
    status, created = call(port, token, "POST", "/api/tasks", {
        "type": "demo.contracts", "params": {"count": 20, "pace_seconds": 0.5}, "limits": {"max_subtasks": 1}})
    assert status == 201, created
    task_id = created["id"]
    wait_for(lambda: Task.objects.get(pk=task_id).steps_done >= 8, timeout=60, message="8 contracts done")
    status, sent = call(port, token, "POST", f"/api/tasks/{task_id}/events", {
        "type": "preempt", "payload": {"subtask": "reparse", "args": {"contract": 5, "extractor": "strict"},
                                       "reason": "re-parse contract #5 first with the strict extractor"}})
    assert status == 202 and sent["priority"] == 0, sent
    # While the subtask runs the task detail shows the frame.
    wait_for(lambda: call(port, token, "GET", f"/api/tasks/{task_id}")[1]["stack"]
             or Task.objects.get(pk=task_id).status == "completed", timeout=30, message="the frame pushed")
    task = settle(task_id, timeout=90)
    assert task.status == "completed", task.status_reason
    event = InboundEvent.objects.get(task_id=task_id, seq=sent["seq"])
    reparse = f"reparse-05-strict-e{event.seq}"
    order = done_order(task_id)
    at = order.index(reparse)
    contracts = [f"contract-{i:02d}" for i in range(1, 21)]
    # Re-parsed next (the contract that was pacing when it came was interrupted), then the rest.
    assert 8 <= at <= 9 and order[:at] == contracts[:at] and order[at + 1:] == contracts[at:] + ["summary"]
    assert sorted(order) == sorted(contracts + [reparse, "summary"])  # nothing done twice
    assert all(attempts == 1 for attempts in Step.objects.filter(task_id=task_id, step_id__in=contracts)
               .values_list("attempts", flat=True))
    listed = call(port, token, "GET", f"/api/tasks/{task_id}/inbox")[1]
    preempt = next(e for e in listed if e["seq"] == event.seq)
    assert preempt["state"] == "consumed" and preempt["outcome"].startswith("pushed frame 1: subtask reparse")
    assert any(e["type"] == "subtask.done" and e["state"] == "consumed" for e in listed)
    detail = call(port, token, "GET", f"/api/tasks/{task_id}")[1]
    assert detail["stack"] == []
    summary = next(s for s in detail["steps"] if s["id"] == "summary")
    assert summary["result"]["reparsed"] == {"contract_05.txt": "strict"}
    assert summary["result"]["ambiguous"][0]["contract"] == "contract_05.txt"
