"""Log lines: one JSON object per line (python-json-logger), or `key=value` text.

Every record has `timestamp`, `level`, `logger` and `message`; the task's context fields
(CONTEXT_FIELDS, passed with `extra=`) are added when a record carries them, as is any
other `extra`. `ORCH_LOG_FORMAT=text` selects the human-readable form instead.

Field meanings: `event_id` is the seq of a task's progress event (TaskEvent.seq);
`wal_entry_id` is the id of a WAL entry (WalEntry.pk). `resume_strategy` says what
recovery (or a reviewer) decided: `requeue_from_checkpoint`, `replay_idempotent`,
`reuse_recorded_result`, `open_review`, `awaiting_review`, `needs_human`, the status an
operator request was completed with (`paused`, `stopped`, `terminated`), or `none`.

Secrets never reach a log line: both formatters pass each record through RedactSecrets (the
message with its arguments, and every `extra`), then redact the finished line (an exception's
traceback too). The formatters do it, not a `filters` entry of LOGGING, so that every handler
using them is covered.
"""
import logging

from pythonjsonlogger.json import JsonFormatter as _LibraryJsonFormatter

from .primitives.redaction import redact, redact_text

CONTEXT_FIELDS = ("task_id", "step_id", "checkpoint_version", "event_id", "wal_entry_id", "lease_epoch",
                  "resume_strategy", "recovery_attempt", "worker")


# What every LogRecord has: anything else on a record came with `extra=`.
_RECORD_ATTRIBUTES = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class RedactSecrets(logging.Filter):
    """Replaces the installation's secrets (orchestrator/primitives/redaction.py) in a record's
    message and extras with `[redacted: NAME]`. Keeps every record."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a bad format string: let the handler report it as usual
            return True
        redacted = redact_text(message)
        if redacted != message:
            record.msg, record.args = redacted, None
        for name, value in list(vars(record).items()):
            if name not in _RECORD_ATTRIBUTES and isinstance(value, (str, dict, list, tuple)):
                setattr(record, name, redact(value))
        return True


_redact_record = RedactSecrets()


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

    def format(self, record: logging.LogRecord) -> str:
        _redact_record.filter(record)
        return redact_text(super().format(record))


class TextFormatter(logging.Formatter):
    """`time LEVEL logger message key=value ...` with the context fields (ORCH_LOG_FORMAT=text)."""

    def format(self, record: logging.LogRecord) -> str:
        _redact_record.filter(record)
        base = f"{self.formatTime(record)} {record.levelname} {record.name} {record.getMessage()}"
        fields = " ".join(f"{name}={getattr(record, name)}" for name in CONTEXT_FIELDS if hasattr(record, name))
        text = f"{base} {fields}" if fields else base
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return redact_text(text)
