"""Cancellation tokens: a tree that records why and when it was cancelled.

A task run has a root token; each step and subtask gets a child. Cancelling a token
cancels every descendant; helpers (subprocess, HTTP, streams) register callbacks that
abort their work as soon as the token is cancelled.
"""
import itertools
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from .errors import HarnessError


class Cancelled(HarnessError):
    """Raised inside step code when its token is cancelled."""

    def __init__(self, reason: str):
        super().__init__(f"cancelled: {reason}")
        self.reason = reason


class CancellationToken:
    def __init__(self, name: str = "task", parent: "CancellationToken | None" = None):
        self.name = name
        self.parent = parent
        self.reason: str | None = None
        self.cancelled_at: float | None = None
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._children: list[CancellationToken] = []
        self._callbacks: list[Callable[[str], None]] = []
        # What runs under this tree now (steps, subtasks, subprocesses, requests,
        # streams); kept on the root so the runner can show what is still winding down.
        self.root: CancellationToken = parent.root if parent else self
        if parent is None:
            self._activities: dict[int, dict] = {}
            self._activity_ids = itertools.count(1)
            self.activities_version = 0

    def child(self, name: str) -> "CancellationToken":
        token = CancellationToken(name, parent=self)
        with self._lock:
            self._children.append(token)
            cancelled, reason = self._event.is_set(), self.reason
        if cancelled:
            token.cancel(reason or "parent cancelled")
        return token

    def discard_child(self, token: "CancellationToken") -> None:
        with self._lock:
            if token in self._children:
                self._children.remove(token)

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def cancel(self, reason: str) -> bool:
        """Cancel this token and its descendants; returns False if it already was."""
        with self._lock:
            if self._event.is_set():
                return False
            self.reason, self.cancelled_at = reason, time.time()
            self._event.set()
            children, callbacks = list(self._children), list(self._callbacks)
        for callback in callbacks:
            try:
                callback(reason)
            except Exception:  # one helper failing to abort must not stop the others
                pass
        for child in children:
            child.cancel(reason)
        return True

    def on_cancel(self, callback: Callable[[str], None]) -> Callable[[], None]:
        """Run `callback(reason)` when cancelled (at once if already); returns an unregister."""
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(callback)
                return lambda: self._remove_callback(callback)
        callback(self.reason or "cancelled")
        return lambda: None

    def _remove_callback(self, callback) -> None:
        with self._lock:
            if callback in self._callbacks:
                self._callbacks.remove(callback)

    @contextmanager
    def track(self, kind: str, label: str):
        """Register a running activity (kind: step, subtask, subprocess, http, llm)."""
        root = self.root
        with root._lock:
            activity_id = next(root._activity_ids)
            root._activities[activity_id] = {"kind": kind, "label": label[:200], "since": time.time(),
                                             "token": self.name}
            root.activities_version += 1
        try:
            yield
        finally:
            with root._lock:
                root._activities.pop(activity_id, None)
                root.activities_version += 1

    def activities(self) -> list[dict]:
        root = self.root
        with root._lock:
            return [dict(a) for a in root._activities.values()]

    def raise_if_cancelled(self) -> None:
        if self._event.is_set():
            raise Cancelled(self.reason or "cancelled")

    def wait(self, timeout: float) -> bool:
        """Sleep up to `timeout` seconds, waking early on cancellation; True if cancelled."""
        return self._event.wait(timeout)
