"""engine/actions.py: which actions a user may take on a task now, and why not — the one
answer the services enforce, the page renders, the API returns and the live state carries."""
import pytest

from orchestrator.engine import actions, revisions, services
from orchestrator.engine.states import InvalidTransition
from orchestrator.models import Snapshot, Step, Task

pytestmark = pytest.mark.django_db

NONE: set[str] = set()
# (status, control, paused_by_limit) -> what an operator may do
EXPECTED = {
    ("queued", "", ""): {"stop", "pause", "terminate"},
    ("running", "", ""): {"stop", "pause", "terminate"},
    ("pausing", "pause", ""): {"stop", "terminate"},
    ("running", "terminate", ""): NONE,
    ("stopping", "stop", ""): {"terminate"},
    ("paused", "", ""): {"stop", "resume", "edit", "rollback", "terminate"},
    ("paused", "", "max_steps"): {"stop", "edit", "rollback", "terminate"},  # max_steps 2, 2 steps done
    ("awaiting_review", "", ""): {"stop", "terminate"},
    ("needs_human", "", ""): {"stop", "resume", "skip_step", "terminate"},
    ("completed", "", ""): NONE,
    ("failed", "", ""): NONE,
    ("stopped", "", ""): NONE,
    ("terminated", "", ""): NONE,
}


def make_task(status="queued", control="", paused_by_limit="") -> Task:
    task = services.task_create(type="demo.migrate_rows", params={"rows": 200, "batch_size": 100},
                                limits={"max_steps": 2})
    Step.objects.create(task=task, step_id="prepare-source", position=0, status="done")
    Step.objects.create(task=task, step_id="batch-0001", position=1, status="failed")
    Snapshot.objects.create(task=task, version=1, state={})
    Task.objects.filter(pk=task.pk).update(status=status, control=control, paused_by_limit=paused_by_limit,
                                           steps_done=2, lease_owner="w" if status in ("running", "pausing",
                                                                                        "stopping") else "")
    return Task.objects.get(pk=task.pk)


def allowed(verdicts) -> set[str]:
    return {name for name, verdict in verdicts.items() if verdict.allowed}


@pytest.mark.parametrize("state", list(EXPECTED), ids=lambda s: "-".join(filter(None, s)))
def test_what_an_operator_may_do_in_each_state(state, operator):
    task = make_task(*state)
    verdicts = actions.available(task, operator)
    assert list(verdicts) == list(actions.NAMES)
    assert allowed(verdicts) == EXPECTED[state]
    for verdict in verdicts.values():  # every refusal says why, naming the task
        assert verdict.allowed == (verdict.reason == ""), verdict
        if not verdict.allowed:
            assert f"#{task.pk}" in verdict.reason
    assert allowed(actions.available(task)) == EXPECTED[state]  # the system (CLI) may do the same


def test_the_reasons_an_operator_reads(operator):
    done = make_task("completed")
    assert actions.check(done, "pause", operator).reason == (
        f"Task #{done.pk} is completed; a finished task cannot be paused.")
    review = make_task("awaiting_review")
    assert "continues by itself once its review items are decided" in actions.check(review, "resume").reason
    limited = make_task("paused", paused_by_limit="max_steps")
    assert actions.check(limited, "resume").reason == (
        f"Task #{limited.pk} paused because max_steps ran out; raise max_steps to resume it.")
    assert actions.check(limited, "resume", limits={"max_steps": 10}).allowed
    assert "raise max_steps" in actions.controls_note(limited, actions.available(limited, operator))
    running = make_task("running")
    assert actions.check(running, "edit").reason == (
        f"Task #{running.pk} is running; only a paused task can have its parameters edited: pause it first.")
    assert actions.controls_note(running, actions.available(running)) == ""
    assert actions.controls_note(done, actions.available(done)) == "This task has finished; it cannot be controlled."
    terminating = make_task("running", control="terminate")
    assert actions.controls_note(terminating, actions.available(terminating)) == (
        "No control applies while the task is running.")


def test_a_viewer_may_do_nothing_and_is_told_to_ask_for_the_operator_role(viewer):
    verdicts = actions.available(make_task("paused"), viewer)
    assert allowed(verdicts) == NONE
    assert verdicts["pause"].reason == ("Only operators can pause tasks; ask an administrator to add you to the "
                                        "'operator' group.")


def test_the_services_enforce_it_with_the_same_reason(operator, viewer):
    done = make_task("completed")
    with pytest.raises(InvalidTransition) as refused:
        services.task_pause(task_id=done.pk, actor=operator)
    assert str(refused.value) == actions.check(done, "pause", operator).reason
    needs_human = make_task("needs_human")
    with pytest.raises(InvalidTransition, match="only a queued, running or waiting task can be paused"):
        services.task_pause(task_id=needs_human.pk)
    with pytest.raises(InvalidTransition, match="Only operators can stop tasks"):
        services.task_stop(task_id=needs_human.pk, actor=viewer)
    terminating = make_task("running", control="terminate")
    with pytest.raises(InvalidTransition, match="Force-terminate was requested"):
        services.task_stop(task_id=terminating.pk)  # a stop must not replace a pending terminate
    assert Task.objects.get(pk=terminating.pk).control == "terminate"
    services.task_terminate(task_id=terminating.pk)  # repeating a request stays harmless
    running = make_task("running")
    with pytest.raises(InvalidTransition, match="only a paused task can be rolled back"):
        revisions.preview_rollback(running, 1)
    with pytest.raises(InvalidTransition, match="a step can be skipped only while the task needs a human"):
        services.task_skip_step(task_id=running.pk, step_id="batch-0001", reason="r")
    for status, control in (("queued", ""), ("running", ""), ("paused", ""), ("needs_human", ""),
                            ("running", "terminate")):
        task = make_task(status, control)
        for name, verdict in actions.available(task).items():  # the services agree with every verdict
            repeated = task.control == name or task.status == actions.TARGETS[name]  # harmless, answered as done
            if name in ("pause", "stop", "terminate") and not verdict.allowed and not repeated:
                with pytest.raises(InvalidTransition, match=verdict.reason[:20]):
                    getattr(services, f"task_{name}")(task_id=task.pk)


def test_every_transition_but_the_limit_pause_clears_paused_by_limit():
    task = make_task("paused", paused_by_limit="max_steps")
    services.task_stop(task_id=task.pk)
    task = Task.objects.get(pk=task.pk)
    assert (task.status, task.paused_by_limit) == ("stopped", "")


def test_the_api_returns_the_actions_of_the_caller(client, operator, viewer):
    from orchestrator.auth import token_issue

    task = make_task("needs_human")
    for user, expected in ((operator, {"stop", "resume", "skip_step", "terminate"}), (viewer, NONE)):
        body = client.get(f"/api/tasks/{task.pk}", HTTP_AUTHORIZATION=f"Bearer {token_issue(user=user)}").json()
        assert [a["name"] for a in body["actions"]] == list(actions.NAMES)
        assert {a["name"] for a in body["actions"] if a["allowed"]} == expected
        assert all(set(a) == {"name", "allowed", "reason"} for a in body["actions"])
        assert body["paused_by_limit"] == ""
    schema = client.get("/api/openapi.json").json()["components"]["schemas"]
    assert set(schema["ActionOut"]["properties"]) == {"name", "allowed", "reason"}
    assert schema["ActionOut"]["properties"]["name"]["enum"] == list(actions.NAMES)
    assert "actions" in schema["TaskOut"]["required"]
