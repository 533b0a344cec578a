"""Commands in process groups of their own, in the executor's session: started tracked on the
step's token, killed as a group when it is cancelled or when their block ends, with a clean
environment. What tools/shell.py (the shell.run tool) and tools/sandbox.py (bubblewrap) build on,
apart from both so that neither imports the other's module to get it."""
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from .base import ToolError

TERM_GRACE_SECONDS = 1.0


class CommandTimedOut(ToolError):
    """The command ran past its timeout and was killed."""


def kill_group(proc: subprocess.Popen, grace: float = TERM_GRACE_SECONDS) -> None:
    """SIGTERM the process group, then SIGKILL whatever is left after `grace` seconds
    (`grace=0`: SIGKILL at once, one signal to the whole group)."""
    if grace > 0:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.02)
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # also reaches grandchildren that outlived the leader
    except ProcessLookupError:
        pass
    proc.wait()


# What a command started by the harness inherits from the worker's environment: nothing
# that could be a secret (SECRET_KEY, LLM_API_KEY, DATABASE_URL... stay in the worker).
INHERITED_ENVIRONMENT = ("PATH", "HOME", "LANG", "LC_ALL", "TZ", "TMPDIR")


def clean_environment(extra: dict | None = None) -> dict:
    """The environment of an operator's command: the allow-listed variables of the worker's
    own environment, then `extra` (the call's own variables)."""
    env = {name: os.environ[name] for name in INHERITED_ENVIRONMENT if name in os.environ}
    env.setdefault("PATH", os.defpath)
    return {**env, **(extra or {})}


@contextmanager
def process_group(argv: list[str], *, token, label: str | None = None,
                  kill: Callable[[subprocess.Popen], None] = kill_group, **popen_args) -> Iterator[subprocess.Popen]:
    """Start argv in its own process group tracked on the token (as `label`, what the task
    page shows running): cancelling the token kills it (`kill(proc)`: the whole group), and
    so does leaving the block while it still runs."""
    token.raise_if_cancelled()
    # Its own process group (killed as one), but in the executor's session: when the worker
    # and its executor die, the session keeper finds every descendant by that session
    # (engine/processes.py), wherever it was re-parented.
    proc = subprocess.Popen(argv, process_group=0, **popen_args)
    with token.track("subprocess", f"pid {proc.pid}: {(label or ' '.join(argv))[:150]}"):
        # Killing takes up to TERM_GRACE_SECONDS: do it off the cancelling thread (the
        # runner's supervisor), which must keep heartbeating and reporting.
        unregister = token.on_cancel(
            lambda reason: threading.Thread(target=kill, args=(proc,), name=f"kill-{proc.pid}",
                                            daemon=True).start())
        try:
            yield proc
        finally:
            unregister()
            if proc.poll() is None:
                kill(proc)


def run_in_group(argv: list[str], *, token, cwd: str | None = None, env: dict | None = None,
                 timeout: float | None = None) -> subprocess.CompletedProcess:
    """Run argv in a new session with a clean environment (clean_environment() plus `env`);
    cancel or timeout kills the whole group."""
    with process_group(argv, token=token, cwd=cwd, env=clean_environment(env), stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            stdout, stderr = proc.communicate()
            raise CommandTimedOut(f"{argv[0]} did not finish within {timeout} s and was killed")
    token.raise_if_cancelled()
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)
