"""Process trees on Linux: find and kill every descendant, so a Force-terminate leaves
nothing running — including grandchildren that started their own sessions.

The worker process makes itself a *child subreaper*: a descendant whose parent dies is
re-parented to the worker (not to init), so it stays findable in the worker's tree.
"""
import ctypes
import os
import signal
import time

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
_libc = ctypes.CDLL(None, use_errno=True)


def _prctl(option: int, value: int) -> None:
    if _libc.prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}) failed")


def become_subreaper() -> None:
    _prctl(PR_SET_CHILD_SUBREAPER, 1)


def die_with_parent() -> None:
    """SIGKILL this process when its parent (the worker) dies."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _stat(pid: int) -> tuple[int, str] | None:
    """(ppid, state) of a process, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name may hold spaces and parentheses: fields start after the last ')'.
    fields = data[data.rindex(")") + 2:].split()
    return int(fields[1]), fields[0]


def descendants(root: int) -> list[int]:
    """Living (non-zombie) descendants of `root`, parents before children."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat and stat[1] != "Z":
                children.setdefault(stat[0], []).append(int(entry))
    found, frontier = [], [root]
    while frontier:
        pid = frontier.pop()
        for child in children.get(pid, []):
            found.append(child)
            frontier.append(child)
    return found


def alive(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[1] != "Z"


def reap_children() -> None:
    """Collect exit statuses of finished children (ours or re-parented to us)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def kill_tree(root: int, *, include_root: bool = True, timeout: float = 2.0) -> list[int]:
    """SIGKILL `root` and all its descendants until none is left; returns the pids killed.

    Stopping them first (SIGSTOP) keeps a process from forking new children between the
    scan and the kill.
    """
    killed: list[int] = []
    deadline = time.monotonic() + timeout
    while True:
        targets = ([root] if include_root and alive(root) else []) + descendants(root)
        if not targets:
            break
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for pid in targets:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        killed.extend(p for p in targets if p not in killed)
        reap_children()
        if time.monotonic() > deadline:
            break
        time.sleep(0.01)
    reap_children()
    return killed
