"""/api/reviews: the review queue (items whose side effect's outcome is unknown) and decisions."""
from typing import Literal

from ninja import Query, Router

from .. import roles
from .auth import require
from .common import BODY, FOUND, MAX_ID, PARAMS, client_ip, id_param, responses
from .errors import NotFound
from .presenters import review_out
from .schemas import DecideIn, ErrorOut, ReviewOut
from review import selectors as review_selectors, services as review_services
from review.models import ReviewItem, ReviewStatus

router = Router(tags=["reviews"])


@router.get("/reviews", response=responses({200: list[ReviewOut]}, PARAMS))
def list_reviews(request, status: Literal[tuple(ReviewStatus.values) + ("all",)] = "open",
                 task: int | None = Query(None, ge=1, le=MAX_ID, description="a task id"), tool: str = "",
                 limit: int = Query(200, ge=1, le=MAX_ID, description="at most 1000 are returned")):
    """Review items, oldest first (open ones by default; `status=decided` or `status=all`)."""
    require(request, roles.VIEWER)
    return [review_out(i) for i in review_selectors.review_list(status=status, task_id=task, tool=tool)[:max(1, min(limit, 1000))]]


@router.get("/reviews/{review_id}", response=responses({200: ReviewOut}, FOUND))
def review_detail(request, review_id: int = id_param("a review item id")):
    require(request, roles.VIEWER)
    return review_out(get_review(review_id))


@router.post("/reviews/{review_id}/decide", response=responses({200: ReviewOut}, FOUND, BODY, {409: ErrorOut}))
def decide_review(request, body: DecideIn, review_id: int = id_param("a review item id")):
    """Decide an open item. An effect in doubt: `happened` (optionally with `result`),
    `not_happened` (performed again with the same key), `skip`, or `abort_task`; `note` is
    required. An approval: `approve`, `edit_approve` (`result`: the corrected arguments, checked
    by the tool's argument model) or `reject` (`note` required: the model reads it); send
    `arguments_sha256` (the item's `approval.arguments_sha256`) to be refused if they changed.
    409: the item was decided, expired or revoked already (who and when), or you approved these
    arguments already (two-person approval); 403: escalated to a group you are not in."""
    require(request, roles.REVIEWER)
    get_review(review_id)
    review_services.review_decide(item_id=review_id, decision=body.decision, note=body.note, result=body.result,
                                  actor=request.auth, ip=client_ip(request), arguments_sha256=body.arguments_sha256)
    return review_out(get_review(review_id))


def get_review(review_id: int):
    try:
        return review_selectors.review_detail(review_id)
    except ReviewItem.DoesNotExist:
        raise NotFound(f"There is no review item #{review_id}.") from None
