"""The operator's controls on a task: pause, stop, force-terminate, skip a step, resume (with
an optional params edit and its dry-run preview) and roll back to a snapshot."""
from ninja import Router

from .. import roles
from ..engine import revisions, services
from .auth import require
from .common import BODY, FOUND, client_ip, get_task, id_param, optional_object_body, responses
from .presenters import task_out
from .schemas import ControlIn, ErrorOut, ResumeIn, RevisionOut, RollbackIn, SkipStepIn, TaskOut

router = Router(tags=["control"])


def _control(request, task_id: int, action, body: ControlIn | None):
    optional_object_body(request)
    require(request, roles.OPERATOR)
    get_task(task_id)
    action(task_id=task_id, actor=request.auth, ip=client_ip(request), reason=body.reason if body else "")
    return task_out(get_task(task_id), request.auth)


CONTROL_RESPONSES = responses({200: TaskOut}, FOUND, BODY, {409: ErrorOut})


@router.post("/tasks/{task_id}/pause", response=CONTROL_RESPONSES)
def pause_task(request, task_id: int = id_param("a task id"), body: ControlIn | None = None):
    return _control(request, task_id, services.task_pause, body)


@router.post("/tasks/{task_id}/stop", response=CONTROL_RESPONSES)
def stop_task(request, task_id: int = id_param("a task id"), body: ControlIn | None = None):
    return _control(request, task_id, services.task_stop, body)


@router.post("/tasks/{task_id}/terminate", response=CONTROL_RESPONSES)
def terminate_task(request, task_id: int = id_param("a task id"), body: ControlIn | None = None):
    return _control(request, task_id, services.task_terminate, body)


@router.post("/tasks/{task_id}/skip-step", response=CONTROL_RESPONSES)
def skip_step(request, body: SkipStepIn, task_id: int = id_param("a task id")):
    """Skip one unfinished step of a task that needs a human (with the dependants that need
    its result, unless they run after skipped steps) and continue the task. Audited."""
    require(request, roles.OPERATOR)
    get_task(task_id)
    services.task_skip_step(task_id=task_id, step_id=body.step_id, reason=body.reason, actor=request.auth,
                            ip=client_ip(request), accept_changes=body.accept_changes)
    return task_out(get_task(task_id), request.auth)


@router.post("/tasks/{task_id}/resume", response=responses({200: RevisionOut}, FOUND, BODY, {409: ErrorOut}))
def resume_task(request, task_id: int = id_param("a task id"), body: ResumeIn | None = None):
    """Resume a paused task from its checkpoint. With `params`, the parameters are edited
    first — `params` holds the keys to change, merged over the current ones (a key not given
    keeps its value; the pages and the CLI mean the same) — `dry_run: true` returns the impact preview (which finished steps are kept, which
    run again, which side effects that repeats) and changes nothing; applying it with the
    preview's `version` as `expected_version` is refused (409) if the task changed meanwhile,
    or if it would perform a non-idempotent effect again that `repeat_effects` does not
    confirm (the preview's `must_confirm`). `limits` raises limits (a task paused by a limit
    needs that). If the task type's code changed since the task paused (the preview's
    `compatibility`), its policy decides: `pin` refuses (409, each difference in `errors`),
    `migrate` adapts the params, `ask` refuses (409) unless `accept_changes: true`. A dry run
    without `params` is the resume preview."""
    optional_object_body(request)
    require(request, roles.OPERATOR)
    task = get_task(task_id)
    body = body or ResumeIn()
    preview = None
    if body.params is not None:
        new_params = revisions.edited_params(task, body.params)
        if body.dry_run:
            preview = revisions.preview_edit(task, new_params, request.auth)[0]
        else:
            preview = revisions.apply_edit(task_id=task_id, new_params=new_params, expected_version=body.expected_version,
                                           limits=body.limits, repeat_effects=body.repeat_effects,
                                           actor=request.auth, ip=client_ip(request),
                                           accept_changes=body.accept_changes)
    elif body.dry_run:
        preview = revisions.preview_edit(task, task.params, request.auth)[0]
    else:
        services.task_resume(task_id=task_id, limits=body.limits, actor=request.auth, ip=client_ip(request),
                             reason=body.reason, accept_changes=body.accept_changes)
    return RevisionOut(applied=not body.dry_run, preview=preview.as_dict() if preview else None,
                       task=task_out(get_task(task_id), request.auth))


@router.post("/tasks/{task_id}/rollback", response=responses({200: RevisionOut}, FOUND, BODY, {409: ErrorOut}))
def rollback_task(request, body: RollbackIn, task_id: int = id_param("a task id")):
    """Roll a paused task back to snapshot `version` and resume from there. The preview lists
    the side effects performed after that version (they are not undone) and those the
    re-run performs again; the non-idempotent ones must be confirmed in `repeat_effects`."""
    require(request, roles.OPERATOR)
    task = get_task(task_id)
    if body.dry_run:
        preview = revisions.preview_rollback(task, body.version, request.auth)
    else:
        preview = revisions.apply_rollback(task_id=task_id, version=body.version, expected_version=body.expected_version,
                                           repeat_effects=body.repeat_effects, actor=request.auth,
                                           ip=client_ip(request), accept_changes=body.accept_changes)
    return RevisionOut(applied=not body.dry_run, preview=preview.as_dict(),
                       task=task_out(get_task(task_id), request.auth))
