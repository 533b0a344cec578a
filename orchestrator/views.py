"""Server-rendered pages: the task list, the create form, the task page and its controls.

Thin, like the API: views read through selectors, write through engine.services, and
check roles (orchestrator.roles). Every page needs a logged-in user with a role.
"""
import json
from functools import wraps
from urllib.parse import urlencode

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpResponseBadRequest
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils import timezone
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from . import roles, selectors
from .engine import services, states
from .models import Task, TaskStatus
from .tasktypes import all_types

STEP_ROWS_SHOWN = 2000
WAL_ROWS_SHOWN = 500
EVENTS_SHOWN = 200
LIMIT_FIELDS = [
    ("max_steps", "Max steps", "integer", "Pause after this many steps"),
    ("max_tokens", "Max tokens", "integer", "Pause once this many LLM tokens are used"),
    ("max_seconds", "Max seconds", "number", "Pause after this much active run time"),
    ("max_subtasks", "Max subtasks", "integer", "How many subtasks may run at once (1–64)"),
]
TEXTAREA_MIN_LENGTH = 300  # strings allowed to be longer than this get a textarea


# --- access -------------------------------------------------------------------------------

def _once(count):
    """A template value computed on first use only (templates call callables), so pages
    that do not show the nav (the admin, JSON) do not pay for its COUNT queries."""
    cache = []

    def value():
        if not cache:
            cache.append(count())
        return cache[0]
    return value


def nav_context(request):
    """Context processor: the user's roles for the navigation and the buttons, and the
    counts behind the nav badges (open review items, tasks that need a human)."""
    user = getattr(request, "user", None)
    user_roles = roles.user_roles(user) if user is not None else set()
    context = {
        "roles": user_roles,
        "can_operate": roles.OPERATOR in user_roles,
        "can_review": roles.REVIEWER in user_roles,
    }
    if getattr(user, "is_authenticated", False):
        from review.selectors import open_count

        context["open_reviews"] = _once(open_count)
        context["needs_human"] = _once(Task.objects.filter(status=TaskStatus.NEEDS_HUMAN).count)
    return context


def viewer_required(view):
    """Login first (redirect), then the viewer role (403)."""
    @wraps(view)
    def wrapped(request, *args, **kwargs):
        if not roles.has_role(request.user, roles.VIEWER):
            raise PermissionDenied("You have no role in the orchestrator; ask an administrator to add you "
                                   "to the 'viewer', 'operator' or 'reviewer' group.")
        return view(request, *args, **kwargs)
    return login_required(wrapped)


def require_operator(request) -> None:
    if not roles.has_role(request.user, roles.OPERATOR):
        raise PermissionDenied("This needs the operator role; ask an administrator to add you to the "
                               "'operator' group.")


def get_task(task_id: int) -> Task:
    try:
        return selectors.task_detail(task_id)
    except Task.DoesNotExist:
        raise Http404(f"There is no task #{task_id}.") from None


def client_ip(request) -> str | None:
    return request.META.get("REMOTE_ADDR") or None


def _task_types() -> dict:
    return all_types()


# --- the task list ------------------------------------------------------------------------

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
    types = _task_types()
    type_names = sorted(set(types) | ({type_name} if type_name else set()))
    for task in tasks:
        task.type_title = types[task.type].title if task.type in types else ""
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


# --- the create form, generated from the params JSON schema -------------------------------

def _resolve(schema: dict, defs: dict) -> dict:
    """Follow a $ref, and reduce `Optional[X]` (anyOf X|null) to X."""
    seen = 0
    while "$ref" in schema and seen < 10:
        ref = schema["$ref"].rsplit("/", 1)[-1]
        schema = {**defs.get(ref, {}), **{k: v for k, v in schema.items() if k != "$ref"}}
        seen += 1
    for key in ("anyOf", "oneOf"):
        options = schema.get(key)
        if options:
            non_null = [o for o in options if o.get("type") != "null"]
            if len(non_null) == 1:
                inner = _resolve(non_null[0], defs)
                merged = {**inner, **{k: v for k, v in schema.items() if k != key}}
                merged["nullable"] = len(non_null) != len(options)
                return merged
    return schema


def _widget(prop: dict) -> str:
    kind = prop.get("type")
    if "enum" in prop:
        return "select"
    if kind in ("integer", "number"):
        return "number"
    if kind == "boolean":
        return "checkbox"
    if kind == "array" and (prop.get("items") or {}).get("type", "string") == "string":
        return "lines"
    if kind == "string":
        if prop.get("format") == "textarea" or prop.get("widget") == "textarea":
            return "textarea"
        max_length = prop.get("maxLength")
        return "textarea" if max_length is not None and max_length > TEXTAREA_MIN_LENGTH else "text"
    return "json"


def _initial(widget: str, prop: dict):
    if "default" not in prop or prop["default"] is None:
        return "" if widget != "checkbox" else False
    default = prop["default"]
    if widget == "checkbox":
        return bool(default)
    if widget == "lines":
        return "\n".join(str(v) for v in default)
    if widget == "json":
        return json.dumps(default, indent=2)
    return str(default)


def _number_bound(prop: dict, inclusive: str, exclusive: str):
    if prop.get(inclusive) is not None:
        return prop[inclusive]
    if isinstance(prop.get(exclusive), (int, float)) and prop.get("type") == "integer":
        return prop[exclusive] + (1 if exclusive == "exclusiveMinimum" else -1)
    return None


def param_fields(schema: dict) -> list[dict]:
    """Form fields for a pydantic model's JSON schema, named `params.<key>`."""
    defs = schema.get("$defs", {})
    required = set(schema.get("required", []))
    fields = []
    for key, raw in (schema.get("properties") or {}).items():
        prop = _resolve(raw, defs)
        widget = _widget(prop)
        field = {
            "name": f"params.{key}",
            "key": key,
            "label": prop.get("title") or key.replace("_", " ").capitalize(),
            "help": prop.get("description", ""),
            "widget": widget,
            "type": prop.get("type", ""),
            "required": key in required,
            "value": _initial(widget, prop),
            "errors": [],
        }
        if widget == "number":
            field["min"] = _number_bound(prop, "minimum", "exclusiveMinimum")
            field["max"] = _number_bound(prop, "maximum", "exclusiveMaximum")
            field["step"] = "1" if prop.get("type") == "integer" else "any"
        elif widget == "select":
            field["choices"] = [str(c) for c in prop["enum"]]
        elif widget in ("text", "textarea"):
            field["maxlength"] = prop.get("maxLength")
        fields.append(field)
    return fields


def limit_fields() -> list[dict]:
    defaults = services.harness.default_limits
    schema = services.Limits.model_json_schema()
    fields = []
    for key, label, kind, help_text in LIMIT_FIELDS:
        prop = _resolve(schema["properties"].get(key, {}), {})
        fields.append({
            "name": f"limits.{key}", "key": key, "label": label, "help": help_text, "widget": "number",
            "type": kind, "required": False, "value": "", "errors": [],
            "placeholder": defaults.get(key, ""),
            "min": _number_bound(prop, "minimum", "exclusiveMinimum"),
            "max": _number_bound(prop, "maximum", "exclusiveMaximum"),
            "step": "1" if kind == "integer" else "any",
        })
    return fields


def _coerce_number(raw: str, kind: str):
    """The number the user typed, or the raw text so that validation names the problem."""
    try:
        if kind == "integer":
            return int(raw)
        return float(raw)
    except ValueError:
        return raw


def read_field(field: dict, data) -> tuple[bool, object]:
    """(present, value) of one generated field in POST data; keeps the raw input on the field."""
    widget, name = field["widget"], field["name"]
    if widget == "checkbox":
        field["value"] = name in data
        return True, field["value"]
    raw = data.get(name, "")
    field["value"] = raw
    if widget == "lines":
        items = [line.strip() for line in raw.splitlines() if line.strip()]
        return (bool(items) or field["required"]), items
    if raw.strip() == "":
        return False, None
    if widget == "number":
        return True, _coerce_number(raw.strip(), field["type"])
    if widget == "json":
        try:
            return True, json.loads(raw)
        except ValueError as exc:
            field["errors"].append(f"Not valid JSON: {exc}")
            return False, None
    return True, raw


def attach_errors(errors: list, fields: list[dict]) -> list[str]:
    """Put each field error next to its field; return the ones that match no field."""
    by_name = {f["name"]: f for f in fields}
    general = []
    for error in errors:
        parts = error.field.split(".")
        target = by_name.get(".".join(parts[:2]))
        if target is None:
            general.append(f"{error.field}: {error.message}" if error.field else error.message)
        else:
            detail = f" (item {int(parts[2]) + 1})" if len(parts) > 2 and parts[2].isdigit() else ""
            target["errors"].append(error.message + detail)
    return general


@require_http_methods(["GET", "POST"])
@viewer_required
def task_new(request):
    require_operator(request)
    types = _task_types()
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

    params, limit_values = {}, {}
    for field in fields:
        present, value = read_field(field, request.POST)
        if present:
            params[field["key"]] = value
    for field in limits:
        present, value = read_field(field, request.POST)
        if present:
            limit_values[field["key"]] = value
    title = request.POST.get("title", "").strip()
    context["title"] = title

    # Check params and limits separately first, so that every error shows at once
    # (task_create stops at the first group that fails).
    errors = []
    for check, value in ((lambda v: services.validate_params(type_name, v), params),
                         (services.validate_limits, limit_values)):
        try:
            check(value)
        except services.InvalidInput as exc:
            errors.extend(exc.errors)
    local_errors = any(f["errors"] for f in fields + limits)
    if not errors and not local_errors:
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


# --- the task page ------------------------------------------------------------------------

def control_actions(task: Task) -> dict:
    """Which control buttons make sense in the task's current state."""
    status = task.status
    return {
        "pause": status in (TaskStatus.RUNNING, TaskStatus.QUEUED) and task.control != "pause",
        "resume": status in (TaskStatus.PAUSED, TaskStatus.NEEDS_HUMAN),
        "stop": states.can_transition(status, TaskStatus.STOPPED) and status != TaskStatus.STOPPING,
        "terminate": states.can_transition(status, TaskStatus.TERMINATED),
    }


def _json(value, indent=None) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=False, sort_keys=indent is not None, default=str)


@require_GET
@viewer_required
def task_detail(request, task_id: int):
    task = get_task(task_id)
    now = timezone.now()
    steps_total = task.steps.count()
    steps = list(task.steps.all()[:STEP_ROWS_SHOWN])
    wal_total = task.wal_entries.count()
    wal = list(task.wal_entries.order_by("-id")[:WAL_ROWS_SHOWN])
    events = list(task.events.order_by("-seq")[:EVENTS_SHOWN])
    for event in events:
        event.payload_json = _json(event.payload)
    for entry in wal:
        entry.args_json = _json(entry.args)
    audit = list(task.audit_entries.select_related("actor").all()[:500])
    actions = control_actions(task)
    heartbeat_age = (now - task.heartbeat_at).total_seconds() if task.heartbeat_at else None
    try:
        type_title = _task_types()[task.type].title
    except KeyError:
        type_title = ""
    return render(request, "orchestrator/task_detail.html", {
        "task": task,
        "type_title": type_title,
        "params_json": _json(task.params, indent=2),
        "limits": sorted(task.limits.items()) if isinstance(task.limits, dict) else [],
        "heartbeat_age": heartbeat_age,
        "steps": steps,
        "steps_total": steps_total,
        "wal": wal,
        "wal_total": wal_total,
        "snapshots": list(task.snapshots.all()),
        "events": events,
        "audit": audit,
        "actions": actions,
        "has_actions": any(actions.values()),
        "is_terminal": task.status in states.TERMINAL,
    })


CONTROL_SERVICES = {
    "pause": (services.task_pause, "Pause requested for task #{id}.", "Task #{id} paused."),
    "stop": (services.task_stop, "Stop requested for task #{id}.", "Task #{id} stopped."),
    "terminate": (services.task_terminate, "Force-terminate requested for task #{id}.", "Task #{id} terminated."),
    "resume": (services.task_resume, "Task #{id} resumed.", "Task #{id} resumed."),
}


@require_POST
@viewer_required
def task_control(request, task_id: int):
    require_operator(request)
    task = get_task(task_id)
    action = request.POST.get("action", "")
    if action not in CONTROL_SERVICES:
        return HttpResponseBadRequest(f"Unknown action {action!r}; use one of: {', '.join(CONTROL_SERVICES)}.")
    reason = request.POST.get("reason", "").strip()[:500]
    back = request.POST.get("next") or ""
    if not url_has_allowed_host_and_scheme(back, allowed_hosts={request.get_host()},
                                           require_https=request.is_secure()):
        back = reverse("task_detail", kwargs={"task_id": task.pk})
    if action == "terminate" and not reason:
        messages.error(request, "Force-terminate needs a reason.")
        return redirect(back)

    service, requested, settled = CONTROL_SERVICES[action]
    try:
        task = service(task_id=task.pk, actor=request.user, ip=client_ip(request), reason=reason)
    except states.InvalidTransition as exc:
        messages.error(request, str(exc))
    except Task.DoesNotExist:
        raise Http404(f"There is no task #{task_id}.") from None
    else:
        final = {"pause": TaskStatus.PAUSED, "stop": TaskStatus.STOPPED,
                 "terminate": TaskStatus.TERMINATED, "resume": None}[action]
        template = settled if final is None or task.status == final else requested
        messages.success(request, template.format(id=task.pk))
    return redirect(back)
