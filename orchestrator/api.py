"""The HTTP API (django-ninja; OpenAPI at /api/openapi.json). Thin: it parses input,
checks the role and calls the engine's services; JSON in and out."""
import json
from datetime import datetime
from typing import Any, Literal

from django.conf import settings
from django.core.exceptions import RequestDataTooBig, SuspiciousOperation
from django.core.serializers.json import DjangoJSONEncoder

from django.http import HttpRequest
from ninja import Field, NinjaAPI, Path, Query, Schema, Status
from ninja.errors import AuthenticationError, HttpError, ValidationError as NinjaValidationError
from ninja.security import HttpBearer, SessionAuth
from ninja.utils import check_csrf

from . import roles, selectors
from .auth import TokenRejected, token_authenticate
from .engine import actions as task_actions, revisions, services
from .engine.states import InvalidTransition
from .models import AuditEntry, Snapshot, Task, TaskEvent, TaskStatus, WalEntry
from .tasktypes import all_types
from review import selectors as review_selectors, services as review_services
from review.models import Decision, ReviewItem, ReviewStatus


class NotAuthenticated(Exception):
    """401: no credentials, or a bearer token that authenticates nobody (the message says why)."""


class CsrfFailed(Exception):
    pass


class BearerAuth(HttpBearer):
    """`Authorization: Bearer <token>`. A request that sends a bearer token is judged by it
    alone: a bad or expired one is a 401 saying so (never a fall-back to the session and its
    CSRF check)."""

    def authenticate(self, request, token):
        try:
            user = token_authenticate(token)
        except TokenRejected as exc:
            raise NotAuthenticated(str(exc)) from None
        request.user = user
        return user


class LoggedInSession(SessionAuth):
    """The browser's login session; its unsafe requests (POST) need the CSRF token. A request
    without a logged-in session is not checked for CSRF: it is simply not authenticated."""

    def __call__(self, request):
        if not request.user.is_authenticated:
            return None
        if request.method not in ("GET", "HEAD", "OPTIONS", "TRACE") and check_csrf(request):
            raise CsrfFailed("CSRF check failed: a request with the login session cookie must send the "
                             "X-CSRFToken header (the csrftoken cookie's value); scripts should use "
                             "'Authorization: Bearer <token>' instead.")
        return request.user


api = NinjaAPI(title="Orchestrator API", version="1", auth=[BearerAuth(), LoggedInSession()],
               urls_namespace="api")

# The largest id/seq the database stores (signed 64-bit); a bigger one is a 422, not a 500.
MAX_ID = 2**63 - 1


# --- errors --------------------------------------------------------------------------------

class FieldErrorOut(Schema):
    field: str
    message: str


class ErrorOut(Schema):
    detail: str
    errors: list[FieldErrorOut] = []


class Forbidden(Exception):
    pass


class NotFound(Exception):
    pass


@api.exception_handler(services.InvalidInput)
def on_invalid_input(request, exc: services.InvalidInput):
    return api.create_response(request, {"detail": "Invalid input: " + str(exc),
                                         "errors": [e.__dict__ for e in exc.errors]}, status=422)


@api.exception_handler(NinjaValidationError)
def on_schema_error(request, exc: NinjaValidationError):
    errors = [{"field": ".".join(str(p) for p in err.get("loc", ())[1:] or err.get("loc", ())),
               "message": err.get("msg", "invalid")} for err in exc.errors]
    return api.create_response(request, {"detail": "Invalid input: " + "; ".join(
        f"{e['field']}: {e['message']}" for e in errors), "errors": errors}, status=422)


@api.exception_handler(NotAuthenticated)
def on_not_authenticated(request, exc: NotAuthenticated):
    response = api.create_response(request, {"detail": str(exc), "errors": []}, status=401)
    response["WWW-Authenticate"] = 'Bearer error="invalid_token"'
    return response


@api.exception_handler(AuthenticationError)
def on_no_credentials(request, exc: AuthenticationError):
    response = api.create_response(request, {
        "detail": "Authentication required: send 'Authorization: Bearer <token>' (create one with "
                  "`manage.py apitoken USERNAME`) or log in at /accounts/login/.", "errors": []}, status=401)
    response["WWW-Authenticate"] = "Bearer"
    return response


@api.exception_handler(CsrfFailed)
def on_csrf_failed(request, exc: CsrfFailed):
    return api.create_response(request, {"detail": str(exc), "errors": []}, status=403)


@api.exception_handler(RequestDataTooBig)
def on_request_too_big(request, exc: RequestDataTooBig):
    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    return api.create_response(request, {
        "detail": f"Request body too large: the limit is {limit} bytes ({limit / 1048576:.1f} MiB, "
                  "setting ORCH_MAX_REQUEST_BYTES). Send less data per request.", "errors": []}, status=413)


@api.exception_handler(SuspiciousOperation)
def on_suspicious(request, exc: SuspiciousOperation):
    return api.create_response(request, {"detail": f"Bad request: {exc}", "errors": []}, status=400)


@api.exception_handler(HttpError)
def on_http_error(request, exc: HttpError):
    detail = str(exc)
    if exc.status_code == 400 and detail.startswith("Cannot parse request body"):
        detail = "Cannot parse the request body: send valid JSON with 'Content-Type: application/json'."
    return api.create_response(request, {"detail": detail, "errors": []}, status=exc.status_code)


@api.exception_handler(InvalidTransition)
def on_invalid_transition(request, exc: InvalidTransition):
    return api.create_response(request, {"detail": str(exc), "errors": []}, status=409)


@api.exception_handler(Forbidden)
def on_forbidden(request, exc: Forbidden):
    return api.create_response(request, {"detail": str(exc), "errors": []}, status=403)


@api.exception_handler(NotFound)
def on_not_found(request, exc: NotFound):
    return api.create_response(request, {"detail": str(exc), "errors": []}, status=404)


def require(request: HttpRequest, role: str) -> None:
    if not roles.has_role(request.auth, role):
        raise Forbidden(f"This needs the {role} role; ask an administrator to add you to the '{role}' group.")


def get_task(task_id: int) -> Task:
    try:
        return selectors.task_detail(task_id)
    except Task.DoesNotExist:
        raise NotFound(f"There is no task #{task_id}.") from None


def client_ip(request) -> str | None:
    return request.META.get("REMOTE_ADDR")


# --- schemas -------------------------------------------------------------------------------

class TaskTypeOut(Schema):
    name: str
    title: str
    description: str
    params_schema: dict


def _enum(values):
    """Enumerate `values()` in the OpenAPI schema (read when the schema is built); the
    services still validate the value, with a message naming the valid ones."""
    return lambda schema: schema.update(enum=sorted(values()))


def task_type_names():
    return list(all_types())


class TaskCreateIn(Schema):
    type: str = Field(..., description="a task type (GET /api/task-types)", json_schema_extra=_enum(task_type_names))
    params: dict[str, Any] = {}
    limits: dict[str, Any] | None = None
    title: str = ""


class WorkerOut(Schema):
    host: str
    pid: int | None


class StepOut(Schema):
    id: str
    title: str
    status: str
    depends_on: list[str]
    reads: list[str]
    attempts: int
    started_at: datetime | None
    finished_at: datetime | None
    duration_seconds: float | None
    error: str
    result: Any = None


class TaskSummaryOut(Schema):
    id: int
    type: str
    title: str
    status: str
    status_reason: str
    steps_done: int
    steps_total: int
    progress_percent: int
    created_at: datetime
    updated_at: datetime


class ActionOut(Schema):
    name: Literal[task_actions.NAMES] = Field(..., description="an action on the task: " + ", ".join(task_actions.NAMES))
    allowed: bool = Field(..., description="whether you may take it now")
    reason: str = Field(..., description="why not (empty when allowed)")


class TaskOut(TaskSummaryOut):
    params: dict
    limits: dict
    counters: dict
    checkpoint_version: int
    event_seq: int
    heartbeat_at: datetime | None
    worker: WorkerOut | None
    error: str
    started_at: datetime | None
    finished_at: datetime | None
    control: str
    control_requested_at: datetime | None
    control_acknowledged_at: datetime | None
    activities: list[dict]
    paused_by_limit: str = Field(..., description="the limit that paused the task (raise it to resume), or empty")
    actions: list[ActionOut] = Field(..., description="what the caller may do to the task now, and why not")
    steps: list[StepOut]


class TaskPageOut(Schema):
    items: list[TaskSummaryOut]
    next_before: int | None


class WalOut(Schema):
    id: int
    step_id: str
    call_index: int
    tool: str
    args: Any
    idempotency_key: str
    idempotent: bool
    status: str
    result: Any
    error: str
    lease_epoch: int
    worker: str
    created_at: datetime
    completed_at: datetime | None


class SnapshotOut(Schema):
    version: int
    step_id: str
    state: dict
    created_at: datetime


class EventOut(Schema):
    seq: int
    kind: str
    payload: dict
    created_at: datetime


class AuditOut(Schema):
    id: int
    at: datetime
    actor: str
    ip: str | None
    action: str
    before: Any
    after: Any
    reason: str


class ControlIn(Schema):
    reason: str = ""


def task_out(task: Task, user=None) -> dict:
    """The task as the API shows it to `user` (None: the system, e.g. the CLI)."""
    steps = [StepOut(id=s.step_id, title=s.title, status=s.status, depends_on=s.depends_on, reads=s.reads,
                     attempts=s.attempts, started_at=s.started_at, finished_at=s.finished_at,
                     duration_seconds=s.duration_seconds, error=s.error, result=s.result)
             for s in task.steps.all()]
    running = task.status in ("running", "pausing", "stopping") and task.lease_owner
    return TaskOut(
        id=task.pk, type=task.type, title=task.title, status=task.status, status_reason=task.status_reason,
        steps_done=task.steps_done, steps_total=task.steps_total, progress_percent=task.progress_percent,
        created_at=task.created_at, updated_at=task.updated_at, params=task.params, limits=task.limits,
        counters={"steps_done": task.steps_done, "steps_total": task.steps_total, "tokens_used": task.tokens_used,
                  "active_seconds": round(task.active_seconds, 3), "recovery_attempts": task.recovery_attempts},
        checkpoint_version=task.checkpoint_version, event_seq=task.event_seq, heartbeat_at=task.heartbeat_at,
        worker=WorkerOut(host=task.worker_host, pid=task.worker_pid) if running else None, error=task.error,
        started_at=task.started_at, finished_at=task.finished_at, control=task.control,
        control_requested_at=task.control_requested_at, control_acknowledged_at=task.control_acknowledged_at,
        activities=task.activities, paused_by_limit=task.paused_by_limit,
        actions=task_actions.as_list(task_actions.available(task, user)), steps=steps)


# Every status an endpoint can answer is declared (schemathesis checks that).
AUTH = {401: ErrorOut, 403: ErrorOut}           # no/bad credentials, missing role or CSRF
PARAMS = {422: ErrorOut}                        # a query or path parameter is invalid
FOUND = {404: ErrorOut, **PARAMS}               # an id in the path
BODY = {400: ErrorOut, 413: ErrorOut, 422: ErrorOut}  # unreadable JSON, too large, invalid


def responses(ok: dict, *parts: dict) -> dict:
    merged = {**ok, **AUTH}
    for part in parts:
        merged.update(part)
    return merged


def id_param(what: str):
    return Path(..., ge=1, le=MAX_ID, description=what)


# --- endpoints -----------------------------------------------------------------------------

@api.get("/task-types", response=responses({200: list[TaskTypeOut]}), tags=["tasks"])
def list_task_types(request):
    require(request, roles.VIEWER)
    return [TaskTypeOut(name=t.name, title=t.title, description=t.description, params_schema=t.params_schema())
            for t in all_types().values()]


@api.post("/tasks", response=responses({201: TaskOut}, BODY), tags=["tasks"])
def create_task(request, body: TaskCreateIn):
    require(request, roles.OPERATOR)
    task = services.task_create(type=body.type, params=body.params, limits=body.limits, title=body.title,
                                actor=request.auth, ip=client_ip(request))
    return Status(201, task_out(task, request.auth))


@api.get("/tasks", response=responses({200: TaskPageOut}, PARAMS), tags=["tasks"])
def list_tasks(request, status: str = Query("", description="comma-separated statuses: "
                                         + ", ".join(TaskStatus.values)),
               type: str = Query("", description="a task type"), q: str = "",
               before: int | None = Query(None, ge=1, le=MAX_ID, description="the `next_before` of the previous page"),
               limit: int = Query(50, ge=1, le=MAX_ID, description="page size (at most 500 are returned)")):
    require(request, roles.VIEWER)
    rows, next_before = selectors.task_page(selectors.task_list(status=status, type=type, text=q), before=before,
                                            limit=max(1, min(limit, 500)))
    return TaskPageOut(items=[TaskSummaryOut(
        id=t.pk, type=t.type, title=t.title, status=t.status, status_reason=t.status_reason,
        steps_done=t.steps_done, steps_total=t.steps_total, progress_percent=t.progress_percent,
        created_at=t.created_at, updated_at=t.updated_at) for t in rows], next_before=next_before)


@api.get("/tasks/{task_id}", response=responses({200: TaskOut}, FOUND), tags=["tasks"])
def task_detail(request, task_id: int = id_param("a task id")):
    require(request, roles.VIEWER)
    return task_out(get_task(task_id), request.auth)


def optional_object_body(request) -> None:
    """An optional body must be a JSON object (or absent / null): ninja reads any other JSON
    value (a list, a number) as "no body", which would accept e.g. `[1]` as a plain request."""
    raw = request.body.strip()
    if raw and not isinstance(json.loads(raw), (dict, type(None))):
        raise services.InvalidInput([services.FieldError("body", "must be a JSON object (or empty)")])


def _control(request, task_id: int, action, body: ControlIn | None):
    optional_object_body(request)
    require(request, roles.OPERATOR)
    get_task(task_id)
    action(task_id=task_id, actor=request.auth, ip=client_ip(request), reason=body.reason if body else "")
    return task_out(get_task(task_id), request.auth)


CONTROL_RESPONSES = responses({200: TaskOut}, FOUND, BODY, {409: ErrorOut})


@api.post("/tasks/{task_id}/pause", response=CONTROL_RESPONSES, tags=["control"])
def pause_task(request, task_id: int = id_param("a task id"), body: ControlIn | None = None):
    return _control(request, task_id, services.task_pause, body)


@api.post("/tasks/{task_id}/stop", response=CONTROL_RESPONSES, tags=["control"])
def stop_task(request, task_id: int = id_param("a task id"), body: ControlIn | None = None):
    return _control(request, task_id, services.task_stop, body)


@api.post("/tasks/{task_id}/terminate", response=CONTROL_RESPONSES, tags=["control"])
def terminate_task(request, task_id: int = id_param("a task id"), body: ControlIn | None = None):
    return _control(request, task_id, services.task_terminate, body)


class SkipStepIn(Schema):
    step_id: str = Field(..., min_length=1, max_length=200)
    reason: str = Field(..., min_length=1, max_length=500, description="Why the task can go on without the step")


@api.post("/tasks/{task_id}/skip-step", response=CONTROL_RESPONSES, tags=["control"])
def skip_step(request, body: SkipStepIn, task_id: int = id_param("a task id")):
    """Skip one unfinished step of a task that needs a human (with the dependants that need
    its result, unless they run after skipped steps) and continue the task. Audited."""
    require(request, roles.OPERATOR)
    get_task(task_id)
    services.task_skip_step(task_id=task_id, step_id=body.step_id, reason=body.reason, actor=request.auth,
                            ip=client_ip(request))
    return task_out(get_task(task_id), request.auth)


class ResumeIn(ControlIn):
    params: dict[str, Any] | None = None
    limits: dict[str, Any] | None = None
    dry_run: bool = False
    expected_version: int | None = None
    repeat_effects: list[str] | None = Field(None, description=(
        "Idempotency keys of the non-idempotent side effects the edit performs again (the "
        "preview's `must_confirm`), each confirmed explicitly; without them the edit is refused (409)."))


class PreviewOut(Schema):
    task_id: int
    version: int
    param_diff: dict
    kept: list[str]
    rerun: list[str]
    removed: list[str]
    pending: list[str]
    repeated_effects: list[dict]
    must_confirm: list[str]
    effects_after: list[dict]
    rollback_to: int | None


class RevisionOut(Schema):
    applied: bool
    preview: PreviewOut | None
    task: TaskOut


@api.post("/tasks/{task_id}/resume", response=responses({200: RevisionOut}, FOUND, BODY, {409: ErrorOut}),
          tags=["control"])
def resume_task(request, task_id: int = id_param("a task id"), body: ResumeIn | None = None):
    """Resume a paused task from its checkpoint. With `params`, the parameters are edited
    first: `dry_run: true` returns the impact preview (which finished steps are kept, which
    run again, which side effects that repeats) and changes nothing; applying it with the
    preview's `version` as `expected_version` is refused (409) if the task changed meanwhile,
    or if it would perform a non-idempotent effect again that `repeat_effects` does not
    confirm (the preview's `must_confirm`). `limits` raises limits (a task paused by a limit
    needs that)."""
    optional_object_body(request)
    require(request, roles.OPERATOR)
    task = get_task(task_id)
    body = body or ResumeIn()
    preview = None
    if body.params is not None:
        new_params = services.validate_params(task.type, body.params)
        if body.dry_run:
            preview = revisions.preview_edit(task, new_params, request.auth)[0]
        else:
            preview = revisions.apply_edit(task_id=task_id, new_params=new_params, expected_version=body.expected_version,
                                           limits=body.limits, repeat_effects=body.repeat_effects,
                                           actor=request.auth, ip=client_ip(request))
    elif body.dry_run:
        preview = revisions.preview_edit(task, task.params, request.auth)[0]
    else:
        services.task_resume(task_id=task_id, limits=body.limits, actor=request.auth, ip=client_ip(request),
                             reason=body.reason)
    return RevisionOut(applied=not body.dry_run, preview=preview.as_dict() if preview else None,
                       task=task_out(get_task(task_id), request.auth))


class RollbackIn(Schema):
    version: int
    dry_run: bool = False
    expected_version: int | None = None
    repeat_effects: list[str] | None = Field(None, description=(
        "Idempotency keys of the non-idempotent side effects the rollback performs again (the "
        "preview's `must_confirm`); without them the rollback is refused (409)."))


@api.post("/tasks/{task_id}/rollback", response=responses({200: RevisionOut}, FOUND, BODY, {409: ErrorOut}),
          tags=["control"])
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
                                           ip=client_ip(request))
    return RevisionOut(applied=not body.dry_run, preview=preview.as_dict(),
                       task=task_out(get_task(task_id), request.auth))


@api.get("/tasks/{task_id}/wal", response=responses({200: list[WalOut]}, FOUND), tags=["history"])
def task_wal(request, task_id: int = id_param("a task id")):
    require(request, roles.VIEWER)
    task = get_task(task_id)
    return list(WalEntry.objects.filter(task=task).order_by("id"))


@api.get("/tasks/{task_id}/snapshots", response=responses({200: list[SnapshotOut]}, FOUND), tags=["history"])
def task_snapshots(request, task_id: int = id_param("a task id")):
    require(request, roles.VIEWER)
    task = get_task(task_id)
    return list(Snapshot.objects.filter(task=task).order_by("-version"))


@api.get("/tasks/{task_id}/events", response=responses({200: list[EventOut]}, FOUND), tags=["history"])
def task_events(request, task_id: int = id_param("a task id"), after: int = Query(0, ge=0, le=MAX_ID),
                limit: int = Query(500, ge=1, le=MAX_ID, description="at most 5000 are returned")):
    """Events with seq > `after`, oldest first (resume from the last seq you saw)."""
    require(request, roles.VIEWER)
    task = get_task(task_id)
    return list(TaskEvent.objects.filter(task=task, seq__gt=after).order_by("seq")[:max(1, min(limit, 5000))])


@api.get("/tasks/{task_id}/audit", response=responses({200: list[AuditOut]}, FOUND), tags=["history"])
def task_audit(request, task_id: int = id_param("a task id")):
    require(request, roles.VIEWER)
    task = get_task(task_id)
    return [AuditOut(id=a.pk, at=a.at, actor=a.actor_name, ip=a.ip, action=a.action, before=a.before,
                     after=a.after, reason=a.reason) for a in AuditEntry.objects.filter(task=task).order_by("at", "id")]


@api.get("/tasks/{task_id}/export", response=responses({200: dict}, FOUND), tags=["history"])
def task_export(request, task_id: int = id_param("a task id")):
    """Everything about a task in one JSON document (task, steps, WAL, last snapshot,
    events, audit, reviews) — what a human needs to investigate a `needs_human` task."""
    require(request, roles.VIEWER)
    get_task(task_id)
    return json.loads(json.dumps(selectors.task_export(task_id), cls=DjangoJSONEncoder))


# --- the review queue ------------------------------------------------------------------------

class ReviewOut(Schema):
    id: int
    task_id: int
    task_type: str
    task_status: str
    status: str
    reason: str
    dead_worker: str
    detected_at: datetime
    step_id: str
    tool: str
    args: Any
    idempotency_key: str
    intent_written_at: datetime
    wal_status: str
    evidence: Any
    decision: str
    decision_result: Any
    note: str
    decided_by: str | None
    decided_at: datetime | None


class DecideIn(Schema):
    decision: str = Field(..., json_schema_extra=_enum(lambda: Decision.values),
                          description="; ".join(f"`{v}`: {label}" for v, label in Decision.choices))
    note: str = ""
    result: Any = None


def review_out(item) -> ReviewOut:
    entry = item.wal_entry
    return ReviewOut(
        id=item.pk, task_id=item.task_id, task_type=item.task.type, task_status=item.task.status, status=item.status,
        reason=item.reason, dead_worker=item.dead_worker, detected_at=item.detected_at, step_id=entry.step_id,
        tool=entry.tool, args=entry.args, idempotency_key=entry.idempotency_key, intent_written_at=entry.created_at,
        wal_status=entry.status, evidence=item.evidence, decision=item.decision, decision_result=item.decision_result,
        note=item.note, decided_by=item.decided_by.username if item.decided_by else None, decided_at=item.decided_at)


@api.get("/reviews", response=responses({200: list[ReviewOut]}, PARAMS), tags=["reviews"])
def list_reviews(request, status: Literal[tuple(ReviewStatus.values) + ("all",)] = "open",
                 task: int | None = Query(None, ge=1, le=MAX_ID, description="a task id"), tool: str = "",
                 limit: int = Query(200, ge=1, le=MAX_ID, description="at most 1000 are returned")):
    """Review items, oldest first (open ones by default; `status=decided` or `status=all`)."""
    require(request, roles.VIEWER)
    return [review_out(i) for i in review_selectors.review_list(status=status, task_id=task, tool=tool)[:max(1, min(limit, 1000))]]


@api.get("/reviews/{review_id}", response=responses({200: ReviewOut}, FOUND), tags=["reviews"])
def review_detail(request, review_id: int = id_param("a review item id")):
    require(request, roles.VIEWER)
    return review_out(get_review(review_id))


@api.post("/reviews/{review_id}/decide", response=responses({200: ReviewOut}, FOUND, BODY, {409: ErrorOut}),
          tags=["reviews"])
def decide_review(request, body: DecideIn, review_id: int = id_param("a review item id")):
    """Decide an open item: `happened` (optionally with `result`), `not_happened`
    (performed again with the same key), `skip`, or `abort_task`; `note` is required."""
    require(request, roles.REVIEWER)
    get_review(review_id)
    review_services.review_decide(item_id=review_id, decision=body.decision, note=body.note, result=body.result,
                                  actor=request.auth, ip=client_ip(request))
    return review_out(get_review(review_id))


def get_review(review_id: int):
    try:
        return review_selectors.review_detail(review_id)
    except ReviewItem.DoesNotExist:
        raise NotFound(f"There is no review item #{review_id}.") from None


@api.exception_handler(review_services.ReviewClosed)
def on_review_closed(request, exc):
    return api.create_response(request, {"detail": str(exc), "errors": []}, status=409)
