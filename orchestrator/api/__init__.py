"""The HTTP API (django-ninja; OpenAPI at /api/openapi.json). Thin: it parses input,
checks the role and calls the engine's services; JSON in and out.

This module makes the NinjaAPI instance and mounts the routers, one per resource; auth.py
says who is calling, schemas.py and presenters.py what goes in and out, errors.py how
every failure is answered."""
from ninja import NinjaAPI
from ninja.parser import Parser

from ..primitives import jsonlimits

from . import control, errors, history, inbox, reviews, tasks, types
from .auth import BearerAuth, LoggedInSession
from .presenters import RedactingRenderer


class BoundedJSONParser(Parser):
    """Request bodies with a bound on nesting: a deeply nested body is a 400 that says so
    (errors.py reads the TooDeep behind ninja's "Cannot parse request body")."""

    def parse_body(self, request):
        return jsonlimits.loads(request.body)


class OrchestratorAPI(NinjaAPI):
    def get_openapi_operation_id(self, operation) -> str:
        """`orchestrator_api_<function name>`, whichever router module defines it: the ids
        stay what they were when the API was one module (clients generated from the schema
        depend on them)."""
        return "orchestrator_api_" + operation.view_func.__name__


api = OrchestratorAPI(title="Orchestrator API", version="1", auth=[BearerAuth(), LoggedInSession()],
                      urls_namespace="api", parser=BoundedJSONParser(),
                      renderer=RedactingRenderer())  # every answer redacted (presenters.py)
errors.install(api)
for module in (reviews, types, tasks, control, history, inbox):
    api.add_router("", module.router)
