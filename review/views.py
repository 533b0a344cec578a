"""The review queue's pages: the queue (`/review/`) and one item (`/review/<id>/`), where a
reviewer decides what happened to a side effect whose outcome is unknown, or approves, edits
or rejects a tool call an agent proposes (shown as a person reads it: review/presenters.py;
its edit form generated from the tool's argument model, as the new-task form is).

Thin, like the task pages: reads through review.selectors, the decision goes through
review.services.review_decide (which validates, applies and audits it). Every page needs a
logged-in user with a role; only reviewers get (and may POST) the decision form.

Secrets: _detail_context is the item page's redaction boundary (the queue shows no
arguments or results): arguments, results, evidence, the proposal and the reasons are shown
with the installation's secrets replaced by markers (orchestrator/primitives/redaction.py),
to every role. What was approved is the stored arguments, not the page's redacted copy.
"""
import json
from urllib.parse import urlencode

from django.contrib import messages
from django.core.exceptions import PermissionDenied
from django.http import Http404
from django.shortcuts import redirect, render
from django.views.decorators.http import require_GET, require_http_methods

from orchestrator import roles
from orchestrator.engine.approvals import arguments_digest
from orchestrator.engine.services import InvalidInput
from orchestrator.models import Step
from orchestrator.presenters.waits import with_item_waits
from orchestrator.primitives.redaction import redact
from orchestrator.web.access import client_ip, viewer_required
from orchestrator.web.forms import attach_errors, param_fields, prefill, read_field

from . import approvals, presenters, selectors, services
from .approvals import closed_message
from .models import DECISIONS_BY_KIND, Decision, OnExpiry, ReviewItem, ReviewKind, ReviewStatus

QUEUE_ROWS_SHOWN = 100  # a page; the next ones by keyset (?after=<id>)
OTHER_ITEMS_SHOWN = 100
STATUS_CHOICES = (("open", "Open"), ("decided", "Decided"), ("expired", "Expired"), ("revoked", "Revoked"),
                  ("all", "All"))
FORM_FIELDS = ("decision", "note", "result")
EDIT_PREFIX = "arguments"  # the generated edit form's field names: arguments.<key>


def require_reviewer(request) -> None:
    if not roles.has_role(request.user, roles.REVIEWER):
        raise PermissionDenied("Deciding review items needs the reviewer role; ask an administrator to add you "
                               "to the 'reviewer' group.")


def _json(value) -> str:
    return json.dumps(redact(value), indent=2, ensure_ascii=False, sort_keys=True, default=str)


# --- the queue ----------------------------------------------------------------------------

@require_GET
@viewer_required
def review_list(request):
    status = request.GET.get("status", "open").strip() or "open"
    if status not in dict(STATUS_CHOICES):
        status = "open"
    tool = request.GET.get("tool", "").strip()
    raw_task = request.GET.get("task", "").strip().lstrip("#")
    task_id = int(raw_task) if raw_task.isdigit() else None

    raw_after = request.GET.get("after", "").strip()
    after = int(raw_after) if raw_after.isdigit() and int(raw_after) < 2**63 else None

    qs = selectors.review_list(status=status, task_id=task_id, tool=tool)
    total = qs.count()
    items, next_after = selectors.review_page(qs, after=after, limit=QUEUE_ROWS_SHOWN)
    with_item_waits(items)
    tools = sorted(set(selectors.tool_names()) | ({tool} if tool else set()))
    filters = {k: v for k, v in (("status", status if status != "open" else ""), ("tool", tool),
                                 ("task", str(task_id) if task_id else "")) if v}
    return render(request, "review/review_list.html", {
        "items": items,
        "total": total,
        "truncated": total > len(items),
        "after": after,
        "next_after": next_after,
        "status": status,
        "status_choices": STATUS_CHOICES,
        "tool": tool,
        "tools": tools,
        "task_filter": task_id or (raw_task if raw_task else ""),
        "task_filter_invalid": bool(raw_task) and task_id is None,
        "filters": filters,
        "filter_query": urlencode(filters),
        "probes": selectors.settled_by_probes(),
    })


# --- one item and its decision --------------------------------------------------------------

def _get_item(review_id: int) -> ReviewItem:
    try:
        return selectors.review_detail(review_id)
    except ReviewItem.DoesNotExist:
        raise Http404(f"There is no review item #{review_id}.") from None


def _empty_form() -> dict:
    return {"values": {"decision": "", "note": "", "result": ""}, "errors": {name: [] for name in FORM_FIELDS},
            "general_errors": []}


def _edit_fields(item: ReviewItem) -> list[dict] | None:
    """The edit form of an approval, generated from its tool's argument model (as the new-task
    form is from a task type's params), prefilled with the arguments that would run now; None
    when the tool has no model here (the edit is then a JSON object)."""
    schema = approvals.argument_schema(item)
    if not schema or not (schema.get("properties") or {}):
        return None
    return prefill(param_fields(schema, prefix=EDIT_PREFIX), redact(approvals.standing_arguments(item)))


def _approval_context(request, item: ReviewItem, edit_fields: list[dict] | None) -> dict:
    """What the approval page shows: the call as a person reads it, the model's words that led
    to it, the deadline, the approvals so far, and whether this user may decide it."""
    proposal = redact(item.proposal or {})
    standing = approvals.standing_arguments(item)
    shown = redact(standing)
    edited = arguments_digest(standing) != arguments_digest(approvals.proposed_arguments(item))
    reasoning = presenters.reasoning_for(item.task_id, item.step_id, proposal.get("call_id", ""),
                                         fallback=proposal.get("context", ""))
    reasoning.text, reasoning.thinking = redact(reasoning.text), redact(reasoning.thinking)
    why_not = approvals.may_decide(item, request.user)
    if edit_fields is None:
        edit_fields = _edit_fields(item)
    return {
        "call": presenters.present_call(item.tool, shown),
        # Two-person approval: an earlier reviewer's edit is what the next one approves.
        "proposed_call": presenters.present_call(item.tool, proposal.get("arguments")) if edited else None,
        "edited_by": approvals.latest_edit(item) if edited else None,
        "reasoning": reasoning,
        "shown_sha256": arguments_digest(standing),
        "votes": list(item.votes.all()),
        "on_expiry_label": OnExpiry(item.on_expiry).label if item.on_expiry in OnExpiry.values else "",
        "why_not": why_not if item.status == ReviewStatus.OPEN else "",
        "can_decide": item.status == ReviewStatus.OPEN and not why_not,
        "edit_fields": edit_fields,
        # A secret of the installation in the arguments reaches the page as a marker: an edit
        # would send the marker, so such a call is approved or rejected as it stands.
        "edit_available": shown == standing,
        "args_json": _json(shown),
        "closed_message": closed_message(item) if item.status != ReviewStatus.OPEN else "",
    }


def _detail_context(request, item: ReviewItem, form: dict, edit_fields: list[dict] | None = None) -> dict:
    entry = item.wal_entry
    for shown in (item, item.task) + ((entry,) if entry else ()):
        for name in ("reason", "note", "status_reason", "title", "error"):
            if isinstance(getattr(shown, name, None), str):
                setattr(shown, name, redact(getattr(shown, name)))  # for display only, never saved
    evidence = redact(item.evidence) if isinstance(item.evidence, dict) else None
    how_to_check = evidence.get("how_to_check") if evidence else None
    evidence_rest = {k: v for k, v in evidence.items() if k != "how_to_check"} if evidence else None
    others = list(ReviewItem.objects.filter(task_id=item.task_id).exclude(pk=item.pk)
                  .select_related("wal_entry", "decided_by").order_by("detected_at", "id")[:OTHER_ITEMS_SHOWN])
    proposal = redact(item.proposal or {})
    context = {
        "item": item,
        "task": item.task,
        "entry": entry,
        "proposal": proposal,
        "step": Step.objects.filter(task_id=item.task_id, step_id=item.step).only(
            "step_id", "title", "status").first(),
        "args_json": _json(entry.args if entry else proposal.get("arguments")),
        "call": presenters.present_call(item.tool, redact(entry.args)) if entry else None,
        "wal_result_json": _json(entry.result) if entry and entry.result is not None else "",
        "how_to_check": how_to_check,
        "evidence": evidence_rest if evidence is not None else redact(item.evidence),
        "evidence_json": _json(evidence_rest if evidence is not None else item.evidence),
        "decision_result_json": _json(item.decision_result) if item.decision_result is not None else "",
        "decision_label": Decision(item.decision).label if item.decision in Decision.values else item.decision,
        "others": others,
        "is_open": item.status == ReviewStatus.OPEN,
        "can_decide": item.status == ReviewStatus.OPEN and roles.has_role(request.user, roles.REVIEWER),
        "decisions": [(d.value, d.label) for d in DECISIONS_BY_KIND[item.kind]],
        "form": form,
    }
    if item.kind == ReviewKind.APPROVAL:
        context.update(_approval_context(request, item, edit_fields))
    return context


def _read_form(data) -> tuple[dict, dict]:
    """(the form with the user's input and any local errors, the arguments for review_decide)"""
    form = _empty_form()
    values = form["values"]
    values["decision"] = data.get("decision", "").strip()
    values["note"] = data.get("note", "")
    values["result"] = data.get("result", "")
    result = None
    if values["decision"] in (Decision.HAPPENED, Decision.EDIT_APPROVE) and values["result"].strip():
        try:
            result = json.loads(values["result"])
        except ValueError as exc:
            form["errors"]["result"].append(f"Not valid JSON: {exc}")
    return form, {"decision": values["decision"], "note": values["note"], "result": result}


def _read_approval_form(item: ReviewItem, data) -> tuple[dict, dict, list[dict] | None]:
    """An approval's buttons (approve, reject) or its generated edit form (edit_approve): the
    form, the arguments for review_decide, and the edit fields with the user's input."""
    form, decide = _read_form(data)
    decide["arguments_sha256"] = data.get("arguments_sha256", "").strip()[:64]
    edit_fields = None
    if decide["decision"] == Decision.EDIT_APPROVE:
        edit_fields = _edit_fields(item)
        if edit_fields is not None:
            edited = {}
            for field in edit_fields:
                present, value = read_field(field, data)
                if present:
                    # A browser sends a textarea's line breaks as CRLF: an edit of the subject
                    # alone must not rewrite the body's line breaks (nor its digest).
                    edited[field["key"]] = value.replace("\r\n", "\n") if isinstance(value, str) else value
            decide["result"] = edited
    return form, decide, edit_fields


def _show_errors(errors, form: dict, edit_fields: list[dict] | None) -> None:
    for error in errors:
        if error.field in form["errors"]:
            form["errors"][error.field].append(error.message)
        elif edit_fields is not None and error.field.startswith(EDIT_PREFIX + "."):
            form["general_errors"] += attach_errors([error], edit_fields)
        else:
            form["general_errors"].append(f"{error.field}: {error.message}" if error.field else error.message)


@require_http_methods(["GET", "POST"])
@viewer_required
def review_detail(request, review_id: int):
    if request.method == "POST":
        require_reviewer(request)
    item = _get_item(review_id)
    if request.method == "GET":
        return render(request, "review/review_detail.html", _detail_context(request, item, _empty_form()))

    if item.kind == ReviewKind.APPROVAL:
        form, decide, edit_fields = _read_approval_form(item, request.POST)
    else:
        (form, decide), edit_fields = _read_form(request.POST), None
    if any(form["errors"].values()) or any(f["errors"] for f in edit_fields or ()):
        return render(request, "review/review_detail.html", _detail_context(request, item, form, edit_fields),
                      status=422)
    try:
        decided = services.review_decide(item_id=item.pk, actor=request.user, ip=client_ip(request), **decide)
    except InvalidInput as exc:
        _show_errors(exc.errors, form, edit_fields)
        return render(request, "review/review_detail.html", _detail_context(request, item, form, edit_fields),
                      status=422)
    except services.DecisionRefused as exc:
        # Decided, expired or revoked already (a double click, another reviewer), the same
        # reviewer twice, arguments changed meanwhile, or not this reviewer's to decide.
        form["general_errors"].append(str(exc))
        return render(request, "review/review_detail.html",
                      _detail_context(request, _get_item(review_id), form), status=exc.status)
    item = _get_item(review_id)
    task = item.task
    if decided.status == ReviewStatus.OPEN:  # two-person approval: one of two
        messages.success(request, f"Your approval of #{item.pk} is recorded; it runs once another reviewer "
                                  f"approves the same arguments.")
        return redirect("review:detail", review_id=item.pk)
    messages.success(request, f"Review #{item.pk} decided: {Decision(item.decision).label}. "
                              f"Task #{task.pk} is now {task.status}.")
    return redirect("review:queue")
