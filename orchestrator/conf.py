"""The harness's settings in one place (the ORCH_* environment variables), with defaults."""
from dataclasses import dataclass

from django.conf import settings


@dataclass(frozen=True)
class HarnessSettings:
    @property
    def heartbeat_seconds(self) -> float:
        return settings.ORCH_HEARTBEAT_SECONDS

    @property
    def stale_after_seconds(self) -> float:
        return settings.ORCH_STALE_AFTER_SECONDS

    @property
    def grace_seconds(self) -> float:
        return settings.ORCH_GRACE_SECONDS

    @property
    def snapshot_keep(self) -> int:
        return settings.ORCH_SNAPSHOT_KEEP

    @property
    def max_recovery_attempts(self) -> int:
        return settings.ORCH_MAX_RECOVERY_ATTEMPTS

    @property
    def requeue_after_seconds(self) -> float:
        return settings.ORCH_REQUEUE_AFTER_SECONDS

    @property
    def recovery_timeout_seconds(self) -> float:
        return settings.ORCH_RECOVERY_TIMEOUT_SECONDS

    @property
    def database_retry_seconds(self) -> float:
        return settings.ORCH_DATABASE_RETRY_SECONDS

    @property
    def slice_seconds(self) -> float:
        return settings.ORCH_SLICE_SECONDS

    @property
    def control_poll_seconds(self) -> float:
        return getattr(settings, "ORCH_CONTROL_POLL_SECONDS", 0.05)

    @property
    def default_limits(self) -> dict:
        return {
            "max_steps": settings.ORCH_DEFAULT_MAX_STEPS,
            "max_tokens": settings.ORCH_DEFAULT_MAX_TOKENS,
            "max_seconds": settings.ORCH_DEFAULT_MAX_SECONDS,
            "max_subtasks": settings.ORCH_DEFAULT_MAX_SUBTASKS,
        }

    @property
    def step_max_attempts(self) -> int:
        return settings.ORCH_STEP_MAX_ATTEMPTS

    @property
    def isolate_execution(self) -> bool:
        return settings.ORCH_ISOLATE_EXECUTION

    @property
    def extra_task_type_modules(self) -> list[str]:
        return list(getattr(settings, "ORCH_EXTRA_TASK_TYPES", []))


harness = HarnessSettings()
