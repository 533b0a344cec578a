"""The HTTP API (django-ninja; OpenAPI at /api/openapi.json). Thin: it parses input,
checks the role and calls the engine's services; JSON in and out.

This module makes the NinjaAPI instance and mounts the routers, one per resource; auth.py
says who is calling, schemas.py and presenters.py what goes in and out, errors.py how
every failure is answered."""
from ninja import NinjaAPI
from ninja.errors import ValidationError
from ninja.parser import Parser

from ..primitives import jsonlimits

from . import control, errors, history, inbox, reviews, tasks, types
from .auth import BearerAuth, LoggedInSession
from .presenters import RedactingRenderer


class BoundedJSONParser(Parser):
    """Request bodies with a bound on nesting and no NUL: such a body is a 400 that says so
    (errors.py reads the jsonlimits.Unreadable behind ninja's "Cannot parse request body")."""

    def parse_body(self, request):
        return jsonlimits.loads(request.body)

    def parse_querydict(self, data, list_fields, request):
        """A query parameter of one value given more than once is a 422 naming it (django's
        QueryDict would take the last one silently: `?limit=5&limit=900` was 900). No
        parameter of this API takes a list in the query string."""
        repeated = [key for key in data if key not in list_fields and len(data.getlist(key)) > 1]
        if repeated:
            raise ValidationError([{"loc": ("query", key), "msg": f"given {len(data.getlist(key))} times; "
                                    f"give it once"} for key in repeated])
        return super().parse_querydict(data, list_fields, request)


class OrchestratorAPI(NinjaAPI):
    def get_openapi_operation_id(self, operation) -> str:
        """`orchestrator_api_<function name>`, whichever router module defines it: the ids
        stay what they were when the API was one module (clients generated from the schema
        depend on them)."""
        return "orchestrator_api_" + operation.view_func.__name__

    def get_openapi_schema(self, *, path_prefix=None, path_params=None):
        """The schema, with each operator verb (engine/verbs.py) as a path of its own: read at
        every request for it, so a verb registered later is listed too."""
        schema = super().get_openapi_schema(path_prefix=path_prefix, path_params=path_params)
        prefix = self.get_root_path(path_params or {}) if path_prefix is None else path_prefix
        control.verb_operations(schema, prefix.rstrip("/"))
        return schema


api = OrchestratorAPI(title="Orchestrator API", version="1", auth=[BearerAuth(), LoggedInSession()],
                      urls_namespace="api", parser=BoundedJSONParser(),
                      renderer=RedactingRenderer())  # every answer redacted (presenters.py)
errors.install(api)
for module in (reviews, types, tasks, control, history, inbox):
    api.add_router("", module.router)
api.add_router("", control.verbs_router)  # last: its /tasks/{task_id}/{verb} would shadow the paths above
