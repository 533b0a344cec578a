"""Task types for the interruption and limit tests (loaded with ORCH_EXTRA_TASK_TYPES)."""
import os
import sys
import threading
import time

from pydantic import BaseModel, ConfigDict, Field

from orchestrator.tasktypes import register
from orchestrator.tasktypes.base import StepSpec, TaskType
from orchestrator.tools.base import Tool, register as register_tool


@register_tool
class Explode(Tool):
    """A non-idempotent tool whose driver fails in a way it did not foresee."""

    name = "test.explode"

    def perform(self, args, *, key, token):
        raise RuntimeError("driver crashed in the middle of the call")

@register_tool
class ReadBinary(Tool):
    """An effect whose result holds NUL characters, as a file with binary bytes read as text does."""

    name = "test.read_binary"
    idempotent = True

    def perform(self, args, *, key, token):
        return {"text": "PK\x03\x04\x00\x00header", "keys": {"a\x00b": ["\x00"]}}


class NulResultsParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    nul_in_arguments: bool = False  # the effect's arguments hold a NUL (the call is refused)
    at_commit: bool = False  # first a db.upsert at commit whose row holds a NUL (the call is refused)


@register
class NulResults(TaskType):
    """One step that performs test.read_binary and returns its result with a NUL of its own."""

    name = "test.nul_results"
    Params = NulResultsParams

    def plan(self, params):
        return [StepSpec("read")]

    def run_step(self, ctx, step_id):
        if ctx.params.at_commit:
            ctx.effect("db.upsert", {"table": "demo_destination", "columns": ["id", "amount"],
                                     "rows": [[910_000, "1.5\x00"]]}, at_commit=True)
        args = {"path": "scan\x00.bin"} if ctx.params.nul_in_arguments else {}
        return {"read": ctx.effect("test.read_binary", args), "own": "end\x00"}


# A long-running child process: python -c "<script>" TAG
SLEEPER = "import sys, time; time.sleep(600)"
STUBBORN = "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"


def tag(task_id: int) -> str:
    # With the test process's xdist worker in it: task ids repeat across the pytest processes'
    # databases (tests/support/settings.py).
    return f"orch-test-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-task-{task_id}"


class InterruptibleParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mode: str = Field("subprocess", pattern="^(subprocess|stubborn|http_stream|llm_stream|subtasks|ignore_token|sleep)$")
    url: str = ""
    steps: int = Field(3, ge=1)
    seconds: float = 0.2
    subtasks: int = 3
    tokens_per_step: int = 0


@register
class Interruptible(TaskType):
    """Each step blocks in one layer (subprocess, HTTP stream, LLM stream, subtasks,
    a call that ignores the token) — or, in `sleep` mode, works `seconds` obeying it."""

    name = "test.interruptible"
    Params = InterruptibleParams

    def plan(self, params):
        return [StepSpec(f"step-{i}", depends_on=(f"step-{i - 1}",) if i > 1 else (), reads=("mode",))
                for i in range(1, params.steps + 1)]

    def run_step(self, ctx, step_id):
        mode = ctx.params.mode
        if mode == "subprocess":
            ctx.run_subprocess([sys.executable, "-c", SLEEPER, tag(ctx.task_id)])
        elif mode == "stubborn":
            ctx.run_subprocess([sys.executable, "-c", STUBBORN, tag(ctx.task_id)])
        elif mode == "http_stream":
            ctx.http("GET", ctx.params.url, timeout=600)
        elif mode == "llm_stream":
            text = "".join(ctx.llm_stream(ctx.params.url, {"model": "local", "messages": [
                {"role": "user", "content": "count"}], "max_tokens": ctx.params.tokens_per_step or None}))
            return {"chars": len(text)}
        elif mode == "subtasks":
            futures = [ctx.spawn(lambda sub: sub.run_subprocess([sys.executable, "-c", SLEEPER, tag(ctx.task_id)]),
                                 name=f"{step_id}/worker-{i}") for i in range(ctx.params.subtasks)]
            return [f.result() and None for f in futures]
        elif mode == "ignore_token":
            time.sleep(600)  # deaf to cancellation: only killing the process stops it
        elif mode == "sleep":
            ctx.sleep(ctx.params.seconds)
            if ctx.params.tokens_per_step:
                ctx.use_tokens(ctx.params.tokens_per_step)
            if ctx.params.subtasks and ctx.params.subtasks > 0 and ctx.params.url == "spawn":
                # Each subtask holds until every one is spawned, so that they are all live at
                # once however slowly the threads are scheduled (a loaded CI machine once let the
                # first finish its 50 ms before the third was spawned). When a spawn is over the
                # limit, the step ends and its token cancels the ones waiting.
                all_spawned = threading.Event()

                def hold(sub):
                    while not all_spawned.is_set():
                        sub.sleep(0.01)

                futures = [ctx.spawn(hold, name=f"{step_id}/s{i}") for i in range(ctx.params.subtasks)]
                all_spawned.set()
                for f in futures:
                    f.result()
        return {"step": step_id}


class EffectsParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: str = Field(..., pattern="^(idempotent|keyed|nonidempotent|post|explode)$")
    url: str = ""
    to: str = "someone@example.org"
    timeout: float = 30
    on_failure: str = ""  # the effect step's own failure policy


@register
class Effects(TaskType):
    """prepare -> one side effect of a tool class -> finish: the crash matrix's subject."""

    name = "test.effects"
    Params = EffectsParams

    def plan(self, params):
        return [StepSpec("prepare"), StepSpec("effect", depends_on=("prepare",), reads=("kind",),
                                              on_failure=params.on_failure),
                StepSpec("finish", depends_on=("effect",), runs_after_skipped=True)]

    def run_step(self, ctx, step_id):
        if step_id != "effect":
            return {"step": step_id}
        kind = ctx.params.kind
        if kind == "idempotent":
            return ctx.effect("db.upsert", {"table": "demo_destination", "columns": ["id", "amount"],
                                            "rows": [[900_000 + ctx.task_id, "42.5000"]]})
        if kind == "keyed":
            return ctx.effect("http.request", {"method": "POST", "url": ctx.params.url, "json": {"amount": 42},
                                               "idempotency_key": True, "timeout": ctx.params.timeout})
        if kind == "post":  # non-idempotent: no Idempotency-Key
            return ctx.effect("http.request", {"method": "POST", "url": ctx.params.url, "json": {"amount": 42},
                                               "timeout": ctx.params.timeout})
        if kind == "explode":
            return ctx.effect("test.explode", {})
        return ctx.effect("email.send", {"to": ctx.params.to, "subject": f"task {ctx.task_id}", "body": "hello"})


class DiamondParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    x: int = 1
    y: int = 1
    z: int = 1


@register
class Diamond(TaskType):
    """a (declares x; also reads z when x is odd) -> b (reads y) -> c; d is independent."""

    name = "test.diamond"
    Params = DiamondParams

    def plan(self, params):
        return [StepSpec("a", reads=("x",)), StepSpec("b", depends_on=("a",), reads=("y",)),
                StepSpec("c", depends_on=("b",)), StepSpec("d")]

    def run_step(self, ctx, step_id):
        p = ctx.params
        if step_id == "a":
            return p.x + (p.z if p.x % 2 else 0)  # reads z only at run time, undeclared
        if step_id == "b":
            return ctx.deps["a"] * p.y
        if step_id == "c":
            return ctx.deps["b"] + 1
        return "d"


class FlakyParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mode: str = Field(..., pattern="^(same|changing|transient)$")
    marker: str = ""  # a file path: `transient` fails until it exists (and creates it)
    resource: str = ""  # a path validate_resources requires to exist
    on_failure: str = ""  # the step's own failure policy
    with_dependants: bool = False  # work -> after (skipped with it) and work -> summary (runs after skipped)


@register
class Flaky(TaskType):
    """One step that fails: always the same way, differently each time, or once."""

    name = "test.flaky"
    Params = FlakyParams

    def plan(self, params):
        steps = [StepSpec("work", on_failure=params.on_failure)]
        if params.with_dependants:
            steps += [StepSpec("after", depends_on=("work",)),
                      StepSpec("summary", depends_on=("work", "after"), runs_after_skipped=True)]
        return steps

    def run_step(self, ctx, step_id):
        import os

        if step_id == "after":
            return "after"
        if step_id == "summary":
            return {"skipped": ctx.skipped, "deps": ctx.deps}
        mode = ctx.params.mode
        if mode == "same":
            raise ValueError(f"row {time.monotonic_ns()} is malformed at offset 0x{id(self):x}")
        if mode == "changing":  # a different exception on each attempt (counted in `marker`)
            count = int(open(ctx.params.marker).read()) if os.path.exists(ctx.params.marker) else 0
            with open(ctx.params.marker, "w") as f:
                f.write(str(count + 1))
            raise [KeyError, TypeError, RuntimeError, OSError][count % 4]("varies")
        if not os.path.exists(ctx.params.marker):
            open(ctx.params.marker, "w").close()
            raise ConnectionError("upstream timed out")
        return "ok"

    def validate_resources(self, task):
        import os

        path = task.params.get("resource")
        if path and not os.path.exists(path):
            raise FileNotFoundError(f"input file {path} is gone")


class GrowingParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mode: str = Field("fanout", pattern="^(fanout|chain|duplicate|unknown_dependency)$")
    items: int = Field(3, ge=0, le=10_000)  # fanout: one step per item; chain: its length
    factor: int = 1  # read by the item steps only
    prefix: str = "item"  # read by the adder only: the ids it gives what it adds
    effects: bool = True  # each item upserts a row (ids 700_000 + task * 1000 + index)
    big_result_bytes: int = Field(0, ge=0)  # discover returns this much (a large result)
    link_ms: int = Field(0, ge=0)  # chain: each link works this long (obeying the token)
    hold_until: str = ""  # chain: each link also works until this file exists (a test releases it)


@register
class Growing(TaskType):
    """A plan that grows while it runs.

    fanout: `discover` (upserts a marker row) adds one step per item, each upserting its
    row, and a `collect` step that depends on all the items (not on `discover`).
    chain: `link-0` adds `link-1`, which adds `link-2`… until `items` links ran.
    duplicate / unknown_dependency: `discover` asks for an impossible plan.
    """

    name = "test.growing"
    Params = GrowingParams
    # instruction {"add": n, "prefix": "extra"} adds n independent steps; user.message is noted.
    event_types = ("instruction", "user.message")

    def handle_event(self, event):
        from orchestrator.engine.inbox import Applied

        if event.type == "user.message":
            return Applied(f"noted: {event.payload['text'][:80]}")
        prefix, count = event.payload.get("prefix", "extra"), int(event.payload.get("add", 0))
        specs = [StepSpec(f"{prefix}-{i}") for i in range(count)]
        return Applied(f"added {count} step(s)", add_steps=specs)

    def plan(self, params):
        return [StepSpec("link-0")] if params.mode == "chain" else [StepSpec("discover")]

    def row_id(self, ctx, index: int) -> int:
        return 700_000 + ctx.task_id * 1000 + index

    def run_step(self, ctx, step_id):
        p = ctx.params
        if step_id.startswith("extra-") or step_id.startswith("urgent-"):
            return step_id
        if step_id.startswith("link-"):
            index = int(step_id.split("-")[1])
            if p.link_ms:
                ctx.sleep(p.link_ms / 1000)
            while p.hold_until and not os.path.exists(p.hold_until):
                ctx.sleep(0.05)
            if index + 1 < p.items:
                ctx.add_steps(StepSpec(f"link-{index + 1}", depends_on=(step_id,)))
            return index + (ctx.deps.get(f"link-{index - 1}") or 0)
        if step_id == "discover":
            if p.effects:
                ctx.effect("db.upsert", {"table": "demo_destination", "columns": ["id", "amount"],
                                         "rows": [[self.row_id(ctx, 999), "1.0000"]]})
            prefix = p.prefix
            if p.mode == "duplicate":
                ctx.add_steps(StepSpec("discover"))
            elif p.mode == "unknown_dependency":
                ctx.add_steps(StepSpec(f"{prefix}-0", depends_on=("nowhere",)))
            else:
                items = [f"{prefix}-{i}" for i in range(p.items)]
                ctx.add_steps(*[StepSpec(item, depends_on=("discover",)) for item in items],
                              StepSpec("collect", depends_on=tuple(items)))
            return {"items": p.items, "padding": "x" * p.big_result_bytes}
        if step_id == "collect":
            return sum(value for key, value in ctx.deps.items() if key != "discover")
        index = int(step_id.rsplit("-", 1)[1])
        if p.effects:
            ctx.effect("db.upsert", {"table": "demo_destination", "columns": ["id", "amount"],
                                     "rows": [[self.row_id(ctx, index), f"{index}.0000"]]})
        return index * p.factor


class LongParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    steps: int = Field(100, ge=1, le=100_000)
    factor: int = 1  # read by the second half of the chain only


@register
class Long(TaskType):
    """A long chain of pure steps; an edit of `factor` invalidates its second half."""

    name = "test.long"
    Params = LongParams

    def plan(self, params):
        return [StepSpec(f"s{i:05d}", depends_on=(f"s{i - 1:05d}",) if i else ()) for i in range(params.steps)]

    def run_step(self, ctx, step_id):
        index = int(step_id[1:])
        if index >= ctx.params.steps // 2:
            return index * ctx.params.factor
        return index


class ApprovalParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    timeout: float | None = 60.0
    amount: int = 100


@register
class Approval(TaskType):
    """prepare -> await (waits for an `instruction` event carrying a decision) -> finish: a durable wait.
    (Not approval.decided: that one only the review queue sends, bound to an agent's call.)"""

    name = "test.approval"
    Params = ApprovalParams
    awaited_event_types = ("instruction",)

    def plan(self, params):
        return [StepSpec("prepare"), StepSpec("await", depends_on=("prepare",)),
                StepSpec("finish", depends_on=("await",))]

    def run_step(self, ctx, step_id):
        from orchestrator.engine.context import WaitTimedOut

        if step_id == "prepare":
            return {"amount": ctx.params.amount}
        if step_id == "await":
            try:
                decision = ctx.wait_for("instruction", timeout=ctx.params.timeout)
            except WaitTimedOut:
                return {"approved": False, "note": "no decision in time"}
            return {"approved": decision["approved"], "note": decision.get("note", "")}
        return "paid" if ctx.deps["await"]["approved"] else "not paid"


class TimeboxedParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    steps: int = Field(1, ge=1)
    seconds: float = 3600.0  # each step works this long (obeying its token)
    timeout: float | None = None  # StepSpec.timeout of every step
    on_failure: str = ""
    safe_to_cancel: bool = True
    starts_log: str = ""  # a file: each start of a step appends "<step> <time.time()>" to it
    email_to: str = ""  # a step first sends this address one email (non-idempotent), then works
    parallel: bool = False  # independent steps (else a chain)
    hold_until: str = ""  # a file: a step works until it exists (or `seconds` passed), obeying its token


@register
class Timeboxed(TaskType):
    """Steps that work `seconds` each, obeying their token, logging each start: the subject of
    the step timeout, in-step limit and pause-grace tests."""

    name = "test.timeboxed"
    Params = TimeboxedParams

    def plan(self, params):
        return [StepSpec(f"step-{i}", depends_on=(f"step-{i - 1}",) if i > 1 and not params.parallel else (),
                         timeout=params.timeout, on_failure=params.on_failure,
                         safe_to_cancel=params.safe_to_cancel)
                for i in range(1, params.steps + 1)]

    def run_step(self, ctx, step_id):
        p = ctx.params
        if p.starts_log:
            with open(p.starts_log, "a") as log:
                log.write(f"{step_id} {time.time()}\n")
        if p.email_to:
            ctx.effect("email.send", {"to": p.email_to, "subject": f"{step_id} of task {ctx.task_id}", "body": "x"})
        deadline = time.monotonic() + p.seconds
        while time.monotonic() < deadline and not (p.hold_until and os.path.exists(p.hold_until)):
            ctx.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        return {"step": step_id}


@register
class TimeboxedByType(Timeboxed):
    """Timeboxed whose steps get the type's own timeout (TaskType.step_timeout)."""

    name = "test.timeboxed_by_type"
    step_timeout = 0.4


def starts(path: str) -> list[tuple[str, float]]:
    """The step starts a Timeboxed task logged: (step, time.time())."""
    if not os.path.exists(path):
        return []
    with open(path) as log:
        return [(step, float(at)) for step, at in (line.split() for line in log if line.strip())]


class SwallowerParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    signal: str = Field(..., pattern="^(wait|effect|limit|lease)$")
    url: str = ""
    marker: str = ""  # a file the careless code writes once it swallowed what it caught


@register
class Swallower(TaskType):
    """One step that wraps what raises a harness signal in `except Exception`, as careless step
    code does: the signal must reach the runner all the same (primitives/errors.py StepSignal)."""

    name = "test.swallower"
    Params = SwallowerParams
    awaited_event_types = ("instruction",)

    def plan(self, params):
        return [StepSpec("careless")]

    def run_step(self, ctx, step_id):
        try:
            if ctx.params.signal == "wait":
                return {"got": ctx.wait_for("instruction")}
            if ctx.params.signal == "effect":  # a plain POST the server reads and never answers
                return ctx.effect("http.request", {"method": "POST", "url": ctx.params.url, "json": {}, "timeout": 1})
            if ctx.params.signal == "limit":  # max_subtasks is 1: the second one is over the limit
                first = ctx.spawn(lambda sub: sub.sleep(5) or 1)
                second = ctx.spawn(lambda sub: 2)  # the first still runs
                return first.result() + second.result()
            from orchestrator.models import Task
            Task.objects.filter(pk=ctx.task_id).update(lease_epoch=ctx.lease.epoch + 1)  # another worker took it
            return ctx.effect("db.upsert", {"table": "demo_destination", "columns": ["id", "amount"],
                                            "rows": [[800_000 + ctx.task_id, "1.0000"]]})
        except Exception as exc:  # noqa: BLE001 (the carelessness under test)
            if ctx.params.marker:  # ... and goes on acting on the world
                with open(ctx.params.marker, "w") as marker:
                    marker.write(f"{type(exc).__name__}: {exc}")
            return {"swallowed": f"{type(exc).__name__}: {exc}"}


class SessionParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # What the step leaves running when it returns: a subprocess, a thread (neither waited for).
    leave: str = Field("", pattern="^(|subprocess|thread)$")


@register
class Session(TaskType):
    """One step that says which process and database session it runs on (the executor's pid,
    PostgreSQL's backend pid), optionally leaving something running behind it."""

    name = "test.session"
    Params = SessionParams

    def plan(self, params):
        return [StepSpec("session")]

    def run_step(self, ctx, step_id):
        import subprocess
        import threading

        from django.db import connection

        backend = None
        if connection.vendor == "postgresql":
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_backend_pid()")
                backend = cursor.fetchone()[0]
        left = None
        if ctx.params.leave == "subprocess":
            left = subprocess.Popen(["sleep", "600"]).pid
        elif ctx.params.leave == "thread":
            threading.Thread(target=time.sleep, args=(600,), name="left-behind", daemon=True).start()
        return {"pid": os.getpid(), "backend": backend, "left": left}


class AtCommitParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    amount: str = "2.5000"  # "not a number": the database refuses the row at the commit
    raise_after: bool = False  # the step raises after its effect call
    rows: int = 1  # rows upserted per step (ids 900000 + step index + 10 × k)


@register
class AtCommit(TaskType):
    """Two steps, each upserting one demo_destination row (id 900000 + index) with the step's
    checkpoint (ctx.effect(..., at_commit=True)); each returns the tool's result and whether the
    row could be read before the commit."""

    name = "test.at_commit"
    Params = AtCommitParams

    def plan(self, params):
        return [StepSpec("s0"), StepSpec("s1", depends_on=("s0",))]

    def run_step(self, ctx, step_id):
        from demo.models import DemoDestination

        row_id = 900_000 + int(step_id[1:])
        result = ctx.effect("db.upsert", {"table": "demo_destination", "columns": ["id", "amount"],
                                          "rows": [[row_id + 10 * k, ctx.params.amount]
                                                   for k in range(ctx.params.rows)]}, at_commit=True)
        if ctx.params.raise_after:
            raise RuntimeError("the step failed after its effect call")
        return {"effect": result, "row_before_commit": DemoDestination.objects.filter(pk=row_id).exists()}
