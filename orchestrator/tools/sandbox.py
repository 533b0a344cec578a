"""The sandbox of the agent's `shell_run`: a command under bubblewrap (`bwrap`), or nothing.

What the command gets (docs/sandbox.md):
- a read-only `/usr` (and the `/bin`, `/lib`... links or directories into it), `/proc` of its
  own pid namespace, a minimal `/dev`; a read-only, otherwise empty root: no `/etc`, no
  `/home`, `/root`, `/var`, `/work`, no project files;
- a fresh scratch directory, its working directory and HOME (`/scratch`, `/tmp` links to it),
  removed when the call ends, however it ends;
- no network (its own empty network namespace: only a loopback nobody listens on), no user
  namespaces of its own, a new session (no terminal to inject into);
- an empty environment but PATH, HOME and LANG;
- as an unprivileged user: when the worker runs as root the command runs as SANDBOX_UID, so
  the kernel's limit on processes applies (it is not enforced for root);
- limits: wall time (the call's timeout), CPU seconds, address space, processes, the size of
  each file it writes (ORCH_SANDBOX_*), and the bytes kept of stdout and stderr (each): a
  command writing more is stopped.

Fail closed: when bwrap is missing or cannot set up its namespaces (a probe run once per
process finds out, by bwrap's own failure), the call raises SandboxUnavailable with bwrap's
reason. Nothing ever falls back to running on the host.
"""
import json
import logging
import os
import select
import selectors
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass

from django.conf import settings

from .base import ToolError
from .process_groups import kill_group, process_group

log = logging.getLogger(__name__)

BWRAP = "/usr/bin/bwrap"
PRLIMIT = "/usr/bin/prlimit"  # util-linux; runs inside the sandbox, after the namespaces exist
SANDBOX_UID = SANDBOX_GID = 65534  # nobody/nogroup: who the command runs as when the worker is root
SCRATCH = "/scratch"
SYSTEM_LINKS = ("/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32")
ENVIRONMENT = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": SCRATCH, "LANG": "C.UTF-8"}
READ_CHUNK = 65_536
PROBE_TIMEOUT = 10.0
REMOVE_ATTEMPTS = 20
# bwrap exits with 128 + the signal that killed the command: these two are the kernel's, sent
# at the CPU limit (soft) and at the file size limit.
SIGNALLED_LIMITS = {128 + signal.SIGXCPU: "cpu", 128 + signal.SIGXFSZ: "file_size"}


class SandboxUnavailable(ToolError):
    """The sandbox cannot start here (bwrap missing, or unable to create its namespaces): the
    command is refused, never run on the host."""


class SandboxLimitReached(ToolError):
    """The sandbox stopped the command at one of its limits. Nothing left the sandbox, so it
    was *not performed* as far as the world outside is concerned; `result` holds what it
    printed before it was stopped."""

    def __init__(self, message: str, *, limit: str, result: dict):
        super().__init__(message)
        self.limit = limit
        self.result = result


@dataclass(frozen=True)
class Limits:
    wall_seconds: float
    cpu_seconds: int
    memory_bytes: int
    processes: int
    output_bytes: int

    @classmethod
    def from_settings(cls, timeout: float | None) -> "Limits":
        return cls(wall_seconds=float(timeout or settings.ORCH_SANDBOX_CPU_SECONDS),
                   cpu_seconds=max(1, int(settings.ORCH_SANDBOX_CPU_SECONDS)),
                   memory_bytes=max(1, int(settings.ORCH_SANDBOX_MEMORY_MB)) * 1024 * 1024,
                   processes=max(1, int(settings.ORCH_SANDBOX_PROCESSES)),
                   output_bytes=max(0, int(settings.ORCH_SANDBOX_OUTPUT_BYTES)))


def _drop_privileges() -> dict:
    """Popen arguments that run bwrap (and so the command) as SANDBOX_UID when the worker is
    root: root in the sandbox would keep capabilities inside it and escape RLIMIT_NPROC."""
    if os.geteuid() != 0:
        return {}
    return {"user": SANDBOX_UID, "group": SANDBOX_GID, "extra_groups": []}


def bwrap_argv(scratch: str, command: list[str], limits: Limits, *, info_fd: int | None = None) -> list[str]:
    argv = [BWRAP, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
            "--cap-drop", "ALL", "--clearenv"]
    if info_fd is not None:  # bwrap writes the sandbox's pid there (SandboxKiller)
        argv += ["--info-fd", str(info_fd)]
    for name, value in ENVIRONMENT.items():
        argv += ["--setenv", name, value]
    argv += ["--ro-bind", "/usr", "/usr"]
    for path in SYSTEM_LINKS:
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            argv += ["--ro-bind", path, path]
    argv += ["--proc", "/proc", "--dev", "/dev",
             "--bind", scratch, SCRATCH, "--symlink", SCRATCH, "/tmp", "--chdir", SCRATCH,
             # The root and /dev are tmpfs that bwrap made: read-only, so nothing can fill
             # memory by writing there (the scratch directory is the only writable place).
             "--remount-ro", "/dev", "--remount-ro", "/"]
    # Limits set inside the namespaces: RLIMIT_NPROC then counts the sandbox's processes only.
    # CPU: SIGXCPU at the soft limit (recognisable), SIGKILL a second later.
    argv += ["--", PRLIMIT, f"--cpu={limits.cpu_seconds}:{limits.cpu_seconds + 1}",
             f"--as={limits.memory_bytes}", f"--nproc={limits.processes}", f"--fsize={limits.memory_bytes}",
             "--core=0", "--"]
    return argv + list(command)


def _make_scratch() -> str:
    scratch = tempfile.mkdtemp(prefix="orch-sandbox-")
    if os.geteuid() == 0:
        os.chown(scratch, SANDBOX_UID, SANDBOX_GID)
    return scratch


def _remove_scratch(scratch: str) -> None:
    """Remove the scratch directory whatever the command left in it (directories it made
    unreadable included). After a kill the sandbox's last processes may still be exiting
    (and writing): try again for a moment before giving up with a warning."""
    def make_writable_and_retry(function, path, _exc_info):
        for target in (os.path.dirname(path), path):
            try:
                os.chmod(target, stat.S_IRWXU, follow_symlinks=False)
            except OSError:
                pass
        function(path)

    for attempt in range(REMOVE_ATTEMPTS):
        try:
            shutil.rmtree(scratch, onerror=make_writable_and_retry)
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            if attempt == REMOVE_ATTEMPTS - 1:
                log.warning("sandbox scratch directory %s could not be removed: %s", scratch, exc)
                return
            time.sleep(0.1)


_probed: dict[tuple[str, str], bool] = {}
_probe_lock = threading.Lock()


def ensure_available() -> None:
    """Raise SandboxUnavailable unless bwrap runs here. A success is remembered per process
    (and per binary); a failure is probed again next time, and refused again."""
    key = (BWRAP, PRLIMIT)
    with _probe_lock:
        if _probed.get(key):
            return
        if not os.path.exists(BWRAP):
            raise SandboxUnavailable(f"the sandbox is unavailable: {BWRAP} is not installed (Debian package "
                                     f"bubblewrap); shell_run refuses to run commands outside it")
        scratch = _make_scratch()
        try:
            probe = subprocess.run(bwrap_argv(scratch, ["true"], Limits.from_settings(PROBE_TIMEOUT)),
                                   env={}, stdin=subprocess.DEVNULL, capture_output=True, timeout=PROBE_TIMEOUT,
                                   **_drop_privileges())
        except (OSError, subprocess.SubprocessError) as exc:
            raise SandboxUnavailable(f"the sandbox is unavailable: {BWRAP} could not run ({exc}); shell_run "
                                     f"refuses to run commands outside it") from exc
        finally:
            _remove_scratch(scratch)
        if probe.returncode != 0:
            reason = probe.stderr.decode(errors="replace").strip()[-500:] or f"exit status {probe.returncode}"
            raise SandboxUnavailable(f"the sandbox is unavailable: {BWRAP} failed to set up ({reason}); shell_run "
                                     f"refuses to run commands outside it")
        _probed[key] = True


class SandboxKiller:
    """Kills a sandbox whole, at any moment of its life.

    Killing bwrap is not enough: the sandbox's pid 1 (bwrap's init, in a session of its own)
    binds its life to bwrap's (--die-with-parent) only after setting the sandbox up, so a
    bwrap killed during the setup leaves a sandbox that runs on (4 of 150 quick cancels did,
    SIGTERM or not). bwrap writes that pid 1 to --info-fd as soon as it exists: it is killed
    first (SIGKILL to a namespace's pid 1 kills every process in it), through a pidfd taken
    while bwrap still ran (never a recycled pid), then bwrap's group."""

    def __init__(self):
        self._read_end, self.info_fd = os.pipe()
        self._lock = threading.Lock()
        self._pidfd: int | None = None
        self._read = False

    def started(self, proc: subprocess.Popen) -> None:
        """Take the sandbox's pid as soon as bwrap has made it (a few milliseconds)."""
        self._sandbox_pidfd(proc)

    def _sandbox_pidfd(self, proc: subprocess.Popen) -> int | None:
        with self._lock:
            if not self._read:
                self._read = True
                pid = self._read_pid(proc)
                try:
                    pidfd = os.pidfd_open(pid) if pid else None
                except OSError:
                    pidfd = None
                if pidfd is not None and proc.poll() is not None:  # bwrap gone: the pid may be reused
                    os.close(pidfd)
                    pidfd = None
                self._pidfd = pidfd
            return self._pidfd

    def _read_pid(self, proc: subprocess.Popen) -> int | None:
        """The pid in bwrap's info ({"child-pid": N}), read until it parses; None when bwrap
        ends (or takes PROBE_TIMEOUT) without writing it."""
        data = bytearray()
        deadline = time.monotonic() + PROBE_TIMEOUT
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self._read_end], [], [], 0.05)
            if ready:
                chunk = os.read(self._read_end, 4096)
                data += chunk
                try:
                    return int(json.loads(data)["child-pid"])
                except (ValueError, KeyError, TypeError):
                    if not chunk:
                        return None
            elif proc.poll() is not None:
                return None
        return None

    def kill(self, proc: subprocess.Popen) -> None:
        pidfd = self._sandbox_pidfd(proc)
        if pidfd is not None:
            try:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass
        kill_group(proc, grace=0)

    def close(self) -> None:
        with self._lock:
            for fd in (self._read_end, self.info_fd, self._pidfd):
                if fd is not None and fd != -1:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
            self._read_end = self.info_fd = -1
            self._pidfd = None


def run_sandboxed(command: list[str], *, token, timeout: float | None = None) -> dict:
    """Run `command` in the sandbox: {"returncode", "stdout", "stderr", "stdout_truncated",
    "stderr_truncated"}. A command stopped at a limit raises SandboxLimitReached; a cancelled
    token kills it and raises Cancelled; no sandbox here raises SandboxUnavailable."""
    ensure_available()
    limits = Limits.from_settings(timeout)
    scratch = _make_scratch()
    killer = SandboxKiller()
    try:
        argv = bwrap_argv(scratch, command, limits, info_fd=killer.info_fd)
        with process_group(argv, token=token, label=f"sandbox: {' '.join(command)}", kill=killer.kill, env={},
                           pass_fds=(killer.info_fd,), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, **_drop_privileges()) as proc:
            killer.started(proc)
            with proc.stdout, proc.stderr:
                output, stopped_by, elapsed = _read_bounded(proc, limits, token)
            if stopped_by:
                killer.kill(proc)
            else:
                try:
                    proc.wait(timeout=max(0.0, limits.wall_seconds - elapsed))
                except subprocess.TimeoutExpired:  # it closed its output and went on running
                    killer.kill(proc)
                    stopped_by = "timeout"
        token.raise_if_cancelled()
        result = {"returncode": proc.returncode, **output}
        if not stopped_by:
            stopped_by = SIGNALLED_LIMITS.get(proc.returncode)
    finally:
        killer.close()
        _remove_scratch(scratch)
    if stopped_by:
        raise SandboxLimitReached(_limit_message(command[0], stopped_by, limits, result), limit=stopped_by,
                                  result=result)
    return result


def _read_bounded(proc: subprocess.Popen, limits: Limits, token) -> tuple[dict, str | None, float]:
    """Read stdout and stderr until both close, keeping at most limits.output_bytes of each.
    Returns (output, stopped_by, seconds elapsed): stopped_by is "timeout", "output" or None."""
    started = time.monotonic()
    deadline = started + limits.wall_seconds
    streams = {proc.stdout.fileno(): "stdout", proc.stderr.fileno(): "stderr"}
    kept = {"stdout": bytearray(), "stderr": bytearray()}
    truncated = {"stdout": False, "stderr": False}
    stopped_by = None
    with selectors.DefaultSelector() as selector:
        for fd in streams:
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map() and not stopped_by and not token.cancelled:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                stopped_by = "timeout"
                break
            for key, _ in selector.select(min(remaining, 0.5)):
                chunk = os.read(key.fd, READ_CHUNK)
                if not chunk:
                    selector.unregister(key.fd)
                    continue
                name = streams[key.fd]
                room = limits.output_bytes - len(kept[name])
                kept[name] += chunk[:max(0, room)]
                if len(chunk) > room:
                    truncated[name] = True
                    stopped_by = "output"
                    break
    output = {name: bytes(data).decode("utf-8", errors="replace") for name, data in kept.items()}
    output.update({f"{name}_truncated": flag for name, flag in truncated.items()})
    return output, stopped_by, time.monotonic() - started


def _limit_message(program: str, limit: str, limits: Limits, result: dict) -> str:
    what = {
        "timeout": f"it ran past its {limits.wall_seconds:g} s timeout",
        "output": f"it wrote more than {limits.output_bytes} bytes to "
                  f"{'stdout' if result['stdout_truncated'] else 'stderr'} (ORCH_SANDBOX_OUTPUT_BYTES); the first "
                  f"{limits.output_bytes} bytes are kept",
        "cpu": f"it used its {limits.cpu_seconds} s of CPU (ORCH_SANDBOX_CPU_SECONDS)",
        "file_size": f"it wrote a file larger than {limits.memory_bytes} bytes (ORCH_SANDBOX_MEMORY_MB)",
    }[limit]
    tail = result["stderr"][-300:].strip()
    return f"{program} was stopped in the sandbox: {what}" + (f". stderr: {tail}" if tail else "")
