"""Cancellation tokens: a tree that records why and when it was cancelled.

A task run has a root token; each step and subtask gets a child. Cancelling a token
cancels every descendant; helpers (subprocess, HTTP, streams) register callbacks that
abort their work as soon as the token is cancelled.
"""
import threading
import time
from collections.abc import Callable


class Cancelled(Exception):
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

    def raise_if_cancelled(self) -> None:
        if self._event.is_set():
            raise Cancelled(self.reason or "cancelled")

    def wait(self, timeout: float) -> bool:
        """Sleep up to `timeout` seconds, waking early on cancellation; True if cancelled."""
        return self._event.wait(timeout)
