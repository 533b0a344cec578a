"""GET /metrics (orchestrator/metrics.py, orchestrator/web/metrics.py): scraped by a real HTTP
client and read with prometheus_client's own parser; off without ORCH_METRICS_TOKEN; only the
token opens it (not a session, not an API token); the Grafana dashboard names exported metrics."""
import json
import re
import threading
from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from orchestrator import metrics
from orchestrator.engine import services
from orchestrator.models import (
    InboundEvent, ModelCallAttempt, RetentionRun, Step, Task, TaskEvent,
)
from review.models import ReviewItem
from tests.conftest import ROOT, wait_for
from tests.support.helpers import bearer, drive_and_close

TOKEN = "s3cret-metrics-token-0123456789abcdef"


@pytest.fixture(autouse=True)
def metrics_on(settings):
    settings.ORCH_METRICS_TOKEN = TOKEN
    metrics.ledger.reset()  # the ledger's folded totals are per process; each test has its own rows
    yield
    metrics.ledger.reset()


def scrape(client) -> dict[str, dict[tuple, float]]:
    """{sample name: {sorted label items: value}} of one scrape."""
    response = client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    assert response.status_code == 200, response.content
    assert response["Content-Type"].startswith("text/plain")
    samples: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(response.content.decode()):
        samples.setdefault(family.name, {})
        for sample in family.samples:
            samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def value(samples, name, **labels) -> float:
    return samples[name][tuple(sorted(labels.items()))]


def ago(seconds: float):
    return timezone.now() - timedelta(seconds=seconds)


def make_task(type_="test.long", status="queued", **fields) -> Task:
    return Task.objects.create(type=type_, status=status, **fields)


def test_every_figure_equals_the_rows_it_is_computed_from(client, db):
    # Tasks: two queued (waiting 40 s and 10 s since handed over), one running with a holder,
    # one running with none (between slices: waiting too), one completed, one failed.
    make_task(enqueued_at=ago(40))
    make_task(enqueued_at=ago(10))
    make_task(status="running", lease_owner="host:1", enqueued_at=ago(300))
    make_task(status="running", lease_owner="", enqueued_at=ago(5))
    done = make_task(status="completed")
    failed = make_task("test.diamond", status="failed")
    # Steps of the completed task done 1..5 s long, 10 s ago; one failed 20 s ago; one done 10 min ago.
    ended = ago(10)
    for i, seconds in enumerate((1, 2, 3, 4, 5)):
        Step.objects.create(task=done, step_id=f"s{i}", position=i, status="done",
                            started_at=ended - timedelta(seconds=seconds), finished_at=ended)
    Step.objects.create(task=failed, step_id="x", position=0, status="failed", started_at=ago(21), finished_at=ago(20))
    Step.objects.create(task=done, step_id="old", position=9, status="done", started_at=ago(601),
                        finished_at=ago(600))
    # Recoveries: two in the last hour, one two hours ago; one in progress for 30 s.
    for seq in (1, 2, 3):
        TaskEvent.objects.create(task=failed, seq=seq, kind="recovery", payload={})
    TaskEvent.objects.filter(task=failed, seq=3).update(created_at=ago(7200))
    TaskEvent.objects.create(task=failed, seq=4, kind="status", payload={})
    make_task(status="queued", lease_owner="x", recovering_since=ago(30))
    # The review queue: an effect open for 120 s, approvals open for 50 s and 20 s, one decided.
    for kind, age, status in (("effect", 120, "open"), ("approval", 50, "open"), ("approval", 20, "open"),
                              ("approval", 900, "decided")):
        item = ReviewItem.objects.create(task=done, kind=kind, status=status, reason="test",
                                         proposal={"tool": "email_send"})
        ReviewItem.objects.filter(pk=item.pk).update(detected_at=ago(age))
    # The inbox: three P4 and one P0 pending, two P4 shed, one consumed.
    for seq, (priority, state) in enumerate([(4, "pending")] * 3 + [(0, "pending")] + [(4, "shed")] * 2
                                            + [(2, "consumed")], start=1):
        InboundEvent.objects.create(task=done, seq=seq, type="note", priority=priority, source="operator",
                                    payload_sha256="0" * 64, state=state, visible_at=timezone.now())
    # The ledger: m-a twice (one row old enough to be folded into the totals), m-b a retried call with no prices.
    old = ModelCallAttempt.objects.create(task=done, step_id="t1", model="m-a", outcome="completed", prompt_tokens=100,
                                          completion_tokens=10, cached_tokens=5, cost=Decimal("0.001000"))
    ModelCallAttempt.objects.filter(pk=old.pk).update(created_at=ago(600))
    ModelCallAttempt.objects.create(task=done, step_id="t2", model="m-a", outcome="completed", prompt_tokens=200,
                                    completion_tokens=20, cost=Decimal("0.002500"))
    ModelCallAttempt.objects.create(task=done, step_id="t2", model="m-b", outcome="retried", prompt_tokens=50)
    RetentionRun.objects.create(started_at=ago(100))

    s = scrape(client)

    assert {labels: v for labels, v in s["orch_tasks"].items()} == {
        (("status", "queued"), ("type", "test.long")): 3.0, (("status", "running"), ("type", "test.long")): 2.0,
        (("status", "completed"), ("type", "test.long")): 1.0, (("status", "failed"), ("type", "test.diamond")): 1.0}
    # Steps: p50 / p95 / max of 1..5 s, and 5 done + 1 failed in the last minute.
    assert value(s, "orch_step_duration_seconds", task_type="test.long", quantile="0.5") == pytest.approx(3.0)
    assert value(s, "orch_step_duration_seconds", task_type="test.long", quantile="0.95") == pytest.approx(4.8)
    assert value(s, "orch_step_duration_seconds", task_type="test.long", quantile="1") == pytest.approx(5.0)
    assert value(s, "orch_step_duration_sample_steps", task_type="test.long") == 5
    assert ("task_type", "test.diamond") not in {k[0] for k in s["orch_step_duration_seconds"]}  # failed: no duration
    assert value(s, "orch_steps_finished_per_second", status="done") == pytest.approx(5 / 60)
    assert value(s, "orch_steps_finished_per_second", status="failed") == pytest.approx(1 / 60)
    assert value(s, "orch_steps_finished_per_second", status="skipped") == 0
    # Recoveries.
    assert value(s, "orch_recoveries_last_hour") == 2
    assert value(s, "orch_tasks_recovering") == 1
    assert 30 <= value(s, "orch_recovery_oldest_age_seconds") < 35
    # Reviews and approvals, with the age of the oldest open one.
    assert value(s, "orch_review_open_items", kind="effect") == 1
    assert value(s, "orch_review_open_items", kind="approval") == 2
    assert 120 <= value(s, "orch_review_oldest_open_age_seconds", kind="effect") < 125
    assert 50 <= value(s, "orch_review_oldest_open_age_seconds", kind="approval") < 55
    # The inbox.
    assert value(s, "orch_inbox_pending_events", priority="4") == 3
    assert value(s, "orch_inbox_pending_events", priority="0") == 1
    assert value(s, "orch_inbox_pending_events", priority="2") == 0
    assert value(s, "orch_inbox_shed_events", priority="4") == 2
    # The ledger: tokens, cost and calls by model (the old row folded, the new ones summed live).
    assert value(s, "orch_llm_tokens_total", model="m-a", kind="prompt") == 300
    assert value(s, "orch_llm_tokens_total", model="m-a", kind="completion") == 30
    assert value(s, "orch_llm_tokens_total", model="m-a", kind="cached") == 5
    assert value(s, "orch_llm_tokens_total", model="m-b", kind="prompt") == 50
    assert value(s, "orch_llm_cost_total", model="m-a") == pytest.approx(0.0035)
    assert value(s, "orch_llm_cost_total", model="m-b") == 0
    assert value(s, "orch_llm_calls_total", model="m-a", outcome="completed") == 2
    assert value(s, "orch_llm_calls_total", model="m-b", outcome="retried") == 1
    assert metrics.ledger.folded_up_to == old.pk
    # The queue: the two queued tasks and the running one nobody holds; the oldest waited 40 s.
    assert value(s, "orch_queue_waiting_tasks") == 3
    assert 40 <= value(s, "orch_queue_oldest_age_seconds") < 45
    assert 100 <= value(s, "orch_sweeper_retention_age_seconds") < 105

    # A second scrape after a new ledger row: the counters grow by it, the folded part is not counted twice.
    ModelCallAttempt.objects.create(task=done, step_id="t3", model="m-a", outcome="completed", prompt_tokens=7,
                                    cost=Decimal("0.000100"))
    again = scrape(client)
    assert value(again, "orch_llm_tokens_total", model="m-a", kind="prompt") == 307
    assert value(again, "orch_llm_cost_total", model="m-a") == pytest.approx(0.0036)
    assert value(again, "orch_llm_calls_total", model="m-a", outcome="completed") == 3


@pytest.mark.django_db(transaction=True)
@pytest.mark.task_types("tests.support.testtypes")
def test_scraped_while_a_task_runs_then_after_it_completed(client):
    task = services.task_create(type="test.interruptible", params={"mode": "sleep", "steps": 3, "seconds": 0.4})
    before = scrape(client)
    assert value(before, "orch_tasks", status="queued", type="test.interruptible") == 1
    assert value(before, "orch_queue_waiting_tasks") == 1
    runner = threading.Thread(target=drive_and_close, args=(task.pk,))
    runner.start()
    try:
        during = wait_for(lambda: (s := scrape(client)) and ("status", "running") in {
            label for labels in s["orch_tasks"] for label in labels} and s, message="a scrape showing it running")
        assert value(during, "orch_tasks", status="running", type="test.interruptible") == 1
        assert value(during, "orch_queue_waiting_tasks") == 0  # a worker holds it
    finally:
        runner.join(timeout=60)
    assert Task.objects.get(pk=task.pk).status == "completed"
    after = scrape(client)
    assert value(after, "orch_tasks", status="completed", type="test.interruptible") == 1
    assert value(after, "orch_steps_finished_per_second", status="done") == pytest.approx(3 / 60)
    assert value(after, "orch_step_duration_sample_steps", task_type="test.interruptible") == 3
    assert 0.35 <= value(after, "orch_step_duration_seconds", task_type="test.interruptible", quantile="0.5") < 5


def test_off_without_a_token_setting(client, settings, make_user):
    settings.ORCH_METRICS_TOKEN = ""
    assert client.get("/metrics").status_code == 404
    assert client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}").status_code == 404
    client.force_login(make_user("admin", superuser=True))
    assert client.get("/metrics").status_code == 404


def test_only_the_token_opens_it_not_a_session_nor_an_api_token(client, viewer, operator):
    anonymous = client.get("/metrics")
    assert anonymous.status_code == 401 and anonymous["WWW-Authenticate"].startswith("Bearer")
    assert b"orch_" not in anonymous.content
    for wrong in ("Bearer nope", f"Bearer {TOKEN[:-1]}", f"Bearer {TOKEN}x", f"Basic {TOKEN}", f"Bearer  {TOKEN.upper()}"):
        response = client.get("/metrics", HTTP_AUTHORIZATION=wrong)
        assert response.status_code in (401, 403), wrong
        assert b"orch_" not in response.content
    # A viewer (or an operator) logged in, with or without their API token, reads nothing.
    for user in (viewer, operator):
        client.force_login(user)
        assert client.get("/metrics").status_code == 401
        assert client.get("/metrics", **bearer(user)).status_code == 403
        client.logout()
    assert client.post("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}").status_code == 405
    assert client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}").status_code == 200


def test_every_grafana_panel_queries_a_metric_the_endpoint_exports(client, db):
    RetentionRun.objects.create(started_at=ago(1))
    response = client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    exported = set()
    for family in text_string_to_metric_families(response.content.decode()):
        exported |= {family.name, f"{family.name}_total" if family.type == "counter" else family.name}
        exported |= {sample.name for sample in family.samples}
    dashboard = json.loads((ROOT / "deploy" / "grafana-dashboard.json").read_text())
    panels = [p for row in dashboard["panels"] for p in [row, *row.get("panels", [])]]
    exprs = [(panel["title"], target["expr"]) for panel in panels for target in panel.get("targets", [])]
    assert len(exprs) >= 10
    for title, expr in exprs:
        named = set(re.findall(r"\borch_[a-z_]+\b", expr))
        assert named, f"panel {title!r} queries no orch_ metric: {expr}"
        assert named <= exported, f"panel {title!r} names {named - exported}, not exported"
    # And every exported metric family (but the scrape's own timing) is on the dashboard.
    on_dashboard = {name for _, expr in exprs for name in re.findall(r"\borch_[a-z_]+\b", expr)}
    families = {name.removesuffix("_total") for name in exported}
    assert {f for f in families if f != "orch_metrics_scrape_seconds"} <= {
        n.removesuffix("_total") for n in on_dashboard}
    # The scrape config sends the bearer token to the endpoint.
    scrape_config = (ROOT / "deploy" / "prometheus.yml").read_text()
    assert "metrics_path: /metrics" in scrape_config and "authorization:" in scrape_config
