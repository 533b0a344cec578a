"""shell.run: a subprocess in its own process group, killed (the whole group) when the
step's token is cancelled, so no descendant survives a Stop. Idempotent only when the
caller says the command is (`"idempotent": true`, e.g. a stage that rewrites its output).

Outcome classes: a command that could not start, or exited non-zero, is *not performed*
(by convention a failing command reports its failure; retry); one killed by its timeout
or by a cancellation while running is *outcome unknown* (it may have done part or all of
its work)."""
import os
import signal
import subprocess
import threading
import time

from ..primitives.cancellation import Cancelled
from .base import OutcomeUnknown, Tool, ToolError, register

OUTPUT_TAIL = 4000
TERM_GRACE_SECONDS = 1.0


class CommandTimedOut(ToolError):
    """The command ran past its timeout and was killed."""


def kill_group(proc: subprocess.Popen, grace: float = TERM_GRACE_SECONDS) -> None:
    """SIGTERM the process group, then SIGKILL whatever is left after `grace` seconds."""
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


def run_in_group(argv: list[str], *, token, cwd: str | None = None, env: dict | None = None,
                 timeout: float | None = None) -> subprocess.CompletedProcess:
    """Run argv in a new session; cancel or timeout kills the whole group."""
    token.raise_if_cancelled()
    proc = subprocess.Popen(argv, cwd=cwd, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    with token.track("subprocess", f"pid {proc.pid}: {' '.join(argv)[:150]}"):
        # Killing takes up to TERM_GRACE_SECONDS: do it off the cancelling thread (the
        # runner's supervisor), which must keep heartbeating and reporting.
        unregister = token.on_cancel(
            lambda reason: threading.Thread(target=kill_group, args=(proc,), name=f"kill-{proc.pid}",
                                            daemon=True).start())
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            stdout, stderr = proc.communicate()
            raise CommandTimedOut(f"{argv[0]} did not finish within {timeout} s and was killed")
        finally:
            unregister()
    token.raise_if_cancelled()
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)


@register
class ShellRun(Tool):
    name = "shell.run"
    description = "Run a command in its own process group: {argv, cwd?, env?, timeout?, idempotent?}."

    def is_idempotent(self, args: dict) -> bool:
        return bool(args.get("idempotent"))

    def validate(self, args: dict) -> None:
        argv = args.get("argv")
        if not argv or not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
            raise ToolError(f"shell.run needs argv as a list of strings; got {argv!r}")

    def perform(self, args: dict, *, key: str, token) -> dict:
        token.raise_if_cancelled()
        try:
            done = run_in_group(args["argv"], token=token, cwd=args.get("cwd"),
                                env={**(args.get("env") or {}), "ORCH_IDEMPOTENCY_KEY": key},
                                timeout=args.get("timeout"))
        except FileNotFoundError as exc:
            raise ToolError(f"{args['argv'][0]} could not be started: {exc}") from exc
        except (CommandTimedOut, Cancelled) as exc:
            raise OutcomeUnknown(f"{args['argv'][0]} was killed while running ({exc}); it may have done some or "
                                 f"all of its work", evidence={"phase": "running", "argv": args["argv"],
                                                               "error": str(exc)}) from exc
        result = {"returncode": done.returncode, "stdout": done.stdout[-OUTPUT_TAIL:],
                  "stderr": done.stderr[-OUTPUT_TAIL:]}
        if done.returncode != 0:
            raise ToolError(f"{args['argv'][0]} exited with {done.returncode}: {done.stderr[-500:].strip()}")
        return result
