"""shell.run: a subprocess in its own process group, killed (the whole group) when the
step's token is cancelled, so no descendant survives a Stop; and in the executor's session,
so none survives the death of its worker either (engine/processes.py, SessionKeeper).
Idempotent only when the caller says the command is (`"idempotent": true`, e.g. a stage that
rewrites its output).

Two kinds of command:
- `"sandbox": true` (the agent's shell_run, the model's commands): under bubblewrap with no
  network, no project files, no environment and limits (tools/sandbox.py), or refused when the
  sandbox cannot start. Nothing leaves the sandbox, so such a call is idempotent, and one
  stopped at a limit or cancelled is *not performed*.
- otherwise the operator's own code (demo.pipeline's stage scripts): on the host, with a
  clean environment (INHERITED_ENVIRONMENT, the call's `env`, ORCH_IDEMPOTENCY_KEY), never
  the worker's secrets.

Outcome classes: a command that could not start is *not performed*. One that started and
exited non-zero did work nobody can size (a script may fail after its first write): *outcome
unknown* (a non-idempotent call goes to review; an idempotent one is retried), unless the
step declares `"nonzero_means_not_performed": true` (the command does all or nothing, e.g.
one transaction) — then it is *not performed* and retried. In the sandbox a non-zero exit is
*not performed*: the command can change nothing outside its scratch directory, which is
removed after. One killed by its timeout or by a cancellation while running is *outcome
unknown* (it may have done part or all of its work)."""
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ..primitives.cancellation import Cancelled
from .base import OutcomeUnknown, Tool, ToolError, register

OUTPUT_TAIL = 4000
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


@register
class ShellRun(Tool):
    name = "shell.run"
    description = ("Run a command in its own process group: {argv, cwd?, env?, timeout?, idempotent?, "
                   "nonzero_means_not_performed?}, or in the sandbox: {argv, timeout?, sandbox: true}.")

    def is_idempotent(self, args: dict) -> bool:
        # A sandboxed command can change nothing outside its scratch directory (removed after).
        return bool(args.get("idempotent") or args.get("sandbox"))

    def validate(self, args: dict) -> None:
        argv = args.get("argv")
        if not argv or not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
            raise ToolError(f"shell.run needs argv as a list of strings; got {argv!r}")
        timeout = args.get("timeout")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or timeout <= 0):
            raise ToolError(f"shell.run's timeout must be a positive number of seconds; got {timeout!r}")
        if args.get("sandbox"):
            host_only = sorted({"cwd", "env"} & set(args))
            if host_only:
                raise ToolError(f"shell.run in the sandbox takes no {' or '.join(host_only)}: the command runs in "
                                f"a fresh scratch directory with an empty environment")

    def perform(self, args: dict, *, key: str, token) -> dict:
        token.raise_if_cancelled()
        if args.get("sandbox"):
            return self._perform_sandboxed(args, token=token)
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
            failure = f"{args['argv'][0]} exited with {done.returncode}: {done.stderr[-500:].strip()}"
            if args.get("nonzero_means_not_performed"):
                raise ToolError(f"{failure} (the step declares that a non-zero exit means nothing was done)")
            raise OutcomeUnknown(f"{failure}; it may have done part of its work before failing (a step that knows "
                                 f"a failure does nothing declares \"nonzero_means_not_performed\": true)",
                                 evidence={"phase": "exited non-zero", "argv": args["argv"],
                                           "returncode": done.returncode, "stderr": done.stderr[-1000:]})
        return result

    def _perform_sandboxed(self, args: dict, *, token) -> dict:
        from .sandbox import run_sandboxed  # sandbox builds on this module's process groups

        result = run_sandboxed(args["argv"], token=token, timeout=args.get("timeout"))
        # Not performed: whatever the command did stayed in its scratch directory, now gone.
        if result["returncode"] != 0:
            raise ToolError(f"{args['argv'][0]} exited with {result['returncode']}: "
                            f"{result['stderr'][-500:].strip()}")
        return result
