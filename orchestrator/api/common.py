"""What the endpoints share: looking a task up (404), the caller's address, path ids, the
statuses each endpoint declares (schemathesis checks them), an optional body's check."""
import json

from ninja import Path

from .. import selectors
from ..engine import services
from ..models import Task
from .errors import NotFound
from .schemas import ErrorOut

# The largest id/seq the database stores (signed 64-bit); a bigger one is a 422, not a 500.
MAX_ID = 2**63 - 1


def get_task(task_id: int) -> Task:
    try:
        return selectors.task_detail(task_id)
    except Task.DoesNotExist:
        raise NotFound(f"There is no task #{task_id}.") from None


def client_ip(request) -> str | None:
    return request.META.get("REMOTE_ADDR")


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


def optional_object_body(request) -> None:
    """An optional body must be a JSON object (or absent / null): ninja reads any other JSON
    value (a list, a number) as "no body", which would accept e.g. `[1]` as a plain request."""
    raw = request.body.strip()
    if raw and not isinstance(json.loads(raw), (dict, type(None))):
        raise services.InvalidInput([services.FieldError("body", "must be a JSON object (or empty)")])
