"""The task list and the review queue show how long each approval and review item has waited."""
import re
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from orchestrator.engine import approvals, services
from orchestrator.presenters.waits import duration_text
from review.models import ReviewItem
from tests.review.conftest import make_review

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize("seconds, text", [
    (0, "0 s"), (59.9, "59 s"), (60, "1 min"), (59 * 60 + 59, "59 min"), (3600, "1 h"),
    (3 * 3600 + 12 * 60 + 30, "3 h 12 min"), (86400, "1 d"), (2 * 86400 + 5 * 3600 + 59, "2 d 5 h"), (-5, "0 s")])
def test_a_wait_reads_as_a_person_says_it(seconds, text):
    assert duration_text(seconds) == text


def opened_ago(item_id: int, **ago) -> None:
    ReviewItem.objects.filter(pk=item_id).update(detected_at=timezone.now() - timedelta(**ago))


def page(user, url: str) -> str:
    client = Client()
    client.force_login(user)
    return client.get(url).content.decode()


def waits_in(html: str, anchor: str) -> list[str]:
    row = re.search(rf'<tr[^>]*{anchor}.*?</tr>', html, re.S).group(0)
    return [re.sub(r"\s+", " ", text).strip()
            for text in re.findall(r'data-testid="review-wait"[^>]*>(.*?)</', row, re.S)]


def test_the_task_list_shows_how_long_its_approvals_and_reviews_have_waited(viewer):
    task = services.task_create(type="demo.notify", params={"recipients": ["a@example.org"], "subject": "s"})
    quiet = services.task_create(type="demo.notify", params={"recipients": ["b@example.org"], "subject": "s"})
    first = approvals.request(task_id=task.pk, step_id="tool-1", tool="email_send", call_id="c1", arguments={"to": 1})
    second = approvals.request(task_id=task.pk, step_id="tool-2", tool="email_send", call_id="c2", arguments={"to": 2})
    effect = make_review(task, awaiting=False)
    opened_ago(first, hours=3, minutes=12, seconds=20)
    opened_ago(second, minutes=4)
    opened_ago(effect.pk, minutes=5, seconds=3)
    html = page(viewer, "/")
    # The oldest of each kind, approvals first.
    assert waits_in(html, f'data-task-id="{task.pk}"') == ["2 approvals waiting 3 h 12 min", "review waiting 5 min"]
    assert waits_in(html, f'data-task-id="{quiet.pk}"') == []
    # Decided, it no longer waits.
    ReviewItem.objects.filter(pk=first).update(status="decided", decided_at=timezone.now())
    assert waits_in(page(viewer, "/"), f'data-task-id="{task.pk}"') == [
        "approval waiting 4 min", "review waiting 5 min"]


def test_the_review_queue_shows_each_items_wait(viewer):
    waiting = make_review(step_id="send-001")
    decided = make_review(step_id="send-002")
    opened_ago(waiting.pk, hours=3, minutes=12, seconds=5)
    ReviewItem.objects.filter(pk=decided.pk).update(detected_at=timezone.now() - timedelta(hours=1),
                                                    decided_at=timezone.now() - timedelta(minutes=40),
                                                    status="decided", decision="happened")
    html = page(viewer, "/review/?status=all")
    assert waits_in(html, f'data-review-id="{waiting.pk}"') == ["waiting 3 h 12 min"]
    assert waits_in(html, f'data-review-id="{decided.pk}"') == ["waited 20 min"]


def test_the_task_page_and_the_api_show_how_long_its_approvals_and_reviews_have_waited(viewer):
    from tests.support.helpers import bearer

    task = services.task_create(type="demo.notify", params={"recipients": ["a@example.org"], "subject": "s"})
    first = approvals.request(task_id=task.pk, step_id="tool-1", tool="email_send", call_id="c1", arguments={"to": 1})
    effect = make_review(task, awaiting=False)
    opened_ago(first, hours=2, minutes=1)
    opened_ago(effect.pk, minutes=7)
    html = page(viewer, f"/tasks/{task.pk}/")
    summary = re.search(r'data-testid="task-summary".*?</h1>.*?</div>', html, re.S).group(0)
    shown = [re.sub(r"\s+", " ", t).strip() for t in re.findall(r'data-testid="review-wait"[^>]*>(.*?)</a>', summary, re.S)]
    assert shown == ["approval waiting 2 h 1 min", "review waiting 7 min"]
    assert f'href="/review/?task={task.pk}"' in summary  # each wait leads to the task's items in the queue
    detail = Client().get(f"/api/tasks/{task.pk}", **bearer(viewer)).json()
    assert detail["unreviewed_effects"] == 1
    assert [(w["kind"], w["count"]) for w in detail["review_waits"]] == [("approval", 1), ("effect", 1)]
    assert 2 * 3600 + 60 <= detail["review_waits"][0]["waiting_seconds"] < 2 * 3600 + 120
    # Decided, nothing waits any more: the page and the API say so.
    ReviewItem.objects.filter(task=task).update(status="decided", decided_at=timezone.now())
    assert 'data-testid="review-wait"' not in page(viewer, f"/tasks/{task.pk}/")
    detail = Client().get(f"/api/tasks/{task.pk}", **bearer(viewer)).json()
    assert (detail["unreviewed_effects"], detail["review_waits"]) == (0, [])
