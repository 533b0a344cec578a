"""What a step's code receives: params (reads recorded), dependency results, the
cancellation token, effect() through the WAL, and helpers that obey the token."""
import logging
import subprocess
import threading
from typing import Any

from django.db import transaction
from pydantic import BaseModel

from ..tools.shell import run_in_group
from . import wal
from .cancellation import CancellationToken
from .lease import Lease

log = logging.getLogger(__name__)


class TrackedParams:
    """Attribute access to the params that records which keys the step read.

    Recorded reads (not only the declared ones) decide which finished steps a parameter
    edit invalidates.
    """

    def __init__(self, params: BaseModel):
        object.__setattr__(self, "_params", params)
        object.__setattr__(self, "_read", set())

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._params, name)
        if name in type(self._params).model_fields:
            self._read.add(name)
        return value

    def __setattr__(self, name, value):
        raise AttributeError("params are read-only inside a step")

    @property
    def keys_read(self) -> list[str]:
        return sorted(self._read)


class StepContext:
    def __init__(self, *, task_id: int, step_id: str, params: BaseModel, deps: dict[str, Any],
                 lease: Lease, token: CancellationToken, runner=None):
        self.task_id = task_id
        self.step_id = step_id
        self.params = TrackedParams(params)
        self.deps = deps
        self.lease = lease
        self.token = token
        self.completed_effects: list[wal.CompletedEffect] = []
        self.tokens_used = 0
        self._runner = runner
        self._call_index = 0
        self._lock = threading.Lock()

    def effect(self, tool: str, args: dict) -> Any:
        """Perform a side effect through the WAL; returns the tool's result."""
        self.token.raise_if_cancelled()
        with self._lock:
            call_index = self._call_index
            self._call_index += 1
        return wal.perform(lease=self.lease, step_id=self.step_id, call_index=call_index, tool_name=tool,
                           args=args, token=self.token, completed=self.completed_effects)

    def run_subprocess(self, argv: list[str], *, cwd: str | None = None, env: dict | None = None,
                       timeout: float | None = None) -> subprocess.CompletedProcess:
        """A subprocess for pure computation (no side effect), killed with its group on cancel."""
        return run_in_group(argv, token=self.token, cwd=cwd, env=env, timeout=timeout)

    def sleep(self, seconds: float) -> None:
        """Wait, waking at once when cancelled."""
        if self.token.wait(seconds):
            self.token.raise_if_cancelled()

    def use_tokens(self, count: int) -> None:
        """Account LLM tokens against the task's max_tokens limit."""
        self.tokens_used += count

    def progress(self, message: str, **data) -> None:
        """Append a progress event to the task's log (committed at once, shown live)."""
        from .events import append_event
        from .lease import lock_fenced

        with transaction.atomic():
            task = lock_fenced(self.lease)
            append_event(task, "progress", {"step": self.step_id, "message": message, **data})
