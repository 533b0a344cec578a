"""The write-ahead-log protocol for side effects.

1. Commit a WalEntry `pending` (fenced on the lease) with the tool, args and a
   deterministic idempotency key: task, step, call index — the same on replay. The look
   for an earlier execution and the intent are one transaction.
2. Perform the effect, passing the key to the tool.
3. Record `done` with the result (or `failed` with the error) in the step's checkpoint
   (two commits: intent, checkpoint); a step that raises after the effect still commits it.

How a tool's failure is read (tools/base.py):
- ToolError: *not performed* (nothing reached the other side, or it refused before
  accepting): the entry is `failed`, the step retries with the same key.
- Cancelled raised by the tool: cancelled before anything left: as not performed.
- OutcomeUnknown, or any other exception (fail closed): the request may have reached the
  other side. An idempotent tool retries with the same key; a non-idempotent one stays
  `pending` with the error recorded and raises AmbiguousEffect: the task goes to review,
  exactly as if its worker had died in the middle of the call.

Before anyone is asked, a tool's *probe* asks the other side (probe_entry(); tools/base.py
Tool.probe): `done` settles the entry done with the probe's result, `not_done` settles it
failed (performed again with the same key), and only `unknown` goes to review. Entries a
probe settled carry settled_by="probe" (counted on the review queue's page).

A *transactional* tool (its effect is writes in the harness's own database: db.upsert)
commits intent, effect, idempotency record and `done` in one transaction, never in doubt (on
PostgreSQL, for a tool whose writes are SQL, one statement); at_commit=True makes that
transaction the step's checkpoint (engine/at_commit.py).

Before performing, the WAL and the idempotency store are consulted: a recorded result is
reused, never performed twice. A `pending` entry found on re-execution means an earlier
attempt died in doubt: idempotent tools replay it; non-idempotent ones must not guess and
raise AmbiguousEffect (the task goes to review).
"""
import json
import logging
from functools import lru_cache
from typing import Any

from django.db import DatabaseError, IntegrityError, connection, transaction
from django.utils import timezone

from .. import telemetry
from ..models import IdempotencyRecord, WalEntry, WalStatus
from ..tools.base import OutcomeUnknown, ProbeResult, ToolError, validate_call
from ..tools.catalog import get_tool
from ..primitives.cancellation import Cancelled
from ..primitives.faults import armed as armed_faults, fault_point
from ..primitives import storable
from .lease import FENCE_ROW_SQL, Lease, LeaseLost, bump_fenced
from .prepared import prepared_cursor
# The protocol's terms, named wal.* by their callers.
from .wal_terms import AmbiguousEffect, CompletedEffect, EffectFailed, idempotency_key

log = logging.getLogger(__name__)


def by_key(queryset):
    """The row a unique key selects, without the model's default ordering: `.first()` would
    add ORDER BY task, id, and PostgreSQL may then walk that index instead of the key's."""
    rows = list(queryset.order_by()[:1])
    return rows[0] if rows else None


def _recorded(entry: WalEntry | None, key: str, tool_name: str, completed: list) -> tuple[bool, Any]:
    """What an earlier execution already settled for this key: (found, result)."""
    if entry is None:
        # A key can only be in the idempotency store once its intent was written: on a
        # first execution there is nothing more to look up.
        return False, None
    if entry.status == WalStatus.DONE:
        return True, entry.result  # decided by a reviewer, or recorded before a crash
    if entry.status == WalStatus.SKIPPED:
        return True, None  # a reviewer decided the task goes on without this effect
    recorded = by_key(IdempotencyRecord.objects.filter(key=key))
    if recorded is not None:
        completed.append(CompletedEffect(entry.pk, key, tool_name, recorded.result))
        return True, recorded.result
    return False, None


@telemetry.traced_effect
def perform(*, lease: Lease, step_id: str, call_index: int, tool_name: str, args: dict, token,
            completed: list[CompletedEffect], generation: int = 0) -> Any:
    """Run one side effect under the WAL protocol; append it to `completed` when it happened."""
    tool = get_tool(tool_name)
    validate_call(tool, args)
    key = idempotency_key(lease.task_id, step_id, call_index, generation)
    if tool.transactional:
        return _perform_in_transaction(lease=lease, step_id=step_id, call_index=call_index, tool=tool, args=args,
                                       key=key, token=token, completed=completed)

    # Look for an earlier execution and write the intent in one transaction (one commit).
    with transaction.atomic():
        entry = by_key(WalEntry.objects.filter(idempotency_key=key))
        found, result = _recorded(entry, key, tool_name, completed)
        if found:
            return result
        if entry is not None and entry.status == WalStatus.PENDING and not tool.is_idempotent(entry.args):
            raise AmbiguousEffect(entry)
        fault_point("before_intent", step_id)
        bump_fenced(lease)  # a worker whose lease is stale writes no intent
        if entry is None:
            entry = new_entry(lease, step_id, call_index, tool_name, tool.wal_args(args), key, tool.is_idempotent(args))
        elif entry.status == WalStatus.FAILED:
            # A failed effect did not happen: the retry reuses the entry (and its key).
            settle(entry.pk, WalStatus.PENDING, error="")
    log.debug("wal intent", extra={"task_id": lease.task_id, "step_id": step_id, "wal_entry_id": entry.pk})
    fault_point("after_intent", step_id)
    try:
        result = tool.perform(args, key=key, token=token)  # tools hold the "during_effect" fault point
    except (ToolError, Cancelled) as exc:  # not performed: retrying with the same key is safe
        mark_failed(entry.pk, exc)
        if isinstance(exc, Cancelled):
            raise
        raise EffectFailed(entry.pk, exc) from exc
    except Exception as exc:
        return _outcome_unknown(exc, entry=entry, lease=lease, step_id=step_id, key=key, tool_name=tool_name,
                                completed=completed)
    fault_point("after_effect", step_id)
    result = storable.value(result)  # recorded at the step's commit: no NUL (PostgreSQL stores none)
    completed.append(CompletedEffect(entry.pk, key, tool_name, result))
    return result


def _outcome_unknown(exc: Exception, *, entry: WalEntry, lease: Lease, step_id: str, key: str, tool_name: str,
                     completed: list[CompletedEffect]) -> Any:
    """The tool raised something that does not say the effect did not happen: its outcome is
    unknown. An idempotent effect is replayed with its key (the step retries); otherwise its
    probe asks the other side, and what the probe cannot settle waits for a reviewer."""
    unknown = exc if isinstance(exc, OutcomeUnknown) else OutcomeUnknown(
        f"{tool_name} raised an unexpected {type(exc).__name__}: {exc}; whether it took effect is unknown",
        evidence={"error": f"{type(exc).__name__}: {exc}"})
    if entry.idempotent:
        # A replay with the same key cannot duplicate it: the step retries. The entry stays
        # `pending`, not `failed` (= did not happen): if the task ends before a replay
        # settles it (Stop, Force-terminate, a failure policy), whoever ends it treats it
        # as any effect in doubt on an ended task: its probe, else a reviewer (found by
        # the soak: keyed POSTs cut by Stop were left "did not happen" with nobody asked).
        mark_unknown(entry.pk, unknown)
        raise EffectFailed(entry.pk, unknown) from exc
    mark_unknown(entry.pk, unknown)
    # Ask the other side before anyone else is asked (outside any transaction: the probe is I/O).
    probed = probe_entry(entry)
    if probed.state == ProbeResult.DONE:
        completed.append(CompletedEffect(entry.pk, key, tool_name, probed.result, committed=True))
        return probed.result
    if probed.state == ProbeResult.NOT_DONE:
        raise EffectFailed(entry.pk, ToolError(f"{unknown}; then {probed.how}")) from exc
    log.warning("effect outcome unknown: waiting for review",
                extra={"task_id": lease.task_id, "step_id": step_id, "wal_entry_id": entry.pk})
    raise AmbiguousEffect(entry, reason=f"{unknown}. {tool_name} is not idempotent: repeating it could do it "
                                        f"twice, skipping it could lose it.",
                          evidence={"failure": str(unknown), **unknown.evidence, "probe": probed.how}) from exc


class _RecordedEarlier(Exception):
    """The key already has a WAL entry (an earlier execution's): the effect just made rolls back."""


def _perform_in_transaction(*, lease, step_id, call_index, tool, args, key, token, completed) -> Any:
    """A tool whose effect is writes in the harness's own database: its intent, the effect,
    its idempotency record and its `done` commit together — all or nothing, never in doubt.
    The tool's writes run first; then one statement (fenced on the lease) records the entry
    `done` and the key: a stale lease rolls the effect back with it.

    On PostgreSQL the common case goes first: a key with no entry yet (a first execution) needs
    no read before the effect, because the record's insert finds a key an earlier execution took
    and the effect then rolls back before the entry is read, as on SQLite (a read saved per effect)."""
    if connection.vendor == "postgresql":
        try:
            if tool.commits_with_step and tool.fits_in_commit(args) and not connection.in_atomic_block:
                written, result = _in_one_statement(lease=lease, step_id=step_id, call_index=call_index, tool=tool,
                                                    args=args, key=key, completed=completed)
                if written:
                    return result
            return _in_one_transaction(lease=lease, step_id=step_id, call_index=call_index, tool=tool, args=args,
                                       key=key, token=token, completed=completed, look_first=False)
        except _RecordedEarlier:
            log.info("wal: key recorded by an earlier execution; effect rolled back",
                     extra={"task_id": lease.task_id, "step_id": step_id})
    return _in_one_transaction(lease=lease, step_id=step_id, call_index=call_index, tool=tool, args=args, key=key,
                               token=token, completed=completed, look_first=True)


def _in_one_statement(*, lease, step_id, call_index, tool, args, key, completed) -> tuple[bool, Any]:
    """A tool whose writes are SQL (Tool.commits_with_step: db.upsert): the effect, its entry
    `done` and its key in one autocommitted statement (_record_sql), flushed: one
    round trip instead of BEGIN, the write, the record and COMMIT. _RecordedEarlier when an
    earlier execution took the key; (False, None) when it wrote nothing otherwise (the lease
    went, a value was refused): the transaction's way then says which."""
    faults = armed_faults()  # read once for this effect's four fault points (crash tests)
    fault_point("before_intent", step_id, faults=faults)
    try:
        body, values = tool.commit_sql(args, fence="EXISTS (SELECT 1 FROM t)", prefix="e_")
    except Exception:  # noqa: BLE001 - a value refused: the transaction's way reports it
        return False, None
    # The transaction's fault points, in its order: nothing is written yet, as after its rollback.
    fault_point("during_effect", step_id, faults=faults)
    fault_point("after_intent", step_id, faults=faults)
    result = tool.planned_result(args)
    try:
        _, entry_id = _run_record_sql(lease, step_id=step_id, call_index=call_index, tool=tool, args=args, key=key,
                                      result=result, now=timezone.now(), effect_body=body, effect_values=values)
    except IntegrityError as exc:  # nothing of it was written (one statement)
        if WalEntry.objects.filter(idempotency_key=key).exists():
            raise _RecordedEarlier(key) from exc
        return False, None  # a constraint of the tool's table: the transaction's way reports it
    except DatabaseError:  # nothing of it was written (one statement)
        return False, None
    if entry_id is None:
        return False, None
    fault_point("after_effect", step_id, faults=faults)
    completed.append(CompletedEffect(entry_id, key, tool.name, result, committed=True))
    return True, result


def _in_one_transaction(*, lease, step_id, call_index, tool, args, key, token, completed, look_first: bool) -> Any:
    with transaction.atomic():
        entry = None
        if look_first:
            entry = by_key(WalEntry.objects.filter(idempotency_key=key))
            found, result = _recorded(entry, key, tool.name, completed)
            if found:
                return result
        fault_point("before_intent", step_id)
        try:
            result = storable.value(tool.perform(args, key=key, token=token))  # its writes join this transaction
        except Cancelled:
            raise  # rolled back: nothing happened
        except Exception as exc:  # rolled back too: the effect did not happen; the step retries
            raise EffectFailed(entry.pk if entry else 0, exc) from exc
        fault_point("after_intent", step_id)  # a crash here rolls the effect back with the record
        entry_id = _record_done(lease, entry, step_id=step_id, call_index=call_index, tool=tool, args=args, key=key,
                                result=result)
    fault_point("after_effect", step_id)
    completed.append(CompletedEffect(entry_id, key, tool.name, result, committed=True))
    return result


_LEASE_FENCE = FENCE_ROW_SQL + " FOR UPDATE"  # the task row locked on the lease, read for nothing else


@lru_cache(maxsize=256)
def _record_sql(effect_body: str = "") -> str:
    """PostgreSQL: one statement fenced on the lease (`t`) that records an effect's entry `done`
    and its key (done_sql, one new entry); with `effect_body` (a data-modifying CTE fenced on `t`),
    the effect too. Returns (the fence's row, the new entry's id). A key an earlier execution took
    fails the whole statement (the entry's unique key): nothing of it is written."""
    effect = f", e AS ({effect_body})" if effect_body else ""
    return f"WITH t AS ({_LEASE_FENCE}){effect}{done_sql()}\nSELECT (SELECT id FROM t), (SELECT id FROM n)"


def _run_record_sql(lease: Lease, *, step_id, call_index, tool, args, key, result, now, effect_body: str = "",
                    effect_values: dict | None = None) -> tuple[int | None, int | None]:
    record = {"key": key, "tool": tool.name, "result": result, "step_id": step_id, "call_index": call_index,
              "args": tool.wal_args(args), "idempotent": tool.is_idempotent(args)}
    with prepared_cursor() as cursor:
        cursor.execute(_record_sql(effect_body), {
            **(effect_values or {}), "task_id": lease.task_id, "epoch": lease.epoch, "owner": lease.owner,
            "now": now, "worker": f"{lease.host}:{lease.pid}", "effects": done_parameter([], [record])})
        return cursor.fetchone()


def _record_done(lease: Lease, entry: WalEntry | None, *, step_id, call_index, tool, args, key, result) -> int:
    """In the effect's transaction: the entry `done` with its result, and the key recorded."""
    now = timezone.now()
    if entry is None and connection.vendor == "postgresql":
        try:
            fenced, entry_id = _run_record_sql(lease, step_id=step_id, call_index=call_index, tool=tool, args=args,
                                               key=key, result=result, now=now)
        except IntegrityError as exc:  # the entry's unique key: an earlier execution took it
            raise _RecordedEarlier(key) from exc
        if fenced is None:
            raise LeaseLost(f"task {lease.task_id}: lease epoch {lease.epoch} is stale")
        return entry_id
    bump_fenced(lease)  # a worker whose lease is stale writes nothing (and its effect rolls back)
    if entry is None:
        entry = new_entry(lease, step_id, call_index, tool.name, tool.wal_args(args), key, tool.is_idempotent(args))
    settle(entry.pk, WalStatus.DONE, result=result, error="", now=now)
    IdempotencyRecord.objects.bulk_create([IdempotencyRecord(key=key, tool=tool.name, result=result)],
                                          ignore_conflicts=True)
    return entry.pk


def new_entry(lease: Lease, step_id: str, call_index: int, tool_name: str, args: dict, key: str,
              idempotent: bool) -> WalEntry:
    """The intent row (the caller's transaction is fenced on the lease)."""
    return WalEntry.objects.create(task_id=lease.task_id, step_id=step_id, call_index=call_index, tool=tool_name,
                                   args=args, idempotency_key=key, idempotent=idempotent, lease_epoch=lease.epoch,
                                   worker=f"{lease.host}:{lease.pid}")


_KEEP = object()  # settle(): a column left as it is


def settle(entry_id: int, status: str, *, result: Any = _KEEP, error: str | None = None, settled_by: str = "",
           only_pending: bool = False, now=None) -> int:
    """The one writer of WalEntry.status (tests/engine/test_one_writer.py): entry `entry_id`
    becomes `status`, completed now (`pending` again: not completed), with `result`, `error`
    and `settled_by` when given (other columns as they are). `only_pending`: only if it is
    still `pending` (another settler may have been first). Returns the rows changed (0 or 1).
    In the caller's transaction, if any. The PostgreSQL one-statement checkpoint writes `done`
    with done_sql(), from here too."""
    fields: dict[str, Any] = {"status": status,
                              "completed_at": None if status == WalStatus.PENDING else now or timezone.now()}
    if result is not _KEEP:
        fields["result"] = result
    if error is not None:
        fields["error"] = error[:5000]
    if settled_by:
        fields["settled_by"] = settled_by
    rows = WalEntry.objects.filter(pk=entry_id)
    if only_pending:
        rows = rows.filter(status=WalStatus.PENDING)
    return rows.update(**fields)


def mark_failed(entry_id: int, error: Exception) -> None:
    """A `pending` entry did not happen (the tool said so): `failed`, with the error."""
    settle(entry_id, WalStatus.FAILED, error=f"{type(error).__name__}: {error}", only_pending=True)


def mark_unknown(entry_id: int, error: Exception) -> None:
    """The entry stays `pending` (in doubt, exactly as after a crash); the error says why."""
    WalEntry.objects.filter(pk=entry_id, status=WalStatus.PENDING).update(
        error=f"outcome unknown: {error}"[:5000])


def probe_entry(entry: WalEntry) -> ProbeResult:
    """Run the tool's probe for an entry in doubt and record what it settles: `done` → the
    entry done with the probe's result (and its key in the idempotency store, as a reviewer's
    "happened" would), `not_done` → failed (the step performs it again with the same key; an
    ended task does not), both with settled_by="probe"; `unknown` changes nothing. Only a
    `pending` entry is changed (another settler may have been first). In the caller's
    transaction, if any; the probe itself is I/O bounded by PROBE_TIMEOUT_SECONDS."""
    try:
        probed = get_tool(entry.tool).probe(entry.args, key=entry.idempotency_key)
    except Exception as exc:  # a broken probe must never settle anything, nor stop the review
        probed = ProbeResult.unknown(f"the probe failed ({type(exc).__name__}: {exc}): a reviewer decides")
    extra = {"task_id": entry.task_id, "wal_entry_id": entry.pk, "probe": probed.state}
    if probed.state == ProbeResult.DONE:
        with transaction.atomic():
            if settle(entry.pk, WalStatus.DONE, result=probed.result, settled_by="probe",
                      error=f"settled by probe: {probed.how}", only_pending=True):
                IdempotencyRecord.objects.get_or_create(key=entry.idempotency_key,
                                                        defaults={"tool": entry.tool, "result": probed.result})
        log.info("effect in doubt settled by its probe: done", extra=extra)
    elif probed.state == ProbeResult.NOT_DONE:
        settle(entry.pk, WalStatus.FAILED, settled_by="probe", error=f"settled by probe: not done ({probed.how})",
               only_pending=True)
        log.info("effect in doubt settled by its probe: not done", extra=extra)
    return probed


def mark_done(effects: list[CompletedEffect]) -> None:
    """Record completed effects in the current transaction (the step's checkpoint)."""
    effects = [e for e in effects if not e.committed]
    if not effects:
        return
    now = timezone.now()
    for effect in effects:
        settle(effect.entry_id, WalStatus.DONE, result=effect.result, error="", now=now)
    IdempotencyRecord.objects.bulk_create(
        [IdempotencyRecord(key=e.key, tool=e.tool, result=e.result) for e in effects], ignore_conflicts=True)


def done_sql() -> str:
    """mark_done() as CTEs of the one-statement checkpoint (engine/checkpoint.py), after its
    others (hence the leading comma): `effects` (%(effects)s: done_parameter()) recorded `done`
    with their results and keys at %(now)s if the fence `t` returned a row; those with no entry
    yet (written by the statement itself: engine/at_commit.py, _record_sql) get one."""
    return """, effects AS (
    SELECT * FROM jsonb_to_recordset(%(effects)s::jsonb) AS e(id bigint, key text, tool text, result jsonb,
                                                                step_id text, call_index int, args jsonb, idempotent boolean)
), w AS (
    UPDATE {wal} SET status = 'done', result = effects.result, completed_at = %(now)s, error = ''
    FROM effects WHERE {wal}.id = effects.id AND EXISTS (SELECT 1 FROM t)
), n AS (
    INSERT INTO {wal} (task_id, step_id, call_index, tool, args, idempotency_key, idempotent, status, result, error,
                       lease_epoch, worker, created_at, completed_at, settled_by)
    SELECT %(task_id)s, step_id, call_index, tool, args, key, idempotent, 'done', result, '', %(epoch)s, %(worker)s,
           %(now)s, %(now)s, '' FROM effects WHERE id IS NULL AND EXISTS (SELECT 1 FROM t)
    RETURNING id
), i AS (
    INSERT INTO {idempotency} (key, tool, result, created_at)
    SELECT effects.key, effects.tool, effects.result, %(now)s FROM effects WHERE EXISTS (SELECT 1 FROM t)
    ON CONFLICT (key) DO NOTHING
)""".format(wal=WalEntry._meta.db_table, idempotency=IdempotencyRecord._meta.db_table)


def done_parameter(effects: list[CompletedEffect], new: list[dict] = ()) -> str:
    """The %(effects)s of done_sql(): the effects not yet recorded, and `new` ones (key, tool,
    result, step_id, call_index, args, idempotent) with no entry yet, as JSON."""
    listed = [{"id": e.entry_id, "key": e.key, "tool": e.tool, "result": e.result}
              for e in effects if not e.committed] + [{"id": None, **record} for record in new]
    return json.dumps(listed) if listed else "[]"
