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

from ..primitives.cancellation import Cancelled
from .base import OutcomeUnknown, Tool, ToolError, register
from .process_groups import CommandTimedOut, run_in_group

OUTPUT_TAIL = 4000


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
