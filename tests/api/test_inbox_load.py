"""Issue 12's load checks for the inbox, over real HTTP against real web servers (daphne)
and, where a task has to run, real workers: a webhook delivered 50 times at once is one
event; a burst of mergeable events is applied once; a flood of P4 events is shed past the
per-task limit while P0/P1 still get through; waiting tasks hold no worker and all resume.

The senders are threads released together by a barrier, so the requests really overlap
(each daphne process runs sync views one at a time, so the dedupe test uses two servers:
their requests race in the database, as those of a real deployment's web processes do)."""
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone as dt_timezone

import pytest
import requests
from standardwebhooks.webhooks import Webhook

from orchestrator.auth import token_issue
from orchestrator.engine import services, webhooks
from orchestrator.models import AuditEntry, InboundEvent, Step, Task, TaskEvent, WebhookSource
from tests.conftest import wait_for
from tests.support.helpers import settle

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.task_types("tests.support.testtypes")]

# The web servers and workers a test starts must know the test task types too.
TEST_TYPES = {"ORCH_EXTRA_TASK_TYPES": "tests.support.testtypes"}


class Api:
    """The HTTP API of one real server, as a script with a bearer token uses it."""

    def __init__(self, port: int, token: str = ""):
        self.base = f"http://127.0.0.1:{port}"
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}

    def post(self, path: str, body, headers: dict | None = None) -> requests.Response:
        data = body if isinstance(body, (bytes, str)) else json.dumps(body)
        return requests.post(self.base + path, data=data, timeout=30,
                             headers={"Content-Type": "application/json", **self.headers, **(headers or {})})

    def get(self, path: str) -> requests.Response:
        return requests.get(self.base + path, headers=self.headers, timeout=30)

    def send_event(self, task_id: int, body: dict) -> requests.Response:
        return self.post(f"/api/tasks/{task_id}/events", body)


def all_at_once(calls: list) -> list:
    """Run `calls` in threads released together; their results, in order."""
    barrier = threading.Barrier(len(calls))

    def run(call):
        barrier.wait(timeout=30)
        return call()

    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(run, calls))


@pytest.fixture
def operator_api(make_user):
    """Api(port) for an operator's bearer token."""
    token = token_issue(user=make_user("otto", "operator"))
    return lambda port: Api(port, token)


def growing_chain(**params) -> Task:
    """A running task of the test type that takes user messages: a chain of links, each
    working `link_ms` (obeying the cancellation token)."""
    return services.task_create(type="test.growing", params={"mode": "chain", "effects": False, **params},
                                limits={"max_subtasks": 1})


def held_by_a_worker(task: Task) -> None:
    """Wait until a worker runs `task` (its plan made, its lease held). A step's start is not
    committed anywhere, so this is as close as the database tells."""
    wait_for(lambda: Task.objects.filter(pk=task.pk, status="running").exclude(lease_owner="").exists()
             and TaskEvent.objects.filter(task=task, kind="planned").exists(),
             timeout=30, message="the task held by a worker")


# --- 1. one webhook delivery, 50 times at once ---------------------------------------------------

def test_fifty_copies_of_one_webhook_delivery_make_one_event_and_a_forged_copy_is_401_and_audited(start_web):
    servers = [Api(start_web()[1]), Api(start_web()[1])]
    source = WebhookSource.objects.create(name="warehouse", secrets=[webhooks.new_secret()],
                                          allowed_types=["upstream.ready"], task_types=["demo.pipeline"],
                                          priority_ceiling=3)
    task = services.task_create(type="demo.pipeline", params={})  # no workers: it stays queued
    raw = json.dumps({"type": "upstream.ready", "payload": {"resource": "orders.csv"}, "merge_key": "orders"})
    when = datetime.now(dt_timezone.utc)

    def headers(secret: str) -> dict:
        return {"webhook-id": "msg_2Ld8", "webhook-timestamp": str(int(when.timestamp())),
                "webhook-signature": Webhook(secret).sign("msg_2Ld8", when, raw)}

    path = f"/api/hooks/warehouse/tasks/{task.pk}/events"
    genuine = [lambda i=i: servers[i % 2].post(path, raw, headers(source.secrets[0])) for i in range(50)]
    # The same delivery id, signed with a secret the source does not have: a forgery.
    forged = lambda: servers[0].post(path, raw, headers(webhooks.new_secret()))  # noqa: E731
    answers = all_at_once([*genuine[:25], forged, *genuine[25:]])
    forged_answer = answers.pop(25)

    refused = [a.text for a in answers if a.status_code >= 300]
    assert sorted(a.status_code for a in answers) == [200] * 49 + [202], refused
    bodies = [a.json() for a in answers]
    [new] = [b for b in bodies if not b["duplicate"]]
    assert sum(b["duplicate"] for b in bodies) == 49
    assert {b["event_id"] for b in bodies} == {new["event_id"]}  # every repeat answers the first event
    [event] = InboundEvent.objects.filter(task=task)
    assert (event.pk, event.source, event.source_event_id, event.state, event.seq) == (
        new["event_id"], "webhook:warehouse", "msg_2Ld8", "pending", 1)
    task = Task.objects.get(pk=task.pk)
    assert (task.inbox_seq, task.inbox_pending) == (1, 1)  # no seq burned, the backlog counts one
    assert AuditEntry.objects.filter(action="task.event", task=task).count() == 1

    assert forged_answer.status_code == 401 and "signature" in forged_answer.json()["detail"]
    [rejected] = AuditEntry.objects.filter(action="webhook.rejected")
    assert rejected.task_id == task.pk and rejected.after["webhook_id"] == "msg_2Ld8"


# --- 2. a burst of mergeable events --------------------------------------------------------------

@pytest.mark.workers
def test_a_burst_of_twenty_mergeable_events_to_a_running_task_is_applied_once(start_web, start_workers, operator_api):
    start_workers(1, **TEST_TYPES)
    api = operator_api(start_web(**TEST_TYPES)[1])
    task = growing_chain(items=60, link_ms=250)  # 15 s of links: it runs through the whole test
    held_by_a_worker(task)
    wait_for(lambda: Step.objects.filter(task=task, step_id="link-1", status="done").exists(), timeout=30,
             message="two links done")
    answers = all_at_once([lambda i=i: api.send_event(task.pk, {
        "type": "upstream.ready", "payload": {"resource": "orders", "n": i}, "merge_key": "orders"})
        for i in range(20)])
    assert [a.status_code for a in answers] == [202] * 20, [a.text for a in answers]

    burst = list(InboundEvent.objects.filter(task=task, type="upstream.ready").order_by("seq"))
    assert len(burst) == 20
    # Sent at once; one web process takes them in about a second (more on a busy machine):
    # what the merge needs is that they all arrive within one merge window of each other.
    assert (burst[-1].created_at - burst[0].created_at).total_seconds() < 1.5, "not a burst within the merge window"
    newest = burst[-1]
    wait_for(lambda: InboundEvent.objects.get(pk=newest.pk).state == "consumed", timeout=20,
             message="the newest event of the burst consumed")
    assert Task.objects.get(pk=task.pk).status == "running"  # consumed at a resume point of the run

    listed = {e["event_id"]: e for e in api.get(f"/api/tasks/{task.pk}/inbox").json()}
    states = [listed[e.pk]["state"] for e in burst]
    assert states == ["merged"] * 19 + ["consumed"]
    assert listed[newest.pk]["payload"] == {"resource": "orders", "n": newest.payload["n"]}
    assert listed[newest.pk]["consumed_in_version"] is not None
    # The burst collapsed into the newest: each of the 19 names it.
    for event in burst[:-1]:
        assert listed[event.pk]["superseded_by"] == newest.pk
        assert listed[event.pk]["outcome"] == f"merged into #{newest.seq}"
    # Applied once: one consumption in the progress log takes it, and it names none of the 19.
    consumptions = TaskEvent.objects.filter(task=task, kind="inbox_consumed").values_list("payload", flat=True)
    taken = [e["seq"] for payload in consumptions for e in payload["events"]]
    assert [seq for seq in taken if seq in {e.seq for e in burst}] == [newest.seq]
    assert Task.objects.get(pk=task.pk).inbox_pending == 0


# --- 3. a flood of P4 events ----------------------------------------------------------------------

@pytest.mark.workers
def test_a_flood_of_600_p4_events_is_shed_past_the_limit_while_p0_and_p1_get_through(start_web, start_workers,
                                                                                    operator_api, settings,
                                                                                    tmp_path):
    limit = settings.ORCH_INBOX_SHED_P4_AT  # the default (100): the web server reads the same
    start_workers(1, **TEST_TYPES)
    api = operator_api(start_web(**TEST_TYPES)[1])
    # Busy: its first link works until the test releases it, so no resume point consumes
    # anything during the flood and the backlog only grows.
    release = tmp_path / "release-link-0"
    task = growing_chain(items=2, hold_until=str(release))
    held_by_a_worker(task)

    flood: list[requests.Response] = []
    lock = threading.Lock()

    def report(i: int) -> None:
        # Each probe reports on its own merge key: 600 reporters, nothing to merge.
        body = {"type": "progress.external", "payload": {"message": f"probe {i}"},
                "merge_key": f"probe-{i}", "source_event_id": f"probe-{i}"}
        answer = api.send_event(task.pk, body)
        # On SQLite a request that waited out its busy timeout is a 503 "busy, try again" with
        # Retry-After (orchestrator/database_busy.py): a sender retries, with the same
        # source_event_id, as a real one does. (One of 600 did in a CI run on a loaded machine.)
        for _ in range(3):
            if answer.status_code != 503:
                break
            assert answer.headers.get("Retry-After"), answer.text
            answer = api.send_event(task.pk, body)
        with lock:
            flood.append(answer)

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(report, i) for i in range(600)]
        # In the middle of the flood, once the task's backlog is refusing P4: a pause (P0)
        # and a message to the agent (P1).
        wait_for(lambda: any(a.status_code == 429 for a in list(flood)), timeout=30, message="the first 429")
        pause = api.send_event(task.pk, {"type": "pause", "source_event_id": "pause-1"})
        message = api.send_event(task.pk, {"type": "user.message", "payload": {"text": "use the EU region"}})
        answered_before_the_controls = len(flood)
        for future in futures:
            future.result()
    assert answered_before_the_controls < 600, "the flood was over before P0/P1 were sent"

    assert pause.status_code == 202 and pause.json()["type"] == "pause", pause.text
    assert message.status_code == 202 and message.json()["priority"] == 1, message.text
    codes = [a.status_code for a in flood]
    assert codes.count(202) == limit and codes.count(429) == 600 - limit, {c: codes.count(c) for c in set(codes)}
    shed_answers = [a for a in flood if a.status_code == 429]
    assert {a.headers.get("Retry-After") for a in shed_answers} == {"5"}
    assert min(a.json()["pending"] for a in shed_answers) >= limit
    assert all(f"the limit for P4 is {limit}" in a.json()["detail"] for a in shed_answers)

    # Nothing dropped silently: every refusal is a `shed` row, counted and listed.
    assert InboundEvent.objects.filter(task=task, state="shed").count() == 600 - limit
    assert InboundEvent.objects.filter(task=task, type="progress.external").count() == 600
    listed = api.get(f"/api/tasks/{task.pk}/inbox").json()
    listed_shed = [e for e in listed if e["state"] == "shed"]
    assert len(listed_shed) >= len(listed) - 2 - limit  # the newest 500: the shed, the P0, the P1
    assert all(f"the limit for P4 is {limit}" in e["outcome"] for e in listed_shed)
    assert {"pause", "user.message"} <= {e["type"] for e in listed}

    # The P0 was taken by the worker at once (a pause lets the running step finish); the P1
    # waits for a resume point, which comes when the task resumes: it is consumed first there.
    paused = InboundEvent.objects.get(pk=pause.json()["event_id"])
    assert paused.state == "consumed" and paused.outcome.startswith("acknowledged by worker"), paused.outcome
    release.touch()
    wait_for(lambda: Task.objects.get(pk=task.pk).status == "paused", timeout=15, message="the task paused")
    assert InboundEvent.objects.get(pk=message.json()["event_id"]).state == "pending"
    resumed = api.send_event(task.pk, {"type": "resume"})
    assert resumed.status_code == 202, resumed.text
    assert settle(task.pk, timeout=30).status == "completed"
    consumed = InboundEvent.objects.get(pk=message.json()["event_id"])
    assert consumed.state == "consumed" and consumed.outcome == "noted: use the EU region"
    accepted = InboundEvent.objects.filter(task=task, type="progress.external").exclude(state="shed")
    assert {e.state for e in accepted} == {"consumed"} and accepted.count() == limit
    assert consumed.consumed_in_version == min(e.consumed_in_version for e in accepted)


# --- 4. waiting tasks hold no worker ----------------------------------------------------------------

@pytest.mark.workers
def test_two_workers_run_new_work_while_ten_tasks_wait_and_all_ten_resume_on_their_events(start_web, start_workers,
                                                                                          operator_api):
    start_workers(2, **TEST_TYPES)
    api = operator_api(start_web(**TEST_TYPES)[1])
    waiting = [services.task_create(type="test.approval", params={"timeout": 600, "amount": 10 + i}).pk
               for i in range(10)]
    wait_for(lambda: Task.objects.filter(pk__in=waiting, status="waiting").count() == 10, timeout=30,
             message="ten tasks waiting")
    assert not Task.objects.filter(pk__in=waiting).exclude(lease_owner="").exists()
    # Ten waits on two workers, and fresh work still runs to the end.
    fresh = services.task_create(type="demo.pipeline", params={"stages": 2, "seconds_per_stage": 0.1})
    assert settle(fresh.pk, timeout=30).status == "completed"
    assert Task.objects.filter(pk__in=waiting, status="waiting").count() == 10

    answers = all_at_once([lambda task_id=task_id: api.send_event(task_id, {
        "type": "instruction", "payload": {"approved": True, "note": f"ok {task_id}"},
        "source_event_id": f"decision-{task_id}"}) for task_id in waiting])
    assert [a.status_code for a in answers] == [202] * 10, [a.text for a in answers]
    wait_for(lambda: Task.objects.filter(pk__in=waiting, status="completed").count() == 10, timeout=30,
             message="all ten resumed and completed")
    for task_id in waiting:
        assert Step.objects.get(task_id=task_id, step_id="finish").result == "paid"
        assert Step.objects.get(task_id=task_id, step_id="await").result == {"approved": True, "note": f"ok {task_id}"}
        event = InboundEvent.objects.get(task_id=task_id, type="instruction")
        assert event.state == "consumed" and event.outcome == "received by the wait of step await"
