"""Who is calling: a bearer token (scripts) or the browser's login session (with CSRF),
and the role check every endpoint makes."""
from django.http import HttpRequest
from ninja.security import HttpBearer, SessionAuth
from ninja.utils import check_csrf

from .. import roles
from ..auth import TokenRejected, token_authenticate
from .errors import CsrfFailed, Forbidden, NotAuthenticated


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


def require(request: HttpRequest, role: str) -> None:
    if not roles.has_role(request.auth, role):
        raise Forbidden(f"This needs the {role} role; ask an administrator to add you to the '{role}' group.")
