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
from .engine import actions as task_actions, revisions, services, states
from .models import Snapshot, Task, TaskStatus
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


def _display(widget: str, value):
    """A value as its generated field shows it."""
    if value is None:
        return "" if widget != "checkbox" else False
    if widget == "checkbox":
        return bool(value)
    if widget == "lines":
        return "\n".join(str(v) for v in value)
    if widget == "json":
        return json.dumps(value, indent=2)
    return str(value)


def _initial(widget: str, prop: dict):
    return _display(widget, prop.get("default"))


def prefill(fields: list[dict], values: dict) -> list[dict]:
    """Show `values` (e.g. a task's current params) in the generated fields."""
    for field in fields:
        if field["key"] in values:
            field["value"] = _display(field["widget"], values[field["key"]])
    return fields


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


def read_form(type_name: str, fields: list[dict], limits: list[dict], data) -> tuple[dict, dict, list]:
    """(params, limits, errors) from a posted generated form: the params checked against
    the type's schema (defaults filled in), the limits as given (checked, not filled in).
    Params and limits are checked separately so that every error shows at once; errors
    local to a field (bad JSON) are on the field itself."""
    params, limit_values = {}, {}
    for field in fields:
        present, value = read_field(field, data)
        if present:
            params[field["key"]] = value
    for field in limits:
        present, value = read_field(field, data)
        if present:
            limit_values[field["key"]] = value
    errors = []
    try:
        params = services.validate_params(type_name, params)
    except services.InvalidInput as exc:
        errors.extend(exc.errors)
    try:
        services.validate_limits(limit_values)
    except services.InvalidInput as exc:
        errors.extend(exc.errors)
    return params, limit_values, errors


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


# --- the task page ------------------------------------------------------------------------

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
    actions = task_actions.available(task, request.user)
    skippable = task_actions.skippable_steps(task) if actions["skip_step"].allowed else []
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
        "snapshots": snapshot_history(list(task.snapshots.order_by("-version"))),
        "events": events,
        "audit": audit,
        "actions": actions,
        "controls_note": task_actions.controls_note(task, actions),
        "skippable_steps": skippable,
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


@require_POST
@viewer_required
def task_skip_step(request, task_id: int):
    """Skip one unfinished step of a task that needs a human (reason required), and go on."""
    require_operator(request)
    task = get_task(task_id)
    step_id, reason = request.POST.get("step_id", ""), request.POST.get("reason", "").strip()[:500]
    try:
        skipped = services.task_skip_step(task_id=task.pk, step_id=step_id, reason=reason, actor=request.user,
                                          ip=client_ip(request))
    except (services.InvalidInput, states.InvalidTransition) as exc:
        messages.error(request, f"Not skipped: {exc}")
    else:
        also = f" (and {len(skipped) - 1} step(s) that depend on it)" if len(skipped) > 1 else ""
        messages.success(request, f"Task #{task.pk}: step {step_id} skipped{also}; the task continues.")
    return redirect("task_detail", task_id=task.pk)


# --- snapshots: what changed between kept versions -----------------------------------------

CHANGES_SHOWN = 12  # per version; the rest is counted


def _short(value) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= 60 else text[:57] + "…"


def state_changes(old: dict, new: dict) -> list[str]:
    """What changed from one snapshot state to the next: params, limits, the task status,
    and each step's status ("batch-0003: pending → done"), in plan order."""
    changes = []
    for label, key in (("param", "params"), ("limit", "limits")):
        before, after = old.get(key) or {}, new.get(key) or {}
        for name in sorted(set(before) | set(after)):
            if before.get(name) != after.get(name):
                changes.append(f"{label} {name}: {_short(before.get(name))} → {_short(after.get(name))}")
    if old.get("status") and new.get("status") and old["status"] != new["status"]:
        changes.append(f"status: {old['status']} → {new['status']}")
    before, after = old.get("steps") or {}, new.get("steps") or {}
    gens_before, gens_after = old.get("generations") or {}, new.get("generations") or {}
    for step_id, status in after.items():
        if step_id not in before:
            changes.append(f"{step_id}: added ({status})")
            continue
        text = f"{step_id}: {before[step_id]} → {status}" if before[step_id] != status else ""
        generation = gens_after.get(step_id, 0)
        if generation != gens_before.get(step_id, 0):
            text = (text or f"{step_id}: {status}") + f" (re-run, generation {generation})"
        if text:
            changes.append(text)
    changes.extend(f"{step_id}: removed" for step_id in before if step_id not in after)
    return changes


def snapshot_history(snapshots: list[Snapshot]) -> list[dict]:
    """The kept snapshot versions, newest first, each with what changed from the previous
    kept version (the oldest kept one has nothing to compare with)."""
    ordered = sorted(snapshots, key=lambda snap: snap.version)
    rows, previous = [], None
    for snap in ordered:
        state = snap.state if isinstance(snap.state, dict) else {}
        row = {"snapshot": snap, "version": snap.version, "step_id": snap.step_id, "created_at": snap.created_at,
               "previous": previous.version if previous else None, "changes": [], "more": 0, "note": ""}
        if previous is None:
            steps = state.get("steps") or {}
            row["note"] = (f"first version: a plan of {len(steps)} step{'s' if len(steps) != 1 else ''}"
                           if snap.version == 1 else "oldest kept version (earlier ones were pruned)")
        else:
            changes = state_changes(previous.state if isinstance(previous.state, dict) else {}, state)
            row["changes"], row["more"] = changes[:CHANGES_SHOWN], max(0, len(changes) - CHANGES_SHOWN)
            if not changes:
                row["note"] = "no change"
        rows.append(row)
        previous = snap
    rows.reverse()
    return rows


# --- edit params & resume, roll back to a snapshot -----------------------------------------

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
        "diff": [(key, _json(old), _json(new)) for key, (old, new) in preview.param_diff.items()],
        "changed_limits": changed_limits,
        "lists": _step_lists(preview, ("kept", "rerun", "removed", "pending")),
        "limit_warning": _limit_warning(task, preview, limit_values),
        "params_json": _json(params),
        "limits_json": _json(limit_values),
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
    task_type = _task_types()[task.type]
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
        params = services.validate_params(task.type, params)
        services.validate_limits(limit_values)
    except services.InvalidInput as exc:
        context = _edit_form_context(task, task_type, params)
        prefill(context["limit_fields"], limit_values)
        context["general_errors"] = attach_errors(exc.errors, context["fields"] + context["limit_fields"])
        return render(request, "orchestrator/task_edit.html", context, status=422)
    try:
        preview = revisions.apply_edit(task_id=task.pk, new_params=params, expected_version=expected_version,
                                       limits=limit_values or None, repeat_effects=request.POST.getlist("repeat_effects"),
                                       actor=request.user, ip=client_ip(request))
    except (revisions.RepeatNotConfirmed, services.InvalidInput) as exc:
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
        "diff": [(key, _json(old), _json(new)) for key, (old, new) in preview.param_diff.items()],
        "lists": _step_lists(preview, ("kept", "rerun", "pending")),
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
                                           actor=request.user, ip=client_ip(request))
    except (revisions.RepeatNotConfirmed, services.InvalidInput) as exc:
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
