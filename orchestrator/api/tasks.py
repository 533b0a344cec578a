"""/api/tasks: create a task, list them (a page at a time), one task with its steps."""
from ninja import Path, Query, Router, Status

from .. import roles, selectors
from ..engine import results, services
from ..models import Step, TaskStatus
from .auth import require
from .common import BODY, FOUND, MAX_ID, PARAMS, client_ip, get_task, id_param, responses
from .presenters import task_out, task_summaries_out
from .errors import NotFound
from .schemas import StepResultOut, TaskCreateIn, TaskOut, TaskPageOut

router = Router(tags=["tasks"])


@router.post("/tasks", response=responses({201: TaskOut}, BODY))
def create_task(request, body: TaskCreateIn):
    require(request, roles.OPERATOR)
    task = services.task_create(type=body.type, params=body.params, limits=body.limits, title=body.title,
                                actor=request.auth, ip=client_ip(request))
    return Status(201, task_out(task, request.auth, just_created=True))


@router.get("/tasks", response=responses({200: TaskPageOut}, PARAMS))
def list_tasks(request, status: str = Query("", description="comma-separated statuses: "
                                         + ", ".join(TaskStatus.values)),
               type: str = Query("", description="a task type"), q: str = "",
               before: int | None = Query(None, ge=1, le=MAX_ID, description="the `next_before` of the previous page"),
               limit: int = Query(50, ge=1, le=MAX_ID, description="page size (at most 500 are returned)")):
    require(request, roles.VIEWER)
    rows, next_before = selectors.task_page(selectors.task_list(status=status, type=type, text=q), before=before,
                                            limit=max(1, min(limit, 500)))
    return TaskPageOut(items=task_summaries_out(list(rows)), next_before=next_before)


@router.get("/tasks/{task_id}", response=responses({200: TaskOut}, FOUND))
def task_detail(request, task_id: int = id_param("a task id")):
    require(request, roles.VIEWER)
    return task_out(get_task(task_id), request.auth)


@router.get("/tasks/{task_id}/steps/{step_id}/result", response=responses({200: StepResultOut}, FOUND))
def step_result(request, task_id: int = id_param("a task id"), step_id: str = Path(..., max_length=200)):
    """One step's result, wherever it is stored (a large one is not part of GET /api/tasks/{id})."""
    require(request, roles.VIEWER)
    task = get_task(task_id)
    step = Step.objects.filter(task=task, step_id=step_id).first()
    if step is None:
        raise NotFound(f"Task #{task.pk} has no step {step_id!r}.")
    return StepResultOut(step_id=step.step_id, status=step.status, result_bytes=step.result_bytes,
                         result=results.result_of(step))
