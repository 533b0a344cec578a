"""Process trees on Linux: find and kill every descendant, so a Force-terminate leaves
nothing running — including grandchildren that started their own sessions.

The worker process makes itself a *child subreaper*: a descendant whose parent dies is
re-parented to the worker (not to init), so it stays findable in the worker's tree.

That covers an executor that dies while its worker lives. When the worker itself dies
(kill -9, OOM), the executor dies with it (PR_SET_PDEATHSIG) but its subprocesses, and
theirs, are re-parented to init, out of every tree we know. A *session keeper* covers that
case: a tiny process forked once by each worker and kept across its tasks, holding one end of a
pipe whose other end only the worker holds, told which executor's session it guards. The executor runs in a session of its own, and its
subprocesses stay in that session (their own process groups, not their own sessions), so
when the pipe breaks (the worker is gone) the keeper kills every process of that session,
wherever it was re-parented. A descendant that starts a session of its own (a daemonizing
script) escapes it; the sandbox's bubblewrap does too, and dies with its parent by itself
(--die-with-parent).
"""
import ctypes
import os
import signal
import time

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
PR_SET_CHILD_SUBREAPER = 36
_libc = ctypes.CDLL(None, use_errno=True)
_keepers: set[int] = set()  # this process's session keepers: kill_tree leaves them to finish their job


def _prctl(option: int, value: int) -> None:
    if _libc.prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}) failed")


def become_subreaper() -> None:
    _prctl(PR_SET_CHILD_SUBREAPER, 1)


def die_with_parent() -> None:
    """SIGKILL this process when its parent (the worker) dies."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _fields(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (state first), or None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name may hold spaces and parentheses: fields start after the last ')'.
    return data[data.rindex(")") + 2:].split()


def _stat(pid: int) -> tuple[int, str] | None:
    """(ppid, state) of a process, or None if it is gone."""
    fields = _fields(pid)
    return None if fields is None else (int(fields[1]), fields[0])


def session_members(sid: int) -> list[int]:
    """Living (non-zombie) processes of session `sid`."""
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _fields(int(entry))
            if fields and fields[0] != "Z" and int(fields[3]) == sid:
                members.append(int(entry))
    return members


def descendants(root: int) -> list[int]:
    """Living (non-zombie) descendants of `root`, parents before children.

    Read from each process's children lists (/proc/<pid>/task/<tid>/children): a few small
    files for a worker's usual tree (its executor and keeper), where scanning every process of
    the machine cost ~2 ms after every task run. Kernels without those lists are scanned."""
    if not os.path.exists(f"/proc/{root}/task/{root}/children"):
        return _descendants_by_scan(root)
    found, frontier = [], [root]
    while frontier:
        for child in _children(frontier.pop()):
            stat = _stat(child)
            if stat is not None and stat[1] != "Z":
                found.append(child)
            frontier.append(child)  # a zombie's children are re-parented, but may not be yet
    return found


def _children(pid: int) -> list[int]:
    """The children of every thread of `pid` (a child belongs to the thread that forked it)."""
    children = []
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:  # gone
        return []
    for tid in threads:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                children.extend(int(c) for c in f.read().split())
        except OSError:
            pass
    return children


def _descendants_by_scan(root: int) -> list[int]:
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


def kill_tree(root: int, *, include_root: bool = True, sparing: frozenset[int] | set[int] = frozenset(),
              timeout: float = 2.0) -> list[int]:
    """SIGKILL `root` and all its descendants until none is left; returns the pids killed.
    The processes in `sparing` are left alive (their descendants are not).

    Stopping them first (SIGSTOP) keeps a process from forking new children between the
    scan and the kill.
    """
    def targets() -> list[int]:
        found = ([root] if include_root and alive(root) else []) + descendants(root)
        return [pid for pid in found if pid not in _keepers and pid not in sparing]

    killed = _kill_until_gone(targets, timeout)
    reap_children()
    return killed


def kill_session(sid: int, *, timeout: float = 2.0) -> list[int]:
    """SIGKILL every process of session `sid` until none is left; returns the pids killed."""
    return _kill_until_gone(lambda: [pid for pid in session_members(sid) if pid != os.getpid()], timeout)


def _kill_until_gone(find, timeout: float) -> list[int]:
    killed: list[int] = []
    deadline = time.monotonic() + timeout
    while True:
        targets = find()
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
    return killed


class SessionKeeper:
    """Kills every process of the session it guards (an executor's) if this process dies
    without releasing it first (see the module doc). One per worker process, started on first
    use and kept across its tasks (a fork per task cost as much as the executor's own):

        keeper = processes.keeper()
        keeper.guard(executor_pid)
        try: ... watch the executor ...
        finally: keeper.release()

    Fork the executor before calling guard(), and have the executor drop its copy of the pipe's
    write end (forget_keeper()), so that only this process holds it: its death reads as EOF."""

    def __init__(self):
        read_end, self._write_end = os.pipe()  # non-inheritable: an exec'd descendant never holds it
        self.pid = os.fork()
        if self.pid == 0:
            _keep(read_end)  # never returns
        os.close(read_end)
        self.owner = os.getpid()
        self.stopped = False
        _keepers.add(self.pid)

    def guard(self, sid: int) -> None:
        """From now on, this process's death kills session `sid`."""
        self._tell(b"g%d\n" % sid)

    def release(self) -> None:
        """This process is done with the session (it killed what was left): left alone."""
        self._tell(b"r\n")

    def _tell(self, word: bytes) -> None:
        os.write(self._write_end, word)  # a line is far below PIPE_BUF: written whole

    def forget(self) -> None:
        """In a forked child (the executor): drop the inherited write end without a word. A
        stopped keeper's end is closed already (its number may be another descriptor's now)."""
        if not self.stopped:
            os.close(self._write_end)

    def stop(self) -> None:
        """Release and end the keeper (this process goes on without one)."""
        if self.stopped:
            return
        self.stopped = True
        try:
            self._tell(b"q\n")
        except OSError:  # the keeper was killed (by hand): nothing to tell it
            pass
        finally:
            os.close(self._write_end)
        deadline = time.monotonic() + 2.0
        try:
            while os.waitpid(self.pid, os.WNOHANG)[0] == 0:
                if time.monotonic() > deadline:
                    os.kill(self.pid, signal.SIGKILL)
                    os.waitpid(self.pid, 0)
                    break
                time.sleep(0.005)
        except ChildProcessError:  # already collected (reap_children)
            pass
        _keepers.discard(self.pid)


_keeper: SessionKeeper | None = None


def keeper() -> SessionKeeper:
    """This process's session keeper, started now if it has none (or its keeper is gone)."""
    global _keeper
    if _keeper is not None and (_keeper.owner != os.getpid() or _keeper.stopped or not alive(_keeper.pid)):
        if _keeper.owner == os.getpid():
            _keeper.stop()  # killed by hand: collected, a new one starts
        _keeper = None
    if _keeper is None:
        _keeper = SessionKeeper()
    return _keeper


def guard_session(sid: int) -> SessionKeeper:
    """Have this process's keeper guard session `sid` (a new keeper if the old one is gone)."""
    try:
        guarding = keeper()
        guarding.guard(sid)
    except OSError:  # it died between the look and the word
        guarding = keeper()
        guarding.guard(sid)
    return guarding


def forget_keeper() -> None:
    """In a child just forked from a worker (the executor): drop the worker's keeper pipe."""
    global _keeper
    if _keeper is not None:
        _keeper.forget()
        _keeper = None


def _keep(read_end: int) -> None:
    """The keeper's life: follow the worker's words (guard a session, release it, quit) until
    its death (EOF); then kill the session it guarded, if any."""
    code = 0
    try:
        os.setsid()  # out of the worker's process group: a Ctrl-C to it does not reach the keeper
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        # Hold nothing of the worker's (its broker and database sockets, its queues' pipes,
        # the pipe's write end): only the read end, so that the worker's death reads as EOF.
        os.closerange(3, read_end)
        os.closerange(read_end + 1, os.sysconf("SC_OPEN_MAX"))
        _libc.prctl(PR_SET_NAME, ctypes.c_char_p(b"orch-keeper"), 0, 0, 0)  # what ps shows
        guarded = None
        with os.fdopen(read_end, "rb", buffering=0) as words:
            buffered = b""
            while True:
                chunk = words.read(256)  # blocks until a word or the worker's death
                if not chunk:
                    break
                buffered += chunk
                *lines, buffered = buffered.split(b"\n")
                for line in lines:
                    if line.startswith(b"g"):
                        guarded = int(line[1:])
                    elif line == b"r":
                        guarded = None
                    elif line == b"q":
                        os._exit(0)
        if guarded is not None:  # EOF: the worker died holding the session
            kill_session(guarded)
    except BaseException:
        code = 1
    finally:
        os._exit(code)
