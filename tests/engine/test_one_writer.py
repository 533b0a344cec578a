"""One writer per durable record (issue 23, item 2): the statements that write a WAL entry's
status, a task's progress `seq` (Task.event_seq), its `inbox_pending` counter and its status
(a task changes status only in `states.transition`) are in their owner module only. Other modules call the owner (wal.settle, events.reserve /
reserve_locked / reserve_sql, inbox_counter.added / consumed / reject_pending); the one-statement
checkpoint takes its SQL fragments from the owners (wal.done_sql, events.reserve_sql).

The source of orchestrator/ and review/ (migrations aside) is searched with the patterns
below; a write outside its owner fails the test with its file and line.
"""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("orchestrator", "review")

# The arguments of one call, up to one level of nested parentheses (a call, an f-string's
# `type(error)`), across lines.
ARGS = r"(?:[^()]|\([^()]*\))*?"
WRITING_CALL = r"\.(?:update|create|update_or_create|get_or_create|bulk_update)\("


def column_writes(column: str) -> list[str]:
    """Patterns for statements writing an integer column of Task through the ORM or SQL."""
    name = re.escape(column)
    return [
        rf"\.{name}\s*(?:\+=|-=|=(?!=))",  # task.event_seq += 1 (saved by a save())
        rf"\b{name}\s*=\s*(?:F\(|{name}\b|-?\d)",  # event_seq=F(...), SQL "event_seq = event_seq + 1", =0
        rf"\bF\(\s*[\"']{name}[\"']\s*\)",  # F("event_seq") anywhere
        rf"update_fields\s*=\s*[\[(][^\])]*[\"']{name}[\"']",  # save(update_fields=[..., "event_seq"])
        rf"{WRITING_CALL}{ARGS}\b{name}\s*=",  # .update(..., event_seq=seq)
        rf"[\"']{name}[\"']\s*:",  # {"event_seq": ...} (an update(**fields))
    ]


TASK_TABLE = r"(?:\{task\}|\{TABLES\[[\"']task[\"']\]\}|\{[^{}]*Task\._meta\.db_table[^{}]*\}|\"?orchestrator_task\b\"?)"
TASK_STATUS = r"(?:S|TaskStatus)\."

WAL_TABLE = r"(?:\{wal\}|\{TABLES\[[\"']wal[\"']\]\}|\{[^{}]*WalEntry\._meta\.db_table[^{}]*\}|\"?orchestrator_walentry\b)"

RECORDS = {
    "WalEntry.status": ("orchestrator/engine/wal.py", [
        rf"{WRITING_CALL}{ARGS}\bstatus\s*=\s*WalStatus\.",  # .update(status=WalStatus.DONE), .create(...)
        r"WalEntry\.objects\b[^\n]*\.update\(" + ARGS + r"\bstatus\s*=",  # WalEntry.objects...update(status=...)
        r"\.status\s*=\s*WalStatus\.",  # entry.status = WalStatus.DONE (saved by a save())
        r"[\"']status[\"']\s*:\s*WalStatus\.",  # {"status": WalStatus.DONE} (an update(**fields))
        rf"(?i:\bUPDATE\s+{WAL_TABLE}|\bINSERT\s+INTO\s+{WAL_TABLE})",  # raw SQL writing the WAL table
    ]),
    "Task.event_seq (the progress seq)": ("orchestrator/engine/events.py", column_writes("event_seq")),
    "Task.inbox_pending": ("orchestrator/engine/inbox_counter.py", column_writes("inbox_pending")),
    # A task's status changes only in a transition (checked against the table of allowed ones,
    # evented and audited); a new task starts with the model's default, `queued`.
    "Task.status (a task's transitions)": ("orchestrator/engine/states.py", [
        r"\btask\.status\s*=(?!=)",  # task.status = S.RUNNING (saved by a save())
        rf"\.status\s*=\s*{TASK_STATUS}",  # other.status = TaskStatus.DONE
        rf"{WRITING_CALL}{ARGS}\bstatus\s*=\s*{TASK_STATUS}",  # .update(status=S.QUEUED), .create(...)
        rf"[\"']status[\"']\s*:\s*{TASK_STATUS}",  # {"status": S.QUEUED} (an update(**fields))
        rf"(?i:\bUPDATE\s+{TASK_TABLE}\s+SET\b(?:(?!\bWHERE\b)[\s\S])*?\bstatus\s*=)",  # raw SQL
    ]),
}


def source_files():
    for top in SOURCES:
        for path in sorted((ROOT / top).rglob("*.py")):
            if "migrations" not in path.parts:
                yield path


def writes(text: str, patterns: list[str]) -> list[tuple[int, str]]:
    """(line number, line) of each match of `patterns` in `text`."""
    found = set()
    for pattern in patterns:
        for match in re.finditer(pattern, text):
            found.add(text.count("\n", 0, match.start()) + 1)
    lines = text.splitlines()
    return [(number, lines[number - 1].strip()) for number in sorted(found)]


def second_writers(record: str) -> list[str]:
    owner, patterns = RECORDS[record]
    offenders = []
    for path in source_files():
        relative = path.relative_to(ROOT).as_posix()
        if relative == owner:
            continue
        offenders += [f"{relative}:{number}: {line}" for number, line in writes(path.read_text(), patterns)]
    return offenders


@pytest.mark.parametrize("record", list(RECORDS))
def test_one_module_writes_the_record(record):
    owner = RECORDS[record][0]
    offenders = second_writers(record)
    assert not offenders, (f"{record} is written outside its owner {owner}: call the owner's functions instead\n"
                           + "\n".join(offenders))


@pytest.mark.parametrize("record", list(RECORDS))
def test_the_owner_writes_it(record):
    """The patterns still find the owner's own writes (they have not gone stale)."""
    owner, patterns = RECORDS[record]
    assert writes((ROOT / owner).read_text(), patterns)


# Writes a second writer could make, each of which a pattern must catch; and reads that none
# may flag.
CAUGHT = {
    "WalEntry.status": [
        'WalEntry.objects.filter(pk=entry.pk).update(status=WalStatus.DONE, result=record.result,\n'
        '                                            completed_at=timezone.now())',
        'WalEntry.objects.filter(pk=entry.pk).update(\n    status=WalStatus.FAILED, completed_at=now,\n'
        '    error=f"reviewer: did not happen ({note.strip()[:200]})")',
        'WalEntry.objects.filter(pk=entry.pk).update(status="skipped")',
        'entry.status = WalStatus.DONE',
        'WalEntry.objects.create(task=task, status=WalStatus.DONE, tool=name)',
        'fields = {"status": WalStatus.DONE}',
        "    UPDATE {wal} SET status = 'done', result = effects.result",
        "cursor.execute(f\"UPDATE {TABLES['wal']} SET status = 'done' WHERE id = %s\", [pk])",
        "cursor.execute('UPDATE orchestrator_walentry SET status = %s', ['done'])",
        'INSERT INTO "orchestrator_walentry" (status) VALUES (%s)',
    ],
    "Task.event_seq (the progress seq)": [
        'task.event_seq += 1',
        'Task.objects.filter(pk=task.pk).update(event_seq=F("event_seq") + 1, updated_at=now)',
        'task.save(update_fields=["checkpoint_version", "event_seq",\n                         "updated_at"])',
        "UPDATE {task} SET checkpoint_version = checkpoint_version + 1, event_seq = event_seq + 1,",
        'Task.objects.filter(pk=task.pk).update(heartbeat_at=now, event_seq=seq)',
        'Task.objects.filter(pk=task.pk).update(**{"event_seq": seq})',
    ],
    "Task.inbox_pending": [
        'task.inbox_pending -= len(consumed)',
        'task.inbox_pending = 0',
        'Task.objects.filter(pk=task_id).update(\n    waiting_for=waits, inbox_pending=F("inbox_pending") - 1)',
        'task.save(update_fields=["checkpoint_version", "inbox_pending", "updated_at"])',
        'Task.objects.filter(pk=task.pk).update(inbox_pending=count)',
    ],
}
CAUGHT["Task.status (a task's transitions)"] = [
    'task.status = S.RUNNING',
    'task.status = "queued"',
    'Task.objects.filter(pk=task.pk).update(status=S.QUEUED, lease_owner="")',
    'Task.objects.create(type=type, title=title,\n                    status=S.QUEUED, created_by=None)',
    'Task.objects.filter(pk=pk).update(**{"status": TaskStatus.PAUSED})',
    'parent.status = TaskStatus.FAILED',
    "UPDATE {task} SET heartbeat_at = %s, status = 'running' WHERE id = %s",
    "cursor.execute(f\"UPDATE {TABLES['task']} SET status = %s WHERE id = %s\", ['queued', pk])",
    'UPDATE "orchestrator_task" SET status = %s',
]
READS = [
    'WalEntry.objects.filter(task=task, status=WalStatus.PENDING).order_by("id")',
    'if entry.status == WalStatus.DONE:',
    'WalEntry.objects.filter(pk=entry_id, status=WalStatus.PENDING).update(error=why)',
    'Step.objects.filter(task=task).update(status=StepStatus.SKIPPED)',
    "UPDATE {step} SET status = 'done', result = %(result)s::jsonb",
    'preview = Preview(task_id=task.pk, version=task.event_seq)',
    'if expected_version != task.event_seq:',
    'TaskOut(checkpoint_version=task.checkpoint_version, event_seq=task.event_seq)',
    'row = Task.objects.values("checkpoint_version", "event_seq")',
    'publish_hint(task_id, row["event_seq"], row["status"])',
    "RETURNING checkpoint_version, event_seq, status",
    'if task.inbox_pending >= harness.inbox["pause_at"]:',
    '"inbox": (task.inbox_pending, True) if task.inbox_pending else (None, False),',
    'self.inbox_consumed_at = -1 if task.inbox_pending else task.inbox_seq',
    'Task.objects.filter(status=S.RUNNING, claimed_at__lt=now).exclude(lease_owner="")',
    'if task.status == S.PAUSED:',
    'Task.objects.filter(pk=task_id, status__in=WAITING).update(enqueued_at=now)',
    "UPDATE {task} SET heartbeat_at = %(now)s WHERE id = %(task_id)s AND status = 'running'",
    'states.transition(task, S.QUEUED, reason=why, lease_owner="")',
]


@pytest.mark.parametrize("record", list(RECORDS))
def test_the_patterns_catch_each_kind_of_write(record):
    patterns = RECORDS[record][1]
    missed = [write for write in CAUGHT[record] if not writes(write, patterns)]
    assert not missed, f"not caught as writes of {record}: {missed}"


@pytest.mark.parametrize("record", list(RECORDS))
def test_reads_are_not_writes(record):
    patterns = RECORDS[record][1]
    flagged = [read for read in READS if writes(read, patterns)]
    assert not flagged, f"reads flagged as writes of {record}: {flagged}"
