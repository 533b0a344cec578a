"""GET /metrics: the Prometheus exposition (orchestrator/metrics.py computes it).

Off unless ORCH_METRICS_TOKEN is set (404, as if there were no such page); then only a request
bearing that token reads it (`Authorization: Bearer <token>`, compared in constant time). A
logged-in session, whatever its roles, is not enough: the figures are the installation's, for
the monitoring system, not for a dashboard user."""
import hmac

from django.conf import settings
from django.http import Http404, HttpResponse
from django.views.decorators.http import require_GET

from .. import metrics


def _bearer(request) -> str:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


@require_GET
def metrics_view(request):
    expected = settings.ORCH_METRICS_TOKEN
    if not expected:
        raise Http404("metrics are off (ORCH_METRICS_TOKEN is not set)")
    given = _bearer(request)
    if not given:
        response = HttpResponse("a bearer token is required\n", status=401, content_type="text/plain")
        response["WWW-Authenticate"] = 'Bearer realm="metrics"'
        return response
    if not hmac.compare_digest(given.encode(), expected.encode()):
        return HttpResponse("wrong token\n", status=403, content_type="text/plain")
    body, content_type = metrics.exposition()
    response = HttpResponse(body, content_type=content_type)
    response["Cache-Control"] = "no-store"
    return response
