"""Leases: which worker runs a task, fenced by a rising epoch.

Claiming bumps `lease_epoch`; every later write by the holder (WAL intents, step
checkpoints, heartbeats) is an UPDATE ... WHERE lease_epoch = <mine>. A worker that lost
its lease (it was presumed dead and the task was claimed again) matches zero rows and
stops: it can never commit a step over the new holder's work.
"""
import logging
import os
import socket
import uuid
from dataclasses import dataclass
from datetime import timedelta
from functools import lru_cache

from django.db import connection, transaction
from django.db.models import F, Q
from django.utils import timezone

from ..conf import harness
from ..primitives.errors import StepSignal
from ..models import Task, TaskStatus as S
from . import states

log = logging.getLogger(__name__)


class LeaseLost(StepSignal):
    """This worker's lease epoch is stale: another worker owns the task now."""


LEASE_LOST = "lease lost"  # what a run, or its watchdog, returns when another worker took the task


@dataclass(frozen=True)
class Lease:
    task_id: int
    epoch: int
    owner: str
    host: str
    pid: int

    def fenced(self):
        """Rows of this task that are still ours."""
        return Task.objects.filter(pk=self.task_id, lease_epoch=self.epoch, lease_owner=self.owner)


def worker_identity() -> tuple[str, int, str]:
    host, pid = socket.gethostname(), os.getpid()
    return host, pid, f"{host}:{pid}:{uuid.uuid4().hex[:8]}"


CLAIMABLE = (S.QUEUED, S.RUNNING)


def claim(task_id: int) -> Lease | None:
    """Take the lease on a queued task, or on a running one whose holder went quiet.

    Returns None when someone else holds a live lease, another claimer has the row locked
    (SKIP LOCKED on PostgreSQL), or the task is not runnable.
    """
    return _claim_first(Task.objects.filter(_claimable(task_id)))


def _claimable(task_id: int) -> Q:
    stale_before = timezone.now() - timedelta(seconds=harness.stale_after_seconds)
    return Q(pk=task_id, status__in=CLAIMABLE) & (
        Q(lease_owner="") | Q(heartbeat_at__lt=stale_before) | Q(heartbeat_at__isnull=True))


def _recovering() -> Q:
    return Q(recovering_since__isnull=False, status__in=CLAIMABLE, lease_owner="")


def claim_for_delivery(task_id: int) -> Lease | None:
    """The claim a broker message makes: the task waiting for a worker whose recovery began
    first if there is one, else `task_id` as `claim` takes it — in one locked query.

    A broker message is a turn on a worker slot. The queue is FIFO (Redis) or roughly so (the
    ORM broker), and a recovered task's message goes in at the back: with many tasks queued it
    would wait for all of them — a dead host's tasks would run again minutes later. So the
    worker that gets a message (worker.drive_task) takes, among the tasks waiting for a worker,
    one that is being recovered (`recovering_since` set; the runner clears it once the task is
    going again) before the task the message names. The choice is made when a slot is free,
    not when the message was sent, so it works with any broker and with the messages a
    cluster has already prefetched. It is a claim like any other (compare-and-set, SKIP LOCKED
    on PostgreSQL, a new lease epoch), so fencing is unchanged; the task whose turn it took is
    handed to the broker again (worker.drive_task). One query, not a probe for recovered tasks
    and then the claim: the probe was a transaction of its own on every delivery, and almost
    always found nothing."""
    if connection.vendor == "postgresql":
        return _claim_first_in_one_statement(task_id)
    return _claim_first(Task.objects.filter(_recovering() | _claimable(task_id))
                        .order_by(F("recovering_since").asc(nulls_last=True), "pk"))


def _claim_first_in_one_statement(task_id: int) -> Lease | None:
    """`claim_for_delivery` on PostgreSQL: the same choice (`_recovering() | _claimable(task_id)`,
    the same order) and the same writes as `_claim_first`, as one UPDATE over a locked
    sub-select: one round trip on every broker delivery, where the ORM's read then save were two
    (and building them cost more CPU than the database's work)."""
    host, pid, owner = worker_identity()
    now = timezone.now()
    stale_before = now - timedelta(seconds=harness.stale_after_seconds)
    table = Task._meta.db_table
    statuses = list(CLAIMABLE)
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {table} SET lease_epoch = {table}.lease_epoch + 1, lease_owner = %s, worker_host = %s, "
            f"worker_pid = NULL, heartbeat_at = %s, claimed_at = %s "
            f"FROM (SELECT id, lease_owner FROM {table} "
            f"      WHERE (recovering_since IS NOT NULL AND status = ANY(%s) AND lease_owner = '') "
            f"         OR (id = %s AND status = ANY(%s) "
            f"             AND (lease_owner = '' OR heartbeat_at < %s OR heartbeat_at IS NULL)) "
            f"      ORDER BY recovering_since ASC NULLS LAST, id LIMIT 1 FOR UPDATE SKIP LOCKED) AS chosen "
            f"WHERE {table}.id = chosen.id "
            f"RETURNING {table}.id, {table}.lease_epoch, {table}.checkpoint_version, chosen.lease_owner",
            [owner, host, now, now, statuses, task_id, statuses, stale_before])
        row = cursor.fetchone()
    if row is None:
        return None
    claimed_id, epoch, version, previous = row
    log.info("claimed task", extra={"task_id": claimed_id, "lease_epoch": epoch, "worker": owner,
                                    "checkpoint_version": version,
                                    "resume_strategy": "takeover" if previous else "fresh"})
    return Lease(task_id=claimed_id, epoch=epoch, owner=owner, host=host, pid=pid)


# A recovered task unclaimed this long is waiting for a slot, not for its message: an idle
# worker takes a message within one broker poll (Q_CLUSTER poll = 0.05 s; Redis pushes it).
RECOVERED_WAITING_AFTER = timedelta(seconds=0.1)


def recovered_waiting():
    """Recovered tasks that wait for a worker slot (a probe of the partial index on
    `recovering_since`, almost always empty; the supervisor's poll asks the same, written out
    in its query: `poll`)."""
    return Task.objects.filter(_recovering(), enqueued_at__lt=timezone.now() - RECOVERED_WAITING_AFTER)


POLL_FIELDS = ("control", "lease_epoch", "lease_owner", "inbox_seq", "recovered_waiting")


def poll(task_id: int) -> dict | None:
    """What a run's supervisor looks at every ORCH_CONTROL_POLL_SECONDS, in one query: the task's
    control request, lease and inbox sequence, and whether recovered tasks wait for a slot
    (recovered_waiting). Written out: at 20 polls a second the ORM's building of it (~1 ms of
    Python each) took the interpreter from the run's own thread (bench/agent.py: ~0.7 ms per step)."""
    waiting_since = connection.ops.adapt_datetimefield_value(timezone.now() - RECOVERED_WAITING_AFTER)
    with connection.cursor() as cursor:
        cursor.execute(_poll_sql(), [*CLAIMABLE, waiting_since, task_id])
        row = cursor.fetchone()
    return dict(zip(POLL_FIELDS, row[:4] + (bool(row[4]),))) if row else None


@lru_cache(maxsize=None)
def _poll_sql() -> str:
    quote = connection.ops.quote_name
    table = quote(Task._meta.db_table)
    claimable = ", ".join(["%s"] * len(CLAIMABLE))
    return (f"SELECT control, lease_epoch, lease_owner, inbox_seq, EXISTS (SELECT 1 FROM {table} r "
            f"WHERE r.recovering_since IS NOT NULL AND r.status IN ({claimable}) AND r.lease_owner = '' "
            f"AND r.enqueued_at < %s) FROM {table} WHERE id = %s")


def should_yield_to_recovered(task_id: int) -> bool:
    """Whether the run of `task_id` should give its worker slot to a recovered task.

    Running first among waiting tasks (claim_for_delivery) is not enough when every slot is busy:
    a dead host's tasks would wait for whole runs elsewhere to end their slices (ORCH_SLICE_SECONDS).
    So while recovered tasks wait for a slot, as many running tasks as there are such waiting
    ones end their slice at their next step boundary. They are chosen among the runs that have
    held their slot for a heartbeat at least (a recovered task that just got a slot must not
    give it up again), the lowest ids first, so the choice is the same in every runner and no
    more slots than needed change hands (the yielding task is queued again, like any sliced
    one). Asked only while some recovered task waits."""
    waiting = recovered_waiting().count()
    if not waiting:
        return False
    settled = (Task.objects.filter(status=S.RUNNING,
                                   claimed_at__lt=timezone.now() - timedelta(seconds=harness.heartbeat_seconds))
               .exclude(lease_owner=""))
    if not settled.filter(pk=task_id).exists():
        return False
    return settled.filter(pk__lt=task_id).count() < waiting


def _claim_first(candidates) -> Lease | None:
    """Lock the first of `candidates` nobody else has locked, and make this worker its holder
    with a new lease epoch."""
    host, pid, owner = worker_identity()
    with transaction.atomic():
        task = candidates.select_for_update(skip_locked=True).first()
        if task is None:
            return None
        previous = task.lease_owner
        task.lease_epoch += 1
        # worker_pid is set by the process that executes the steps, when it starts.
        task.lease_owner, task.worker_host, task.worker_pid = owner, host, None
        task.heartbeat_at = task.claimed_at = timezone.now()
        # The status becomes `running` when the executor starts (engine/checkpoint.py).
        task.save(update_fields=["lease_epoch", "lease_owner", "worker_host", "worker_pid", "heartbeat_at",
                                 "claimed_at"])
    log.info("claimed task", extra={"task_id": task.pk, "lease_epoch": task.lease_epoch, "worker": owner,
                                    "checkpoint_version": task.checkpoint_version,
                                    "resume_strategy": "takeover" if previous else "fresh"})
    return Lease(task_id=task.pk, epoch=task.lease_epoch, owner=owner, host=host, pid=pid)


def heartbeat(lease: Lease, activities: list[dict] | None = None) -> bool:
    """Refresh the heartbeat (and, when given, what is running now: the task page shows
    those steps as running without a commit per step); False when the lease is no longer ours."""
    fields = {"heartbeat_at": timezone.now()}
    if activities is not None:
        fields["activities"] = activities
    return lease.fenced().update(**fields) == 1


def lock_fenced(lease: Lease) -> Task:
    """Lock the task row and check the lease inside the current transaction."""
    task = states.lock_task(lease.task_id)
    if task.lease_epoch != lease.epoch or task.lease_owner != lease.owner:
        raise LeaseLost(f"task {lease.task_id}: lease epoch {lease.epoch} is stale (now {task.lease_epoch})")
    return task


# The task row if the lease is still the holder's (named parameters task_id, epoch, owner); the
# fence of hold_fenced, and of the WAL's one-statement records (engine/wal.py) as a CTE.
FENCE_ROW_SQL = (f"SELECT id FROM {Task._meta.db_table} "
                 f"WHERE id = %(task_id)s AND lease_epoch = %(epoch)s AND lease_owner = %(owner)s")


def hold_fenced(lease: Lease) -> None:
    """The fence of a write that needs nothing of the task row (a dialog row, a ledger row):
    the row locked for the rest of the transaction if the lease is still ours, else LeaseLost;
    lock_fenced's guarantee without reading the row (on SQLite the IMMEDIATE transaction holds
    the write lock already)."""
    if not transaction.get_connection().in_atomic_block:
        raise transaction.TransactionManagementError("hold_fenced() must run inside transaction.atomic()")
    lock = " FOR UPDATE" if connection.features.has_select_for_update else ""
    with connection.cursor() as cursor:
        cursor.execute(FENCE_ROW_SQL + lock, {"task_id": lease.task_id, "epoch": lease.epoch, "owner": lease.owner})
        if cursor.fetchone() is None:
            raise LeaseLost(f"task {lease.task_id}: lease epoch {lease.epoch} is stale")


def bump_fenced(lease: Lease, **updates) -> None:
    """A fenced UPDATE in the current transaction; raises LeaseLost when the epoch is stale.

    On PostgreSQL the UPDATE (with nothing to update, a SELECT ... FOR UPDATE) takes the row
    lock, so what the transaction does next is serialised with the sweeper and other claimers.
    A claimer that waited for the lock then sees the heartbeat the supervisor last wrote.
    """
    if not updates and connection.vendor == "postgresql":
        # With nothing to write, lock the row without a new version of it: heartbeat_at is
        # indexed, so writing it would add an entry to each of the task's indexes.
        hold_fenced(lease)
        return
    # On SQLite a write takes the database's write lock: refreshing the heartbeat is the fenced write.
    if lease.fenced().update(**(updates or {"heartbeat_at": timezone.now()})) != 1:
        raise LeaseLost(f"task {lease.task_id}: lease epoch {lease.epoch} is stale")

