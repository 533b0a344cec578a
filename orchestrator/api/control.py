"""The operator's controls on a task: the verbs of engine/verbs.py (pause, stop,
force-terminate, skip a step, and any verb registered later) through one route, and the two
with previews of their own: resume (with an optional params edit and its dry-run preview) and
roll back to a snapshot."""
import copy

from ninja import Path, Router
from ninja.errors import HttpError

from .. import roles
from ..engine import revisions, services, verbs
from ..primitives import jsonlimits
from .auth import require
from .common import BODY, FOUND, client_ip, get_task, id_param, optional_object_body, responses
from .errors import NotFound
from .presenters import task_out
from .schemas import ErrorOut, ResumeIn, RevisionOut, RollbackIn, TaskOut

router = Router(tags=["control"])


CONTROL_RESPONSES = responses({200: TaskOut}, FOUND, BODY, {409: ErrorOut})

# The operator verbs that take plain inputs (engine/verbs.py: pause, stop, terminate, skip a
# step, and any verb registered later) share one route, mounted after every other router (its
# path would shadow theirs); the OpenAPI schema lists each verb as a path of its own, with its
# inputs as the body (OrchestratorAPI.get_openapi_schema).
verbs_router = Router(tags=["control"])
VERB_PATH = "/tasks/{task_id}/{verb}"


def read_body(request) -> dict:
    """The request's JSON object (empty or null: {}); unreadable JSON is a 400, as ninja says it."""
    raw = request.body.strip()
    if not raw:
        return {}
    try:
        value = jsonlimits.loads(raw)
    except ValueError as exc:  # not JSON, not UTF-8, nested too deep or holding NUL (jsonlimits.Unreadable)
        raise HttpError(400, "Cannot parse request body") from exc
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise services.InvalidInput([services.FieldError("body", "must be a JSON object (or empty)")])
    return value


@verbs_router.post(VERB_PATH, response=CONTROL_RESPONSES, include_in_schema=True)
def task_verb(request, task_id: int = id_param("a task id"),
              verb: str = Path(..., max_length=60, description="an operator verb: pause, stop, terminate, skip-step, ...")):
    """Do an operator verb on a task (engine/verbs.py), with its inputs as the JSON body."""
    found = verbs.by_word(verb)
    if found is None or not found.generic:
        raise NotFound(f"There is no action {verb!r} on a task; the actions are "
                       f"{', '.join(v.word for v in verbs.generic())} (and resume, rollback).")
    body = read_body(request)
    require(request, found.role)
    get_task(task_id)
    services.task_verb(name=found.name, task_id=task_id, inputs=body, actor=request.auth, ip=client_ip(request))
    return task_out(get_task(task_id), request.auth)


def verb_operations(schema: dict, prefix: str) -> None:
    """In the OpenAPI `schema`: the one verb route becomes a path per generic verb, each with
    its own operation id (`orchestrator_api_<name>_task`), summary and body (its inputs)."""
    template = schema["paths"].pop(prefix + VERB_PATH, {}).get("post")
    if template is None:
        return
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for verb in verbs.generic():
        operation = copy.deepcopy(template)
        operation["operationId"] = "orchestrator_api_" + verb.api_operation
        operation["summary"] = verb.label
        operation["description"] = verb.description
        operation["parameters"] = [p for p in operation.get("parameters", []) if p.get("name") != "verb"]
        model = verb.input_model()
        components[model.__name__] = model.model_json_schema(ref_template="#/components/schemas/{model}")
        body = {"$ref": f"#/components/schemas/{model.__name__}"}
        required = any(i.required for i in verb.inputs)
        if not required:  # an optional body may be empty or null (read_body)
            body = {"anyOf": [body, {"type": "null"}]}
        operation["requestBody"] = {"content": {"application/json": {"schema": body}}, "required": required}
        schema["paths"][prefix + VERB_PATH.replace("{verb}", verb.word)] = {"post": operation}


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
