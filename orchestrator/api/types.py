"""GET /api/task-types: the task types and their params schemas."""
from ninja import Router

from .. import roles
from ..tasktypes import all_types
from .auth import require
from .common import responses
from .presenters import task_type_out
from .schemas import TaskTypeOut

router = Router(tags=["tasks"])


@router.get("/task-types", response=responses({200: list[TaskTypeOut]}))
def list_task_types(request):
    require(request, roles.VIEWER)
    return [task_type_out(t) for t in all_types().values()]
