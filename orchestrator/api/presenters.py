"""Output mappers: one per resource, from a model to the schema the API answers with (the
CLI's `tasks show --json` uses task_out too), and the renderer every answer goes through.

Secrets: RedactingRenderer is the API's one redaction boundary. Every JSON answer — step
results, WAL arguments and results, events, the inbox, reviews, snapshots, the export — is
passed through orchestrator/primitives/redaction.py's `redact` after the schemas have
serialised it and before it is written, so no endpoint can forget it. Every role gets the
same redacted answer."""
from ninja.renderers import JSONRenderer

from ..engine import actions as task_actions, llm_ledger
from ..engine.approvals import arguments_digest
from ..models import Task
from ..presenters.task_page import with_unreviewed_effects
from ..presenters.waiting import with_waiting_on
from ..presenters.waits import with_review_waits
from ..primitives.redaction import redact
from .schemas import (ApprovalOut, ApprovalVoteOut, AuditOut, ReviewOut, ReviewWaitOut, StepOut, TaskOut,
                      TaskSummaryOut, TaskTypeOut, WaitingOnOut, WorkerOut)
from review import approvals as review_approvals
from review.models import ReviewKind


class RedactingRenderer(JSONRenderer):
    """django-ninja's JSON renderer, with the installation's secrets replaced by their markers."""

    def render(self, request, data, *, response_status: int):
        return super().render(request, redact(data), response_status=response_status)


def task_type_out(task_type) -> TaskTypeOut:
    return TaskTypeOut(name=task_type.name, title=task_type.title, description=task_type.description,
                       params_schema=task_type.params_schema())


def waiting_on_out(task: Task) -> WaitingOnOut | None:
    """The task's `waiting_on` (presenters/waiting.py; set by with_waiting_on), as the API shows it."""
    found = getattr(task, "waiting_on", None)
    if found is None:
        return None
    return WaitingOnOut(kind=found.kind, text=found.text, since=found.since, link=found.link,
                        link_text=found.link_text, deadline=found.deadline, stalled=found.stalled)


def task_summary_out(t: Task) -> TaskSummaryOut:
    return TaskSummaryOut(
        id=t.pk, type=t.type, title=t.title, status=t.status, status_reason=t.status_reason,
        steps_done=t.steps_done, steps_total=t.steps_total, progress_percent=t.progress_percent,
        created_at=t.created_at, updated_at=t.updated_at, waiting_on=waiting_on_out(t))


def task_summaries_out(tasks: list[Task]) -> list[TaskSummaryOut]:
    """A page of the task list, each with what it waits on (a fixed number of queries for the page)."""
    return [task_summary_out(t) for t in with_waiting_on(tasks)]


def task_out(task: Task, user=None, *, just_created: bool = False) -> dict:
    """The task as the API shows it to `user` (None: the system, e.g. the CLI).

    `just_created`: the task as its creation committed it, for the answer to POST /api/tasks.
    It has no steps, model calls or review items yet (a worker may have started it since: the
    answer is the created resource, GET shows it now), so none is read: four queries fewer on
    the path every task starts with."""
    if just_created:
        task.unreviewed_effects, task.review_waits = 0, []
        with_waiting_on([task])
        return _task_out(task, user, steps=[], model_usage=dict(llm_ledger.NO_CALLS))
    with_waiting_on(with_review_waits(with_unreviewed_effects([task])))
    steps = [StepOut(id=s.step_id, title=s.title, status=s.status, depends_on=s.depends_on, reads=s.reads,
                     attempts=s.attempts, started_at=s.started_at, finished_at=s.finished_at,
                     duration_seconds=s.duration_seconds, error=s.error, result=s.result, added_by=s.added_by,
                     result_stored_apart=s.result_stored_apart, result_bytes=s.result_bytes)
             for s in task.steps.all()]
    return _task_out(task, user, steps=steps, model_usage=llm_ledger.totals(task.pk))


def _task_out(task: Task, user, *, steps: list[StepOut], model_usage: dict) -> TaskOut:
    running = task.status in ("running", "pausing", "stopping") and task.lease_owner
    return TaskOut(
        id=task.pk, type=task.type, title=task.title, status=task.status, status_reason=task.status_reason,
        steps_done=task.steps_done, steps_total=task.steps_total, progress_percent=task.progress_percent,
        created_at=task.created_at, updated_at=task.updated_at, waiting_on=waiting_on_out(task),
        params=task.params, limits=task.limits,
        counters={"steps_done": task.steps_done, "steps_total": task.steps_total, "tokens_used": task.tokens_used,
                  "active_seconds": round(task.active_seconds, 3), "recovery_attempts": task.recovery_attempts,
                  # The ledger of model calls summed (every attempt; the export has the rows).
                  "model_usage": model_usage},
        checkpoint_version=task.checkpoint_version, event_seq=task.event_seq, heartbeat_at=task.heartbeat_at,
        worker=WorkerOut(host=task.worker_host, pid=task.worker_pid) if running else None, error=task.error,
        started_at=task.started_at, finished_at=task.finished_at, control=task.control,
        control_requested_at=task.control_requested_at, control_acknowledged_at=task.control_acknowledged_at,
        activities=task.activities, paused_by_limit=task.paused_by_limit,
        actions=task_actions.as_list(task_actions.available(task, user)), stack=task.stack or [],
        waiting_for=task.waiting_for or [], unreviewed_effects=task.unreviewed_effects,
        review_waits=[ReviewWaitOut(kind=w.kind, count=w.count, since=w.since, waiting_seconds=round(w.seconds, 1))
                      for w in task.review_waits],
        steps=steps)


def audit_out(a) -> AuditOut:
    return AuditOut(id=a.pk, at=a.at, actor=a.actor_name, ip=a.ip, action=a.action, before=a.before,
                    after=a.after, reason=a.reason)


def review_out(item) -> ReviewOut:
    entry = item.wal_entry
    proposal = item.proposal or {}
    return ReviewOut(
        id=item.pk, kind=item.kind, task_id=item.task_id, task_type=item.task.type, task_status=item.task.status,
        status=item.status, reason=item.reason, dead_worker=item.dead_worker, detected_at=item.detected_at,
        step_id=item.step, tool=item.tool, args=entry.args if entry else proposal.get("arguments"),
        idempotency_key=entry.idempotency_key if entry else "",
        intent_written_at=entry.created_at if entry else None, wal_status=entry.status if entry else "",
        proposal=item.proposal, evidence=item.evidence, decision=item.decision, decision_result=item.decision_result,
        note=item.note, decided_by=item.decided_by.username if item.decided_by else None, decided_at=item.decided_at,
        approval=approval_out(item) if item.kind == ReviewKind.APPROVAL else None)


def approval_out(item) -> ApprovalOut:
    standing = review_approvals.standing_arguments(item)
    return ApprovalOut(
        arguments=standing, arguments_sha256=arguments_digest(standing), expires_at=item.expires_at,
        on_expiry=item.on_expiry, escalate_to=item.escalate_to, expired_at=item.expired_at,
        escalated_at=item.escalated_at, approvals_required=item.approvals_required,
        approvals=[ApprovalVoteOut(reviewer=v.reviewer_name, decision=v.decision, arguments_sha256=v.arguments_sha256,
                                   at=v.at) for v in item.votes.all()])
