"""Access for the server-rendered pages: every page needs a logged-in user with a role
(orchestrator.roles); operator-only actions check for it; the nav's context processor."""
from functools import wraps

from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import Http404

from .. import roles, selectors
from ..models import Task, TaskStatus
from ..tasktypes import all_types


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


def task_types() -> dict:
    return all_types()
