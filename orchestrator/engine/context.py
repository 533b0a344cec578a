"""What a step's code receives: params (reads recorded), dependency results, the
cancellation token, effect() through the WAL, and helpers that obey the token."""
import logging
import subprocess
import threading
from datetime import timedelta
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

from django.db import transaction
from django.utils import timezone
from pydantic import BaseModel

from .. import telemetry
from ..tools.http import http_call
from ..tools.llm import stream_completion
from ..tools.process_groups import run_in_group
from . import approvals, at_commit as effects_at_commit, inbox, rows_at_commit, wal
from ..primitives.cancellation import CancellationToken
from .lease import Lease
from .events import append_event
from .lease import lock_fenced
# What a step raises or sees raised; step code imports them from here too.
from .signals import LimitExceeded, StepTimedOut, WaitForEvent, WaitTimedOut  # noqa: F401


log = logging.getLogger(__name__)


def replay_safe(tool_name: str, args: dict) -> bool:
    """Cutting this effect mid-flight and running it again cannot do it twice: its tool is
    idempotent for these args, or transactional (a cut rolls it back). Unknown: not safe."""
    from ..tools.catalog import get_tool

    try:
        tool = get_tool(tool_name)
        return bool(tool.transactional or tool.is_idempotent(args))
    except Exception:  # an unknown tool or invalid args fail in wal.perform; fail closed here
        return False


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
                 lease: Lease, token: CancellationToken, runner=None, generation: int = 0,
                 skipped: dict[str, str] | None = None, defer_effects: bool = True):
        self.task_id = task_id
        self.step_id = step_id
        # Dependencies that were skipped (a step that runs after skipped steps), with why;
        # their entries in `deps` are None.
        self.skipped = skipped or {}
        self.generation = generation
        self.params = TrackedParams(params)
        self.deps = deps
        self.lease = lease
        self.token = token
        self.completed_effects: list[wal.CompletedEffect] = []
        # Effects to be written by the step's checkpoint (effect(..., at_commit=True)); False:
        # performed in place, after such a checkpoint was refused (engine/at_commit.py).
        self.at_commit: list[effects_at_commit.EffectAtCommit] = []
        self.defer_effects = defer_effects
        # Rows of the step's own record, written by its checkpoint (write_at_commit).
        self.rows_at_commit: list[rows_at_commit.RowAtCommit] = []
        # Steps this step adds to the plan: committed with its checkpoint, so a crash
        # before it leaves none of them and the re-run adds them again.
        self.added_steps: list = []
        # Inbox events this step took (ctx.wait_for), by id, with their outcome: marked
        # consumed in the step's checkpoint transaction (exactly once).
        self.consumed_events: dict[int, str] = {}
        self.tokens_used = 0
        self._runner = runner
        self._call_index = 0
        self._lock = threading.Lock()
        self._subtasks: list[tuple[CancellationToken, Future]] = []
        # Non-idempotent effects of this step in flight now: while any is, a Pause's grace or
        # a limit does not cut the step (cutting it would leave an outcome in doubt).
        self.unsafe_effects_in_flight = 0

    def effect(self, tool: str, args: dict, *, at_commit: bool = False) -> Any:
        """Perform a side effect through the WAL; returns the tool's result. `at_commit`: a
        transactional tool whose result is known before it runs (db.upsert) is written with the
        step's checkpoint, in one transaction (engine/at_commit.py): faster, but the step cannot
        read what it writes before then, and a refused write fails the step at its commit."""
        with self._lock:  # with cut(): a step is never cut between this check and its effect's start
            self.token.raise_if_cancelled()
            call_index = self._call_index
            self._call_index += 1
            if at_commit and self.defer_effects:
                deferred, result = effects_at_commit.defer(
                    lease=self.lease, step_id=self.step_id, call_index=call_index, tool_name=tool, args=args,
                    generation=self.generation, pending=self.at_commit)
                if deferred:
                    return result
            unsafe = not replay_safe(tool, args)
            self.unsafe_effects_in_flight += unsafe
        try:
            return wal.perform(lease=self.lease, step_id=self.step_id, call_index=call_index, tool_name=tool,
                               args=args, token=self.token, completed=self.completed_effects,
                               generation=self.generation)
        finally:
            with self._lock:
                self.unsafe_effects_in_flight -= unsafe

    def write_at_commit(self, model, *, unique: tuple[str, ...], **values) -> None:
        """A row of the step's own record (an agent's tool result in its dialog), inserted or
        updated on `unique` by the step's checkpoint, in its transaction (engine/rows_at_commit.py):
        nothing of it is written if the step does not commit."""
        with self._lock:
            rows_at_commit.keep(self.rows_at_commit, rows_at_commit.RowAtCommit(model, tuple(unique), values))

    def cut(self, reason: str) -> bool:
        """Cancel the step unless a non-idempotent effect of it is in flight (cutting that
        would leave its outcome in doubt); True when cancelled."""
        with self._lock:
            if self.unsafe_effects_in_flight:
                return False
            self.token.cancel(reason)
            return True

    def wait_for(self, event_type: str, *, timeout: float | None = None, match: dict | None = None) -> dict:
        """The payload of the next `event_type` event sent into the task (see the type's
        `awaited_event_types`). If it already arrived, at once; otherwise the task waits in
        `waiting`, holding no worker, and this step runs again when it comes (its code up to
        here should be pure or through ctx.effect). `timeout` (seconds, from the first wait,
        kept across restarts): then WaitTimedOut is raised instead. `match`: only an event whose
        payload holds these values (e.g. the decision of this step's own approval)."""
        self.token.raise_if_cancelled()
        event = inbox.awaited_arrived(self.task_id, event_type, match=match)
        if event is not None and event.pk not in self.consumed_events:
            self.consumed_events[event.pk] = f"received by the wait of step {self.step_id}"
            return event.payload
        recorded = (self._runner.recorded_wait(self.step_id, event_type) if self._runner is not None else None)
        until = recorded if recorded is not None else (
            timezone.now() + timedelta(seconds=timeout) if timeout is not None else None)
        if until is not None and timezone.now() >= until:
            raise WaitTimedOut(f"no {event_type} event came before {until.isoformat()}")
        raise WaitForEvent(event_type, until, match)

    def request_approval(self, tool: str, arguments: dict, *, context: str = "", call_id: str = "",
                         reason: str = "", policy: "approvals.Policy | None" = None,
                         schema: dict | None = None) -> dict:
        """Have a reviewer approve `tool(arguments)` before it runs: opens an approval item in
        the review queue (once per call and arguments) and waits for *its* decision — the task
        waits holding no worker (like wait_for). Returns the decision: {"approved", "note",
        "arguments", "approval_id", "expired"}: `arguments` are what the call may run with (the
        reviewer's corrected ones for edit-and-approve), checked against the digest the reviewer
        approved; `expired`: nobody decided before the deadline (`policy`, approvals.Policy) and
        its fallback was to give up. The deadline is the review queue's (the sweeper expires it),
        not this wait's: the wait ends with the expiry's event like with a decision. `schema`:
        the tool's argument schema ({"schema", "schema_from"}), kept with the approval."""
        approval_id = approvals.request(task_id=self.task_id, step_id=self.step_id, tool=tool, arguments=arguments,
                                        context=context, call_id=call_id, reason=reason, generation=self.generation,
                                        policy=policy, schema=schema)
        decision = self.wait_for("approval.decided", match={"approval_id": str(approval_id)})
        return approvals.bound(decision, approval_id=approval_id, call_id=call_id, arguments=arguments)

    def add_steps(self, *specs) -> None:
        """Grow the plan: `specs` (StepSpec) join the task when this step commits. They may
        depend on any step of the plan, this one included, and on specs added before them."""
        self.token.raise_if_cancelled()
        with self._lock:
            self.added_steps.extend(specs)

    def run_subprocess(self, argv: list[str], *, cwd: str | None = None, env: dict | None = None,
                       timeout: float | None = None) -> subprocess.CompletedProcess:
        """A subprocess for pure computation (no side effect), killed with its group on cancel."""
        return run_in_group(argv, token=self.token, cwd=cwd, env=env, timeout=timeout)

    def http(self, method: str, url: str, **args) -> dict:
        """A read-only HTTP request (no side effect); aborted when the token is cancelled."""
        return http_call({"method": method, "url": url, **args}, token=self.token)

    def llm_stream(self, url: str, payload: dict, timeout: float = 60) -> Iterator[str]:
        """Stream an LLM completion chunk by chunk; each chunk counts against max_tokens."""
        return stream_completion(url, payload, token=self.token, on_token=self.use_tokens, timeout=timeout)

    def sleep(self, seconds: float) -> None:
        """Wait, waking at once when cancelled."""
        if self.token.wait(seconds):
            self.token.raise_if_cancelled()

    def tokens_left(self) -> int:
        """What is left of the task's max_tokens budget, counting this step's use so far."""
        runner = self._runner
        if runner is None:
            return 10**12
        return int(runner.limits["max_tokens"]) - runner.base_tokens - runner.tokens_this_run() - self.tokens_used

    def limit(self, name: str) -> Any:
        """The task's limit `name` (None when it has none) as this run took it when it started:
        an operator sets limits only on a paused task (edit, resume), so a run's are its own."""
        if self._runner is None:
            from ..models import Task

            return (Task.objects.filter(pk=self.task_id).values_list("limits", flat=True).first() or {}).get(name)
        return self._runner.limits.get(name)

    def result_of(self, step_id: str) -> Any:
        """Another step's result (None when it has none): from the run's cache of the latest
        results, or the database. For a step that finished before this one (a dependency, or
        one of theirs): a step still running has no result to read."""
        if self._runner is None:
            from .results import load

            return load(self.task_id, [step_id]).get(step_id)
        return self._runner.results.get_many([step_id])[step_id]

    def interrupt_requested(self) -> bool:
        """The step should stop what it streams: cancelled (Stop, Terminate, a preempt), or
        an operator asked to pause. A graceful pause lets ordinary steps finish; a step whose
        work is cheap to resume (an LLM stream, kept partial) stops at once."""
        return self.token.cancelled or (self._runner is not None and self._runner.control == "pause")

    def use_tokens(self, count: int) -> None:
        """Account LLM tokens against the task's max_tokens limit."""
        with self._lock:
            self.tokens_used += count

    def spawn(self, fn: Callable[["SubtaskContext"], Any], *, name: str = "") -> Future:
        """Run `fn(subtask_ctx)` concurrently under a child token (cancelled with the step).

        Counts against the task's max_subtasks: one more than allowed raises LimitExceeded,
        which pauses the task. The step must wait for its subtasks' results; any still
        running when the step ends are cancelled.
        """
        name = name or f"{self.step_id}/sub-{len(self._subtasks) + 1}"
        if self._runner is not None:
            self._runner.reserve_subtask()
        token = self.token.child(name)
        future: Future = Future()
        sub = SubtaskContext(self, token)

        def run():
            try:
                with token.track("subtask", name):
                    future.set_result(fn(sub))
            except BaseException as exc:  # delivered to whoever waits on the future
                future.set_exception(exc)
            finally:
                if self._runner is not None:
                    self._runner.release_subtask()
                from django.db import connection

                connection.close()

        thread = threading.Thread(target=telemetry.in_current_trace(run), name=name, daemon=True)
        self._subtasks.append((token, future))
        thread.start()
        return future

    def close(self) -> None:
        """Structured concurrency: subtasks do not outlive their step."""
        for token, future in self._subtasks:
            if not future.done():
                token.cancel("step ended")

    def progress(self, message: str, **data) -> None:
        """Append a progress event to the task's log (committed at once, shown live; inside a
        caller's transaction, with it: no savepoint of its own)."""
        with transaction.atomic(savepoint=False):
            task = lock_fenced(self.lease)
            append_event(task, "progress", {"step": self.step_id, "message": message, **data})


class SubtaskContext:
    """What a spawned subtask gets: its own token and the helpers that obey it. Side
    effects stay in the step (their idempotency keys must be deterministic)."""

    def __init__(self, parent: StepContext, token: CancellationToken):
        self.parent = parent
        self.token = token
        self.params = parent.params
        self.deps = parent.deps

    def run_subprocess(self, argv, **kwargs):
        return run_in_group(argv, token=self.token, **kwargs)

    def http(self, method: str, url: str, **args) -> dict:
        return http_call({"method": method, "url": url, **args}, token=self.token)

    def llm_stream(self, url: str, payload: dict, timeout: float = 60):
        return stream_completion(url, payload, token=self.token, on_token=self.parent.use_tokens, timeout=timeout)

    def sleep(self, seconds: float) -> None:
        if self.token.wait(seconds):
            self.token.raise_if_cancelled()
