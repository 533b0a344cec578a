"""verify_action for the task page's controls (after Zulip's verify_action): after each
state change, the actions the live `state` message carries must be exactly the controls a
fresh render of the page shows for that state — so a page that follows a task live never
shows other buttons than a reload would."""
import html

import pytest
from channels.db import database_sync_to_async
from django.db import transaction
from django.test import Client

from orchestrator.engine import services, states
from orchestrator.models import Step, Task, TaskStatus as S
from tests.live.test_websockets import connect, receive_until, session_headers
from tests.support.controls import allowed, controls, visible_controls

pytestmark = pytest.mark.django_db(transaction=True)


def move(task_id: int, to: str, **fields):
    """A state change as the runner makes it (a `status` event, an audit entry)."""
    with transaction.atomic():
        states.transition(states.lock_task(task_id), to, reason=f"test: {to}", **fields)


def fresh_page(user, task_id: int) -> tuple[set[str], set[str], str]:
    client = Client()
    client.force_login(user)
    response = client.get(f"/tasks/{task_id}/")
    assert response.status_code == 200, response.content[:2000]
    body = response.content.decode()
    rendered, visible = controls(body)
    note = body.split('data-live="controls-note"', 1)[1].split(">", 1)[1].split("</span>", 1)[0] \
        if 'data-live="controls-note"' in body else ""
    return rendered, visible, html.unescape(note.strip())


# Each change, and the status the task has after it.
CHANGES = [
    ("a worker claims it", S.RUNNING, lambda t: move(t, S.RUNNING, lease_owner="w:1")),
    ("the same failure twice", S.NEEDS_HUMAN, lambda t: move(t, S.NEEDS_HUMAN, lease_owner="")),
    ("an operator resumes it", S.QUEUED, lambda t: services.task_resume(task_id=t)),
    ("a worker claims it again", S.RUNNING, lambda t: move(t, S.RUNNING, lease_owner="w:2")),
    ("an operator asks for a pause", S.PAUSING, lambda t: services.task_pause(task_id=t)),
    ("the runner pauses it", S.PAUSED, lambda t: move(t, S.PAUSED, lease_owner="", control="")),
    ("an operator resumes it", S.QUEUED, lambda t: services.task_resume(task_id=t)),
    ("a worker claims it", S.RUNNING, lambda t: move(t, S.RUNNING, lease_owner="w:3")),
    ("max_steps runs out", S.PAUSED,
     lambda t: move(t, S.PAUSED, lease_owner="", paused_by_limit="max_steps", steps_done=1)),
    ("resumed with a higher limit", S.QUEUED, lambda t: services.task_resume(task_id=t, limits={"max_steps": 5})),
    ("a worker claims it", S.RUNNING, lambda t: move(t, S.RUNNING, lease_owner="w:4")),
    ("a side effect is in doubt", S.AWAITING_REVIEW, lambda t: move(t, S.AWAITING_REVIEW, lease_owner="")),
    ("an operator stops it", S.STOPPED, lambda t: services.task_stop(task_id=t)),
]


@pytest.mark.parametrize("role", ["operator", "viewer"])
async def test_live_actions_equal_the_controls_of_a_fresh_page(role, make_user):
    user = await database_sync_to_async(make_user)("olga", role)

    @database_sync_to_async
    def setup() -> Task:
        task = services.task_create(type="demo.migrate_rows", params={"rows": 100, "batch_size": 100},
                                    limits={"max_steps": 1})
        Step.objects.create(task=task, step_id="prepare-source", position=0, status="failed")
        return task

    task = await setup()
    ws = await connect(f"/ws/tasks/{task.pk}/", await database_sync_to_async(session_headers)(user))
    page = database_sync_to_async(fresh_page)
    seen = []

    async def verify(what: str, status: str):
        seq = await database_sync_to_async(lambda: Task.objects.get(pk=task.pk).event_seq)()
        messages = await receive_until(ws, lambda m: any(
            x["type"] == "state" and x["status"] == status and x["seq"] >= seq for x in m))
        state = [x for x in messages if x["type"] == "state"][-1]
        rendered, visible, note = await page(user, task.pk)
        where = f"after {what!r} ({status}) as {role}"
        assert allowed(state["actions"]) == visible, where
        if role == "viewer":
            assert rendered == set() and visible == set() and note == "", where  # no controls at all
        else:
            assert state["controls_note"] == note, where
        seen.append((status, sorted(visible)))

    await verify("the task is created", S.QUEUED)
    for what, status, change in CHANGES:
        await database_sync_to_async(change)(task.pk)
        await verify(what, status)
    await ws.disconnect()
    if role == "operator":  # the sequence went through the interesting control sets
        assert ("needs_human", ["resume", "skip_step", "stop", "terminate"]) in seen
        assert ("paused", ["edit", "resume", "rollback", "stop", "terminate"]) in seen
        assert ("paused", ["edit", "rollback", "stop", "terminate"]) in seen  # paused by the limit: no Resume
        assert ("stopped", []) in seen
