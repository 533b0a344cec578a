"""The task pages: the task list, the create form, the task page and its controls (pause,
stop, force-terminate, resume, skip a step, send an event).

Thin, like the API: views read through selectors, write through engine.services, and
check roles (orchestrator.roles). Every page needs a logged-in user with a role.
"""
import json
from urllib.parse import urlencode

from django.contrib import messages
from django.http import Http404, HttpResponseBadRequest
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from .. import selectors
from ..engine import compat, inbox, services, states, verbs
from ..models import Task, TaskStatus
from ..presenters.task_page import task_page_context, with_type_titles
from ..primitives import jsonlimits
from .access import client_ip, get_task, require_operator, task_types, viewer_required
from .forms import attach_errors, limit_fields, param_fields, read_form


@require_GET
@viewer_required
def task_list(request):
    status = request.GET.get("status", "").strip()
    type_name = request.GET.get("type", "").strip()
    text = request.GET.get("q", "").strip()
    try:
        before = int(request.GET.get("before") or 0) or None
    except ValueError:
        before = None
    qs = selectors.task_list(status=status, type=type_name, text=text)
    tasks, next_before = selectors.task_page(qs, before=before)

    filters = {k: v for k, v in (("status", status), ("type", type_name), ("q", text)) if v}
    type_names = sorted(set(task_types()) | ({type_name} if type_name else set()))
    with_type_titles(tasks)
    return render(request, "orchestrator/task_list.html", {
        "tasks": tasks,
        "next_before": next_before,
        "before": before,
        "filters": filters,
        "filter_query": urlencode(filters),
        "status": status,
        "type_name": type_name,
        "q": text,
        "statuses": TaskStatus.values,
        "type_names": type_names,
    })


@require_http_methods(["GET", "POST"])
@viewer_required
def task_new(request):
    require_operator(request)
    types = task_types()
    data = request.POST if request.method == "POST" else request.GET
    type_name = data.get("type", "").strip()
    task_type = types.get(type_name)
    context = {"types": types, "type_name": type_name, "task_type": task_type, "general_errors": [],
               "title": ""}
    if task_type is None:
        if type_name:
            context["general_errors"].append(f"Unknown task type {type_name!r}; choose one below.")
        return render(request, "orchestrator/task_new.html", context,
                      status=422 if request.method == "POST" else 200)

    fields = param_fields(task_type.params_schema())
    limits = limit_fields()
    context.update(fields=fields, limit_fields=limits)
    if request.method == "GET":
        return render(request, "orchestrator/task_new.html", context)

    params, limit_values, errors = read_form(type_name, fields, limits, request.POST)
    title = request.POST.get("title", "").strip()
    context["title"] = title
    if not errors and not any(f["errors"] for f in fields + limits):
        try:
            task = services.task_create(type=type_name, params=params, limits=limit_values, title=title,
                                        actor=request.user, ip=client_ip(request))
        except services.InvalidInput as exc:
            errors = exc.errors
        else:
            messages.success(request, f"Task #{task.pk} created and queued.")
            return redirect("task_detail", task_id=task.pk)
    context["general_errors"] = attach_errors(errors, fields + limits)
    context["limits_open"] = any(f["errors"] or f["value"] for f in limits)
    return render(request, "orchestrator/task_new.html", context, status=422)


@require_GET
@viewer_required
def task_detail(request, task_id: int):
    task = get_task(task_id)
    return render(request, "orchestrator/task_detail.html", task_page_context(task, request.user))


def page_verbs() -> dict:
    """The verbs the task page's control form posts (engine/verbs.py): those with plain inputs,
    and resume (its "accept the changes" box is an input too)."""
    return {name: verb for name, verb in verbs.VERBS.items() if verb.generic or name == "resume"}


def form_inputs(verb, data) -> dict:
    """The verb's declared inputs as the page's form posted them (a box: ticked or not)."""
    inputs = {}
    for spec in verb.inputs:
        if spec.is_flag:
            inputs[spec.name] = data.get(spec.name, "") in ("1", "on", "true")
        elif spec.name in data:
            value = data.get(spec.name, "").strip()[:spec.max_length]
            if spec.kind is int and value.lstrip("-").isdigit():
                value = int(value)
            inputs[spec.name] = value
    return inputs


@require_POST
@viewer_required
def task_control(request, task_id: int):
    require_operator(request)
    task = get_task(task_id)
    action = request.POST.get("action", "")
    verb = page_verbs().get(action)
    if verb is None:
        return HttpResponseBadRequest(f"Unknown action {action!r}; use one of: {', '.join(page_verbs())}.")
    back = request.POST.get("next") or ""
    if not url_has_allowed_host_and_scheme(back, allowed_hosts={request.get_host()},
                                           require_https=request.is_secure()):
        back = reverse("task_detail", kwargs={"task_id": task.pk})
    try:
        result = services.task_verb(name=verb.name, task_id=task.pk, inputs=form_inputs(verb, request.POST),
                                    actor=request.user, ip=client_ip(request))
    except compat.IncompatibleResume as exc:
        messages.error(request, f"Not resumed: {exc}")
        if exc.policy == "ask" and task.status == TaskStatus.PAUSED:
            # The resume preview shows what changed, with the box to accept it.
            return redirect(reverse("task_edit", kwargs={"task_id": task.pk}) + "?resume=1")
    except services.InvalidInput as exc:
        messages.error(request, " ".join(e.message for e in exc.errors))
    except states.InvalidTransition as exc:
        messages.error(request, str(exc))
    except Task.DoesNotExist:
        raise Http404(f"There is no task #{task_id}.") from None
    else:
        task = result if isinstance(result, Task) else get_task(task.pk)
        template = verb.done if task.status == verb.target or not verb.requested else verb.requested
        messages.success(request, (template or f"{verb.label}: done for task #{{id}}.").format(id=task.pk))
    return redirect(back)


@require_POST
@viewer_required
def task_skip_step(request, task_id: int):
    """Skip one unfinished step of a task that needs a human (reason required), and go on."""
    require_operator(request)
    task = get_task(task_id)
    step_id = request.POST.get("step_id", "")
    try:
        skipped = services.task_verb(name="skip_step", task_id=task.pk, inputs=form_inputs(verbs.get("skip_step"),
                                                                                          request.POST),
                                     actor=request.user, ip=client_ip(request))
    except (services.InvalidInput, states.InvalidTransition) as exc:
        messages.error(request, f"Not skipped: {exc}")
    else:
        also = f" (and {len(skipped) - 1} step(s) that depend on it)" if len(skipped) > 1 else ""
        messages.success(request, f"Task #{task.pk}: step {step_id} skipped{also}; the task continues.")
    return redirect("task_detail", task_id=task.pk)


@require_POST
@viewer_required
def task_send_event(request, task_id: int):
    """The task page's "send an event" form: an event into the task's inbox (engine/inbox.py)."""
    require_operator(request)
    task = get_task(task_id)
    back = reverse("task_detail", kwargs={"task_id": task.pk}) + "#task-inbox"
    type_name = request.POST.get("type", "").strip()
    raw = request.POST.get("payload", "").strip()
    text = request.POST.get("text", "").strip()
    try:
        payload = jsonlimits.loads(raw) if raw else ({"text": text} if text else {})
    except jsonlimits.Unreadable as exc:
        messages.error(request, f"Not sent: {exc}.")
        return redirect(back)
    except json.JSONDecodeError as exc:
        messages.error(request, f"Not sent: the payload is not JSON ({exc.msg} at character {exc.pos}).")
        return redirect(back)
    if not isinstance(payload, dict):
        messages.error(request, "Not sent: the payload must be a JSON object, e.g. {\"text\": \"...\"}.")
        return redirect(back)
    try:
        sent = inbox.send(task_id=task.pk, type=type_name, payload=payload, priority=request.POST.get("priority") or None,
                          source="operator", actor=request.user, ip=client_ip(request),
                          source_event_id=request.POST.get("source_event_id", ""))
    except inbox.InboxRefused as exc:
        messages.error(request, f"Not sent: {exc}")
    else:
        event = sent.event
        messages.success(request, f"Event #{event.seq} ({event.type}) was sent already." if sent.duplicate else
                         f"Event #{event.seq} ({event.type}, P{event.priority}) sent: the task applies it at its next "
                         f"resume point.")
    return redirect(back)
