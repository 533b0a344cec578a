"""Live updates as HTML fragments, rendered by the same template partials the first page
`{% include %}`s, so a page that follows a task live shows what a reload would.

A fragment is `{"target": <element id>, "html": ..., "swap": "outerHTML" | "afterbegin"}`:
the page's swapper (static/orchestrator/live.js) replaces the element with that id, or
inserts the html at the start of it (event rows, newest first).
"""
from django.template.loader import render_to_string

from ..models import Task, TaskEvent
from .task_page import task_page_context, with_payload_json, with_type_titles

# The task page's regions that change while a task runs: (element id, partial). The page
# (templates/orchestrator/task_detail.html) includes each of these partials once: the header's
# above the tabs, the others in the tab panels (comments say which), every panel in the page
# whichever tab is selected, so a region in a hidden panel is updated too.
TASK_PAGE_REGIONS = (
    ("task-summary", "orchestrator/task/_summary.html"),
    ("task-controls", "orchestrator/task/_controls.html"),
    ("task-tabs", "orchestrator/task/_tabs.html"),  # the tabs: which apply, their counts
    ("task-cards", "orchestrator/task/_cards.html"),  # overview
    ("task-conversation", "orchestrator/task/_conversation.html"),  # conversation
    ("task-timeline", "orchestrator/task/_timeline.html"),  # steps & timeline
    ("task-steps", "orchestrator/task/_steps.html"),
    ("task-reviews", "orchestrator/task/_reviews.html"),  # effects & reviews
    ("task-wal", "orchestrator/task/_wal.html"),
    ("task-inbox", "orchestrator/task/_inbox.html"),  # inbox
    ("task-history", "orchestrator/task/_history.html"),  # history
    ("events-summary", "orchestrator/task/_events_summary.html"),
)
EVENT_ROWS_TARGET = "event-rows"  # the events table's tbody; rows are only ever added
EVENT_ROW_TEMPLATE = "orchestrator/task/_event_row.html"
TASK_ROW_TEMPLATE = "orchestrator/_task_row.html"


def task_row_target(task_id: int) -> str:
    return f"task-row-{task_id}"


def task_page_regions(task_id: int, user, csrf_token: str) -> tuple[int, dict[str, str]] | None:
    """(the task's event seq, {element id: html}) of every region, or None if the task is
    gone. A region a user does not see (the controls, for a viewer) renders as ""."""
    task = Task.objects.filter(pk=task_id).first()
    if task is None:
        return None
    context = {**task_page_context(task, user, with_events=False), "csrf_token": csrf_token}
    return task.event_seq, {target: render_to_string(template, context).strip()
                            for target, template in TASK_PAGE_REGIONS}


def event_row(event: TaskEvent) -> dict:
    with_payload_json([event])
    return {"target": EVENT_ROWS_TARGET, "html": render_to_string(EVENT_ROW_TEMPLATE, {"event": event}).strip(),
            "swap": "afterbegin"}


def task_rows(task_ids: list[int]) -> list[dict]:
    tasks = with_type_titles(list(Task.objects.filter(pk__in=task_ids)))
    return [{"target": task_row_target(task.pk), "swap": "outerHTML",
             "html": render_to_string(TASK_ROW_TEMPLATE, {"task": task}).strip()} for task in tasks]
