"""Edit a paused task's params and resume, roll it back to a kept snapshot version (each a
form or preview, then confirm), and clone a task with new params when an edit cannot apply."""
import json

from django.contrib import messages
from django.http import HttpResponseBadRequest
from django.shortcuts import redirect, render
from django.views.decorators.http import require_http_methods, require_POST

from ..engine import actions as task_actions, compat, revisions, services, states
from ..models import Task
from .access import client_ip, get_task, require_operator, task_types, viewer_required
from .forms import attach_errors, json_text, limit_fields, param_fields, prefill, read_form

STEP_IDS_SHOWN = 500  # per list on a preview page


def _refused(request, task: Task, action: str):
    """The reason `action` is refused on `task` now, as a message on the task page (None if allowed)."""
    verdict = task_actions.check(task, action, request.user)
    if verdict.allowed:
        return None
    messages.error(request, verdict.reason)
    return redirect("task_detail", task_id=task.pk)


def _edit_form_context(task: Task, task_type, params: dict | None = None) -> dict:
    fields = prefill(param_fields(task_type.params_schema()), task.params if params is None else params)
    limits = limit_fields()
    for field in limits:  # blank keeps the task's current limit
        field["placeholder"] = task.limits.get(field["key"], field["placeholder"])
    limit = task.paused_by_limit
    return {"task": task, "task_type": task_type, "fields": fields, "limit_fields": limits, "general_errors": [],
            "paused_by_limit": limit, "limits_open": bool(limit)}


def _limit_warning(task: Task, preview: revisions.Preview, limit_values: dict) -> str:
    """The limit that paused the task, if the edit leaves it too low to finish."""
    limit = task.paused_by_limit
    if not limit:
        return ""
    value = {**task.limits, **limit_values}.get(limit)
    if value is None:
        return ""
    if limit == "max_steps":
        room = int(value) - len(preview.kept)
        if room >= len(preview.pending):
            return ""
        return (f"The task paused because max_steps ran out, and max_steps is still {value}: it will pause again "
                f"after {max(room, 0)} more step{'s' if room != 1 else ''} ({len(preview.pending)} to run). "
                f"Go back and raise max_steps under Limits to let it finish.")
    if limit_values.get(limit) is None or float(limit_values[limit]) <= float(task.limits.get(limit) or 0):
        return (f"The task paused because {limit} ran out, and {limit} is still {value}: it will pause again "
                f"right away. Go back and raise {limit} under Limits.")
    return ""


def _edit_preview(request, task: Task, params: dict, limit_values: dict, status: int = 200):
    try:
        preview, _specs = revisions.preview_edit(task, params, request.user)
    except states.InvalidTransition as exc:
        messages.error(request, str(exc))
        return redirect("task_detail", task_id=task.pk)
    changed_limits = [(key, task.limits.get(key), value) for key, value in sorted(limit_values.items())
                      if task.limits.get(key) != value]
    return render(request, "orchestrator/task_edit_preview.html", {
        "task": task,
        "preview": preview,
        "diff": [(key, json_text(old), json_text(new)) for key, (old, new) in preview.param_diff.items()],
        "changed_limits": changed_limits,
        "lists": _step_lists(preview, ("kept", "rerun", "removed", "pending")),
        "limit_warning": _limit_warning(task, preview, limit_values),
        "params_json": json_text(params),
        "limits_json": json_text(limit_values),
        "compatibility": preview.compatibility,
    }, status=status)


STEP_LISTS = {
    "kept": ("Steps kept", "finished steps that read none of the changed values: their results stay"),
    "rerun": ("Steps to re-run", "finished steps whose results are reset; they run again (new idempotency keys)"),
    "removed": ("Steps removed", "finished steps the new plan no longer has"),
    "pending": ("Steps still to run", "every step that runs after this, in plan order"),
}


def _step_lists(preview: revisions.Preview, names) -> list[dict]:
    lists = []
    for name in names:
        ids = getattr(preview, name)
        title, help_text = STEP_LISTS[name]
        if name == "rerun" and preview.rollback_to is not None:
            help_text = f"finished after v{preview.rollback_to} (or re-run since): reset, they run again"
        if name == "kept" and preview.rollback_to is not None:
            help_text = f"already done at v{preview.rollback_to}: their results stay"
        lists.append({"name": name, "title": title, "help": help_text, "ids": ids[:STEP_IDS_SHOWN],
                      "count": len(ids), "more": max(0, len(ids) - STEP_IDS_SHOWN)})
    return lists


def _posted_json(request, name: str, default=None):
    raw = request.POST.get(name)
    if raw is None or raw == "":
        if default is None:
            raise ValueError(f"{name} is missing")
        return default
    value = json.loads(raw)
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object")
    return value


@require_http_methods(["GET", "POST"])
@viewer_required
def task_edit(request, task_id: int):
    """Edit a paused task's params and resume: the form (prefilled), then the impact
    preview, then confirm (applied only if the task did not change since the preview)."""
    require_operator(request)
    task = get_task(task_id)
    refused = _refused(request, task, "edit")
    if refused:
        return refused
    task_type = task_types()[task.type]
    if request.method == "GET" and request.GET.get("resume"):
        # The resume preview: no parameter changes, what a resume runs (and what changed in the code).
        return _edit_preview(request, task, task.params, {})
    if request.method == "GET":
        return render(request, "orchestrator/task_edit.html", _edit_form_context(task, task_type))
    if "confirm" in request.POST:
        return _edit_confirm(request, task, task_type)

    context = _edit_form_context(task, task_type)
    fields, limits = context["fields"], context["limit_fields"]
    params, limit_values, errors = read_form(task.type, fields, limits, request.POST)
    if errors or any(f["errors"] for f in fields + limits):
        context["general_errors"] = attach_errors(errors, fields + limits)
        context["limits_open"] = context["limits_open"] or any(f["errors"] or f["value"] for f in limits)
        return render(request, "orchestrator/task_edit.html", context, status=422)
    return _edit_preview(request, task, params, limit_values)


def _edit_confirm(request, task: Task, task_type):
    try:
        params = _posted_json(request, "params")
        limit_values = _posted_json(request, "limits", default={})
        expected_version = int(request.POST.get("expected_version", ""))
    except ValueError as exc:
        return HttpResponseBadRequest(f"Confirm with the preview's hidden fields: {exc}.")
    try:
        params = revisions.edited_params(task, params)
        services.validate_limits(limit_values)
    except services.InvalidInput as exc:
        context = _edit_form_context(task, task_type, params)
        prefill(context["limit_fields"], limit_values)
        context["general_errors"] = attach_errors(exc.errors, context["fields"] + context["limit_fields"])
        return render(request, "orchestrator/task_edit.html", context, status=422)
    try:
        preview = revisions.apply_edit(task_id=task.pk, new_params=params, expected_version=expected_version,
                                       limits=limit_values or None, repeat_effects=request.POST.getlist("repeat_effects"),
                                       actor=request.user, ip=client_ip(request),
                                       accept_changes=request.POST.get("accept_changes", "") in ("1", "on", "true"))
    except (revisions.RepeatNotConfirmed, services.InvalidInput, compat.IncompatibleResume) as exc:
        messages.error(request, str(exc))
        return _edit_preview(request, get_task(task.pk), params, limit_values, status=409)
    except revisions.StalePreview:
        messages.error(request, f"Not applied: the task changed since your preview. This is a fresh preview of "
                                f"task #{task.pk} as it is now; review it and confirm again.")
        return _edit_preview(request, get_task(task.pk), params, limit_values, status=409)
    except states.InvalidTransition as exc:
        messages.error(request, f"Not applied: {exc}")
        return redirect("task_detail", task_id=task.pk)
    changed = ", ".join(preview.param_diff) or "no parameter changes"
    messages.success(request, f"Task #{task.pk}: parameters edited ({changed}); {len(preview.rerun)} finished "
                              f"step{'s' if len(preview.rerun) != 1 else ''} will run again. The task is resumed.")
    return redirect("task_detail", task_id=task.pk)


@require_POST
@viewer_required
def task_clone(request, task_id: int):
    """A new task of the same type with the given params (when an edit cannot be applied)."""
    require_operator(request)
    task = get_task(task_id)
    try:
        params = _posted_json(request, "params")
        limit_values = _posted_json(request, "limits", default={})
    except ValueError as exc:
        return HttpResponseBadRequest(f"Post the new params as JSON: {exc}.")
    try:
        new = services.task_create(type=task.type, params=params, limits={**task.limits, **limit_values},
                                   title=task.title, actor=request.user, ip=client_ip(request))
    except services.InvalidInput as exc:
        messages.error(request, f"No task was created: {exc}")
        return redirect("task_detail", task_id=task.pk)
    messages.success(request, f"Task #{new.pk} created from task #{task.pk} with the new parameters and queued.")
    return redirect("task_detail", task_id=new.pk)


def _rollback_preview(request, task: Task, version: int, status: int = 200):
    try:
        preview = revisions.preview_rollback(task, version, request.user)
    except states.InvalidTransition as exc:
        messages.error(request, str(exc))
        return redirect("task_detail", task_id=task.pk)
    return render(request, "orchestrator/task_rollback.html", {
        "task": task,
        "preview": preview,
        "diff": [(key, json_text(old), json_text(new)) for key, (old, new) in preview.param_diff.items()],
        "lists": _step_lists(preview, ("kept", "rerun", "pending")),
        "compatibility": preview.compatibility,
    }, status=status)


@require_http_methods(["GET", "POST"])
@viewer_required
def task_rollback(request, task_id: int, version: int):
    """Roll a paused task back to a kept snapshot version: the preview (with the side
    effects performed after it, which are not undone), then confirm."""
    require_operator(request)
    task = get_task(task_id)
    refused = _refused(request, task, "rollback")
    if refused:
        return refused
    if request.method == "GET":
        return _rollback_preview(request, task, version)
    try:
        expected_version = int(request.POST.get("expected_version", ""))
    except ValueError:
        return HttpResponseBadRequest("Confirm with the preview's hidden expected_version.")
    try:
        preview = revisions.apply_rollback(task_id=task.pk, version=version, expected_version=expected_version,
                                           repeat_effects=request.POST.getlist("repeat_effects"),
                                           actor=request.user, ip=client_ip(request),
                                           accept_changes=request.POST.get("accept_changes", "") in ("1", "on", "true"))
    except (revisions.RepeatNotConfirmed, services.InvalidInput, compat.IncompatibleResume) as exc:
        messages.error(request, str(exc))
        return _rollback_preview(request, get_task(task.pk), version, status=409)
    except revisions.StalePreview:
        messages.error(request, f"Not applied: the task changed since your preview. This is a fresh preview of "
                                f"the rollback to v{version}; review it and confirm again.")
        return _rollback_preview(request, get_task(task.pk), version, status=409)
    except states.InvalidTransition as exc:
        messages.error(request, f"Not applied: {exc}")
        return redirect("task_detail", task_id=task.pk)
    messages.success(request, f"Task #{task.pk} rolled back to v{version}: {len(preview.rerun)} "
                              f"step{'s' if len(preview.rerun) != 1 else ''} will run again. The task is resumed.")
    return redirect("task_detail", task_id=task.pk)
