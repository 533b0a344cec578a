"""Cold recovery: find running tasks whose worker went quiet and hand them to another.

A task is stale when its heartbeat is older than ORCH_STALE_AFTER_SECONDS. The sweeper
re-queues it; the next worker's claim bumps the lease epoch (fencing the old worker if it
comes back) and continues from the last checkpoint. Pending WAL entries are settled when
the step runs again: idempotent effects replay with the same key, non-idempotent ones in
doubt send the task to review (engine/wal.py). Safe with several sweepers at once: the
re-queue is a compare-and-set on the stale heartbeat.

Each sweep also
- re-sends queued tasks nobody claimed for ORCH_REQUEUE_AFTER_SECONDS: the broker's message
  may be lost (a Redis restart, a crash between commit and send); a compare-and-set on
  `enqueued_at` makes one sweeper send it, and a claim ignores duplicates;
- bounds recoveries: a task whose recovery began more than ORCH_RECOVERY_TIMEOUT_SECONDS ago
  and that no runner has got going again becomes `needs_human` (and its operators are told);
- tells operators of stalled tasks, once per stall (engine/stalls.py).
"""
import logging
import time
from datetime import timedelta

from django.db import connection, transaction
from django.db.models import Q
from django.utils import timezone

from .. import telemetry
from ..conf import harness
from ..outage import DATABASE_DOWN, OutageWatch
from ..models import IdempotencyRecord, Task, TaskStatus as S, WalEntry, WalStatus
from . import retention, reviews, scheduler, stalls, states, stranded, wal
from .events import append_event
from ..tasktypes import get_type
# Bounding a recovery has a module of its own; each sweep calls it from here.
from .recovery_timeout import give_up_slow_recoveries

log = telemetry.ContextLogger(logging.getLogger(__name__))  # recovery's fields also reach its span

SWEEPABLE = (S.RUNNING, S.PAUSING, S.STOPPING)
WAITING = (S.QUEUED, S.RUNNING)  # with no lease holder: waiting for a worker to claim it


def log_fields(task: Task) -> dict:
    """The context every recovery line carries (docs/recovery.md, "Logs and traces"): the task, the
    checkpoint it resumes from, its last progress event (the one the action wrote, when it
    wrote one), its recovery attempts and lease epoch."""
    return {"task_id": task.pk, "checkpoint_version": task.checkpoint_version, "event_id": task.event_seq,
            "recovery_attempt": task.recovery_attempts, "lease_epoch": task.lease_epoch}


def stale_tasks(now=None):
    """Tasks whose lease holder went quiet: running ones, and claimed ones whose executor
    never started. A task with no lease holder is not stale whatever its heartbeat says:
    it is waiting for a worker (between time slices, or after a recovery), and
    `requeue_unclaimed` sees to it without counting a recovery attempt."""
    cutoff = (now or timezone.now()) - timedelta(seconds=harness.stale_after_seconds)
    return Task.objects.filter(heartbeat_at__lt=cutoff, status__in=(*SWEEPABLE, S.QUEUED)).exclude(lease_owner="")


def stale_candidate(task_id: int, *, wait: bool = False):
    """The task, locked, if it is still stale (`wait`: for another holder's lock, else skip it).
    The stale conditions are on the locked row itself, not in a subquery: on PostgreSQL a row
    another sweeper recovered (and committed) while this statement ran is re-checked against
    its new version (lease_owner "" is not stale) only for the row's own conditions, while a
    `pk IN (subquery)` keeps the subquery's old snapshot, and the task was recovered twice
    (seen in CI: 3 sweepers, 30 stale tasks, one recovery event too many)."""
    return stale_tasks().select_for_update(skip_locked=not wait).filter(pk=task_id)


def sweep(requeue_budget: float | None = None, requeue: bool = True) -> list[int]:
    """One pass: recover every stale task (returns the ids recovered by this sweeper), give
    up on recoveries that took too long, and (when `requeue`) re-send unclaimed queued tasks
    (for at most `requeue_budget` seconds, when given)."""
    recovered = []
    for task_id in stale_tasks().values_list("pk", flat=True)[:500]:
        if recover_task(task_id):
            recovered.append(task_id)
    give_up_slow_recoveries()
    wake_expired_waits()
    reviews.expire_due()
    if requeue:
        requeue_unclaimed(budget=requeue_budget)
    stalls.sweep()  # tells operators of a stalled task once per stall (engine/stalls.py)
    return recovered


def wake_expired_waits(now=None) -> list[int]:
    """Waiting tasks whose wait's deadline passed: queued again (the step then gets
    WaitTimedOut). The deadline is in the database, so it survives any restart."""
    now = now or timezone.now()
    woken = []
    for task_id in Task.objects.filter(status=S.WAITING, waiting_until__lte=now).values_list("pk", flat=True)[:500]:
        with transaction.atomic():
            task = states.lock_task(task_id)
            if task.status != S.WAITING or not task.waiting_until or task.waiting_until > now:
                continue
            states.transition(task, S.QUEUED, reason="the wait's deadline passed")
            scheduler.enqueue(task.pk)
        woken.append(task_id)
        log.info("wait timed out: re-queued", extra={**log_fields(task), "resume_strategy": "wait_timed_out"})
    return woken


# Rows read per query of `requeue_unclaimed` (it reads the next page when a pass has budget left).
REQUEUE_PAGE = 500
_REQUEUE_FIELDS = ("pk", "enqueued_at", "checkpoint_version", "event_seq", "recovery_attempts", "lease_epoch")


def _oldest_unclaimed(cutoff):
    """Tasks waiting for a worker, unclaimed since before `cutoff`, longest-waiting first, read a
    page at a time (keyset: no page is skipped or read twice while the rows change under it).
    Rows with no `enqueued_at` (handed over before the column existed) come first, by id."""
    unclaimed = Task.objects.filter(status__in=WAITING, lease_owner="")
    last_pk = 0
    while True:
        rows = list(unclaimed.filter(enqueued_at__isnull=True, updated_at__lt=cutoff, pk__gt=last_pk)
                    .order_by("pk").values_list(*_REQUEUE_FIELDS)[:REQUEUE_PAGE])
        yield from rows
        if len(rows) < REQUEUE_PAGE:
            break
        last_pk = rows[-1][0]
    after = None
    while True:
        page = unclaimed.filter(enqueued_at__lt=cutoff)
        if after is not None:
            page = page.filter(Q(enqueued_at__gt=after[1]) | Q(enqueued_at=after[1], pk__gt=after[0]))
        rows = list(page.order_by("enqueued_at", "pk").values_list(*_REQUEUE_FIELDS)[:REQUEUE_PAGE])
        yield from rows
        if len(rows) < REQUEUE_PAGE:
            return
        after = rows[-1][:2]


def requeue_unclaimed(now=None, budget: float | None = None) -> list[int]:
    """Re-send tasks waiting for a worker that nobody claimed for ORCH_REQUEUE_AFTER_SECONDS:
    `queued` ones, and `running` ones with no lease holder (between time slices, or
    recovered) — their broker message may be lost (a Redis restart; messages a dead host's
    cluster had taken from the broker but not started, its prefetch).

    `budget` (seconds) stops it early; the rest are re-sent by the next pass. With a long
    queue every queued task is unclaimed for that long, and re-sending them all took the loop
    seconds per pass (about 40 re-sends/s on a loaded 2-core machine, 1,000 tasks queued:
    bench/hosts.py), during which no stale task was recovered.

    Oldest first, so that budget never starves anyone: the task that has waited longest since
    its last hand-over goes first, and a re-sent task's `enqueued_at` becomes now, behind every
    task not yet re-sent. Each pass thus goes on where the previous one stopped, and every
    stranded task is re-sent within ceil(stranded / re-sends per pass) passes, whatever the
    backlog. (It used to take the 500 newest by id: under a backlog the same new tasks were
    re-sent pass after pass, and an old task whose message a dead host had taken was never
    re-sent.) A re-sent message joins the back of the broker's queue, where a task whose message
    was merely waiting loses nothing. But a task whose message a cluster took and never ran (a
    dead host's prefetch) would wait behind a whole backlog: those are told apart by one look
    at the broker per pass (stranded.py) and go first: re-sent ahead of every message waiting
    (scheduler.send_first)."""
    now = now or timezone.now()
    stop_at = time.monotonic() + budget if budget is not None else None
    cutoff = now - timedelta(seconds=harness.requeue_after_seconds)
    sent = []
    view = None
    for task_id, enqueued_at, checkpoint_version, event_seq, attempts, epoch in _oldest_unclaimed(cutoff):
        if stop_at is not None and time.monotonic() > stop_at:
            break
        if view is None:
            view = stranded.look() or False  # once per pass, and only when there is something to re-send
        first = bool(view) and view.stranded(task_id, enqueued_at)
        if not first and view and view.in_broker(task_id, enqueued_at):
            continue  # its message waits in the broker: a copy behind it would add nothing
        # Compare-and-set: of several sweepers, one re-sends it.
        if Task.objects.filter(pk=task_id, status__in=WAITING, lease_owner="", enqueued_at=enqueued_at).update(
                enqueued_at=now):
            (scheduler.send_first if first else scheduler.send)(task_id)
            sent.append(task_id)
            log.info("queued task not claimed: re-sent to the broker"
                     + (" first: its message was taken by a worker cluster and never run" if first else ""),
                     extra={"task_id": task_id, "checkpoint_version": checkpoint_version, "event_id": event_seq,
                            "recovery_attempt": attempts, "lease_epoch": epoch,
                            "resume_strategy": "requeue_stranded" if first else "requeue_unclaimed",
                            "waited_seconds": round((now - enqueued_at).total_seconds(), 1) if enqueued_at else None})
    return sent


def recovery_candidates(task_id: int, dead_lease=None):
    """The row recover_task locks: the dead lease's task, or the task if its heartbeat is stale."""
    if dead_lease is not None:
        # The worker that saw its executor die waits for the row: skipping it when a sweeper
        # or an operator holds it for a moment would leave the task to the next stale sweep.
        return Task.objects.select_for_update().filter(
            pk=task_id, lease_epoch=dead_lease.epoch, status__in=(*SWEEPABLE, S.QUEUED))
    return stale_candidate(task_id)


def finish_operator_request(task: Task, *, dead_worker: str, extra: dict) -> bool:
    """Outstanding operator requests finish here: nobody is running the task any more.
    True when the task had one (it is now stopped, paused or terminated)."""
    target = {S.STOPPING: S.STOPPED, S.PAUSING: S.PAUSED}.get(task.status)
    if not (target or task.control == "terminate"):
        return False
    target = S.TERMINATED if task.control == "terminate" else target
    reason = f"worker {dead_worker} died; {task.control} completed by recovery"
    if target in states.TERMINAL:
        # What the dead worker had in flight is unknown, and an ended task replays
        # nothing: a reviewer says what happened. (A paused task settles its WAL
        # when its steps run again on resume.)
        reason += in_doubt_note(settle_pending_wal(task, dead_worker=dead_worker, cause=reason,
                                                   extra=extra, ended=True))
    states.transition(task, target, reason=reason, action="recovery", lease_owner="", control="",
                      activities=[])
    log.info("recovery: settled operator request", extra={**extra, "event_id": task.event_seq,
                                                          "resume_strategy": target})
    return True


@telemetry.traced_recovery
def recover_task(task_id: int, *, dead_lease=None, cause: str = "", count_attempt: bool = True) -> bool:
    """Recover one task whose worker is gone: found stale by a sweeper, or reported dead
    (`dead_lease`) by the worker that watched its executor die. An orderly worker shutdown
    does not count against ORCH_MAX_RECOVERY_ATTEMPTS (`count_attempt=False`)."""
    with transaction.atomic():
        task = recovery_candidates(task_id, dead_lease).first()
        if task is None:
            # Say what state it saw: recovered by another sweeper, or alive after all.
            seen = Task.objects.filter(pk=task_id).first()
            log.debug("recovery: nothing to do", extra={**(log_fields(seen) if seen else {"task_id": task_id}),
                                                        "resume_strategy": "none"})
            return False  # recovered by another sweeper, or alive after all
        attempt = task.recovery_attempts + (1 if count_attempt else 0)
        dead_worker = task.lease_owner
        cause = cause or f"heartbeat of {dead_worker or 'its worker'} older than {harness.stale_after_seconds:g} s"
        extra = {"task_id": task.pk, "checkpoint_version": task.checkpoint_version, "event_id": task.event_seq,
                 "recovery_attempt": attempt, "lease_epoch": task.lease_epoch}
        if attempt > harness.max_recovery_attempts:
            states.transition(task, S.NEEDS_HUMAN, action="recovery", lease_owner="",
                              reason=f"recovery attempts exhausted ({attempt - 1}); last cause: {cause}")
            log.warning("recovery: needs a human", extra={**extra, "event_id": task.event_seq,
                                                          "resume_strategy": "needs_human"})
            return True
        if finish_operator_request(task, dead_worker=dead_worker, extra=extra):
            return True
        # Fence the dead worker now (epoch + 1), even before the next one claims.
        task.recovery_attempts, task.lease_owner = attempt, ""
        task.lease_epoch += 1
        task.heartbeat_at = timezone.now()
        task.recovering_since = task.recovering_since or task.heartbeat_at
        task.save(update_fields=["recovery_attempts", "lease_owner", "lease_epoch", "heartbeat_at",
                                 "recovering_since", "updated_at"])
        append_event(task, "recovery", {"attempt": attempt, "dead_worker": dead_worker, "cause": cause,
                                        "checkpoint_version": task.checkpoint_version})
        extra["event_id"] = task.event_seq  # the recovery event
        in_doubt = settle_pending_wal(task, dead_worker=dead_worker, cause=cause, extra=extra)
        if in_doubt:
            states.transition(task, S.AWAITING_REVIEW, action="recovery",
                              reason=f"{len(in_doubt)} side effect(s) in doubt after worker {dead_worker} died")
            log.warning("recovery: awaiting review", extra={**extra, "event_id": task.event_seq,
                                                            "resume_strategy": "awaiting_review"})
            return True
        problem = resources_problem(task)
        if problem:
            states.transition(task, S.NEEDS_HUMAN, action="recovery", reason=f"cannot continue: {problem}")
            log.warning("recovery: resources invalid", extra={**extra, "event_id": task.event_seq,
                                                              "resume_strategy": "needs_human"})
            return True
        if task.status != S.RUNNING and task.status != S.QUEUED:
            states.transition(task, S.QUEUED, action="recovery", reason="re-queued after recovery")
        scheduler.enqueue(task.pk)
    log.info("recovery: re-queued from checkpoint", extra={**extra, "event_id": task.event_seq,
                                                           "resume_strategy": "requeue_from_checkpoint"})
    return True


def any_pending(task_id: int) -> bool:
    """Whether the task has an effect whose outcome is not recorded yet (`pending`)."""
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT 1 FROM {WalEntry._meta.db_table} WHERE task_id = %s AND status = %s LIMIT 1",
                       [task_id, WalStatus.PENDING])
        return cursor.fetchone() is not None


def settle_pending_wal(task: Task, *, dead_worker: str, cause: str, extra: dict, ended: bool = False) -> list:
    """Decide what to do with each side effect the dead (or stopped) worker left `pending`.

    - its key is in the idempotency store: it happened; reuse the recorded result;
    - the tool is idempotent and the task goes on: leave it pending; the step replays it
      with the same key;
    - otherwise the tool's probe asks the other side (wal.probe_entry): `done` or `not_done`
      settle it (a `not_done` is performed again with the same key when the task goes on);
    - and what the probe cannot tell nobody knows: open a review item (never guess). On a
      task that has `ended` (stopped, terminated) nothing replays anything, so an idempotent
      effect in doubt is reviewed too: the decision records what happened, nothing runs.
    Returns the entries put in front of a reviewer. Runs in the caller's transaction.
    """
    opened = []
    if not any_pending(task.pk):
        return opened  # the common case at every task's end, answered by one plain statement
    for entry in WalEntry.objects.filter(task=task, status=WalStatus.PENDING).order_by("id"):
        record = IdempotencyRecord.objects.filter(key=entry.idempotency_key).first()
        # Callers outside recovery (finishing.py, the watchdog) pass only what they hold.
        log_extra = {**log_fields(task), **extra, "wal_entry_id": entry.pk}
        if record is not None:
            wal.settle(entry.pk, WalStatus.DONE, result=record.result)
            log.info("recovery: effect recorded in the idempotency store; reusing its result",
                     extra={**log_extra, "resume_strategy": "reuse_recorded_result"})
        elif entry.idempotent and not ended:
            log.info("recovery: idempotent effect will be replayed with the same key",
                     extra={**log_extra, "resume_strategy": "replay_idempotent"})
        elif (probed := wal.probe_entry(entry)).settled:
            log.info("recovery: effect in doubt settled by its probe (%s)", probed.state,
                     extra={**log_extra, "resume_strategy": f"probe_{probed.state}"})
        else:
            log.info("recovery: effect in doubt; opening a review item",
                     extra={**log_extra, "resume_strategy": "open_review"})
            worker = dead_worker or entry.worker
            if ended:
                why = (f"The task ended ({cause}) while worker {worker} had {entry.tool} in flight: the "
                       f"intent was written at {entry.created_at:%Y-%m-%d %H:%M:%S} UTC and its outcome never "
                       f"recorded. The task has ended and runs nothing again: say whether it happened, for the "
                       f"record (the audit log and the export).")
            else:
                why = (f"Worker {worker} stopped ({cause}) after writing the intent for {entry.tool} at "
                       f"{entry.created_at:%Y-%m-%d %H:%M:%S} UTC and before recording its outcome. {entry.tool} "
                       f"is not idempotent: repeating it could do it twice, skipping it could lose it.")
            reviews.effect_open(entry=entry, dead_worker=worker, reason=why, evidence={"probe": probed.how})
            opened.append(entry)
    return opened


def in_doubt_note(opened: list) -> str:
    """What a task's status reason adds when it ended with effects in front of a reviewer."""
    if not opened:
        return ""
    return (f"; {len(opened)} side effect(s) in doubt wait for review "
            f"({', '.join(entry.idempotency_key for entry in opened)})")


def resources_problem(task: Task) -> str:
    """The task type's own check of its external resources, before it continues."""
    try:
        get_type(task.type).validate_resources(task)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return ""


def sweep_loop(interval: float | None = None) -> None:
    SweepLoop(interval).run()


class SweepLoop:
    """The sweeper process's loop, one pass per `tick`."""

    def __init__(self, interval: float | None = None):
        self.interval = interval or max(0.5, harness.heartbeat_seconds)
        self.database = OutageWatch(log, "sweeper")
        self.recover_after = 0.0
        self.retained_at = None
        # Recovering stale tasks is what a dead host's tasks wait for, so it runs every pass.
        # Re-sending unclaimed messages (lost ones are rare, and wait ORCH_REQUEUE_AFTER_SECONDS
        # anyway) runs ten times per that window at most, and for one interval per pass: with a
        # long queue it has work every time, and doing it every pass doubled the time a dead
        # host's tasks waited to be noticed (bench/hosts.py).
        self.requeue_every = max(self.interval, harness.requeue_after_seconds / 10)
        self.requeue_at = 0.0

    def run(self) -> None:
        while True:
            self.tick()
            time.sleep(self.interval)

    def tick(self) -> None:
        try:
            if self.database.down:
                # Back from an outage? Nobody could heartbeat during it: live workers get one
                # stale period to beat again before their tasks count as abandoned. Decided
                # before this pass recovers anything (it used to be set after the first pass
                # that got through, and that pass recovered a live task whose worker had not
                # beaten yet: seen in CI, a loaded machine).
                connection.ensure_connection()
                self.recover_after = time.monotonic() + harness.stale_after_seconds
                self.database.succeeded()
            requeue = time.monotonic() >= self.requeue_at
            if requeue:
                self.requeue_at = time.monotonic() + self.requeue_every
            if time.monotonic() >= self.recover_after:
                sweep(requeue_budget=self.interval, requeue=requeue)
            elif requeue:
                requeue_unclaimed(budget=self.interval)
            if retention.due_now(self.retained_at):
                self.retained_at = timezone.now()
                retention.run(self.retained_at)
        except DATABASE_DOWN as exc:
            self.database.failed(exc)
        except Exception:
            log.exception("sweep failed; trying again")
        else:
            self.database.succeeded()
