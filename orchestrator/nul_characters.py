"""No NUL character (U+0000) from a request reaches the database.

PostgreSQL stores none in text and compares none: a path segment, a form field or a filter
holding one failed the query or the write with a 500 (a webhook's source name, the task form's
title). JSON bodies are checked where they are read (primitives/jsonlimits.py); this middleware
covers the rest of a request, the same on SQLite:
- the path, and the fields of a form body: refused, 400, saying so (nothing is done);
- the query string: the character is dropped, as a filter's text is read (a search for
  "ab\\x00c" is a search for "abc"), so a bookmarked or fuzzed URL still shows its page.
"""
import logging

from django.core.exceptions import RequestDataTooBig, TooManyFieldsSent
from django.http.multipartparser import MultiPartParserError
from django.http import HttpResponseBadRequest, JsonResponse, QueryDict

from .primitives.storable import NUL

log = logging.getLogger("orchestrator.requests")

MESSAGE = "The request holds the NUL character (%00, U+0000) in {where}, which cannot be stored: remove it."


def _form_field_with_nul(request) -> str | None:
    if request.method != "POST" or request.content_type not in ("application/x-www-form-urlencoded",
                                                                 "multipart/form-data"):
        return None
    try:
        # The raw body first: parsing the form from the stream would leave a view that reads
        # the body (a webhook checks its signature over it) a RawPostDataException, a 500.
        request.body  # noqa: B018 - read for its cache
        fields = request.POST
    except (RequestDataTooBig, TooManyFieldsSent, MultiPartParserError):
        return None  # the view's own handling answers these (413, 400; a body it cannot read)
    for name, values in fields.lists():
        if NUL in name or any(NUL in value for value in values):
            return f"the form field {name.replace(NUL, '')!r}"
    return None


class NulCharacterMiddleware:
    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        where = "the path" if NUL in request.path else _form_field_with_nul(request)
        if where is not None:
            log.info("request refused: NUL character", extra={"path": request.path.replace(NUL, ""), "where": where})
            message = MESSAGE.format(where=where)
            if request.path.startswith("/api/"):
                return JsonResponse({"detail": message, "errors": []}, status=400)
            return HttpResponseBadRequest(message, content_type="text/plain; charset=utf-8")
        query = request.META.get("QUERY_STRING", "")
        if "%00" in query:
            request.GET = QueryDict(query.replace("%00", ""), encoding=request.encoding)
        return self.get_response(request)
