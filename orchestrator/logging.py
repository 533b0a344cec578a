"""Log lines: one JSON object per line (python-json-logger), or `key=value` text.

Every record has `timestamp`, `level`, `logger` and `message`; the task's context fields
(CONTEXT_FIELDS, passed with `extra=`) are added when a record carries them, as is any
other `extra`. `ORCH_LOG_FORMAT=text` selects the human-readable form instead.

Field meanings: `event_id` is the seq of a task's progress event (TaskEvent.seq);
`wal_entry_id` is the id of a WAL entry (WalEntry.pk). `resume_strategy` says what
recovery (or a reviewer) decided: `requeue_from_checkpoint`, `replay_idempotent`,
`reuse_recorded_result`, `open_review`, `awaiting_review`, `needs_human`, the status an
operator request was completed with (`paused`, `stopped`, `terminated`), or `none`.
"""
import logging

from pythonjsonlogger.json import JsonFormatter as _LibraryJsonFormatter

CONTEXT_FIELDS = ("task_id", "step_id", "checkpoint_version", "event_id", "wal_entry_id", "lease_epoch",
                  "resume_strategy", "recovery_attempt", "worker")


class JsonFormatter(_LibraryJsonFormatter):
    """python-json-logger's formatter with this project's field names:
    {"timestamp": ..., "level": ..., "logger": ..., "message": ..., <context fields>}."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("fmt", "%(levelname)s %(name)s %(message)s")
        kwargs.setdefault("rename_fields", {"levelname": "level", "name": "logger"})
        kwargs.setdefault("timestamp", True)  # ISO 8601, UTC
        super().__init__(*args, **kwargs)

    def process_log_record(self, log_data):
        # The time first, for people reading the lines.
        if "timestamp" in log_data:
            log_data = {"timestamp": log_data.pop("timestamp"), **log_data}
        return super().process_log_record(log_data)


class TextFormatter(logging.Formatter):
    """`time LEVEL logger message key=value ...` with the context fields (ORCH_LOG_FORMAT=text)."""

    def format(self, record: logging.LogRecord) -> str:
        base = f"{self.formatTime(record)} {record.levelname} {record.name} {record.getMessage()}"
        fields = " ".join(f"{name}={getattr(record, name)}" for name in CONTEXT_FIELDS if hasattr(record, name))
        text = f"{base} {fields}" if fields else base
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text
