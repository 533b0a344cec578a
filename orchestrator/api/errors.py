"""The API's errors: the exceptions its endpoints raise, and the handlers that answer every
error (ours, ninja's, Django's, the engine's and the review queue's) as `{"detail", "errors"}`."""
from django.conf import settings
from django.core.exceptions import RequestDataTooBig, SuspiciousOperation
from django.db import OperationalError
from ninja import NinjaAPI
from ninja.errors import AuthenticationError, HttpError, ValidationError as NinjaValidationError

from ..engine import inbox, services
from ..database_busy import RETRY_AFTER_SECONDS, busy_message, is_database_busy, log_busy
from ..engine.states import InvalidTransition
from ..primitives.jsonlimits import Unreadable
from review import services as review_services
from ..primitives.errors import HarnessError


class NotAuthenticated(HarnessError):
    """401: no credentials, or a bearer token that authenticates nobody (the message says why)."""


class CsrfFailed(HarnessError):
    pass


class Forbidden(HarnessError):
    pass


class NotFound(HarnessError):
    pass


def install(api: NinjaAPI) -> None:
    """Register the error handlers on `api`."""
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
        if exc.status_code == 400 and isinstance(exc.__cause__, Unreadable):
            detail = f"Cannot read the request body: {exc.__cause__}."
        elif exc.status_code == 400 and detail.startswith("Cannot parse request body"):
            detail = "Cannot parse the request body: send valid JSON with 'Content-Type: application/json'."
        return api.create_response(request, {"detail": detail, "errors": []}, status=exc.status_code)

    @api.exception_handler(InvalidTransition)
    def on_invalid_transition(request, exc: InvalidTransition):
        # A resume refused by the compatibility gate (engine/compat.py) lists what changed, one per entry.
        errors = [{"field": f"compatibility.{d['key']}", "message": d["text"]} for d in getattr(exc, "differences", ())]
        return api.create_response(request, {"detail": str(exc), "errors": errors}, status=409)

    @api.exception_handler(Forbidden)
    def on_forbidden(request, exc: Forbidden):
        return api.create_response(request, {"detail": str(exc), "errors": []}, status=403)

    @api.exception_handler(NotFound)
    def on_not_found(request, exc: NotFound):
        return api.create_response(request, {"detail": str(exc), "errors": []}, status=404)

    @api.exception_handler(inbox.InboxRefused)
    def on_inbox_refused(request, exc: inbox.InboxRefused):
        body = {"detail": str(exc), "errors": [{"field": exc.field, "message": str(exc)}] if exc.field else []}
        if exc.pending is not None:
            body["pending"] = exc.pending
        response = api.create_response(request, body, status=exc.status)
        if exc.retry_after is not None:
            response["Retry-After"] = str(exc.retry_after)
        return response

    @api.exception_handler(OperationalError)
    def on_database_error(request, exc: OperationalError):
        # SQLite's write lock held by another process (a frozen worker): 503 with Retry-After
        # after a few seconds (orchestrator/database_busy.py), in the API's own shape. Any other
        # database error goes on to Django (an unreachable database: the outage middleware's 503).
        if not is_database_busy(exc):
            raise exc
        log_busy(request)
        response = api.create_response(request, {"detail": busy_message(), "errors": []}, status=503)
        response["Retry-After"] = str(RETRY_AFTER_SECONDS)
        return response

    @api.exception_handler(review_services.DecisionRefused)
    def on_decision_refused(request, exc):
        # Closed already (who and when), the same reviewer twice, changed arguments (409), or
        # not this reviewer's to decide (403).
        return api.create_response(request, {"detail": str(exc), "errors": []}, status=exc.status)
