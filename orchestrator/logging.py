"""Structured log lines: `message key=value ...` with the task's context fields."""
import logging

CONTEXT_FIELDS = ("task_id", "step_id", "checkpoint_version", "event_id", "wal_entry_id", "lease_epoch",
                  "resume_strategy", "recovery_attempt", "worker")


class StructuredFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        base = f"{self.formatTime(record)} {record.levelname} {record.name} {record.getMessage()}"
        fields = " ".join(f"{name}={getattr(record, name)}" for name in CONTEXT_FIELDS if hasattr(record, name))
        text = f"{base} {fields}" if fields else base
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text
