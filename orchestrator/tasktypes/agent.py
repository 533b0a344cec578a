"""agent.plan_execute: an LLM agent's plan-and-execute loop as durable steps.

The plan grows at run time. `turn-001` asks the model (a streamed Chat Completions call,
orchestrator/llm/client.py) with the tools' JSON schemas; when it answers with tool calls,
the turn adds one step per call (`tool-001-1`, ...) and the next turn, which depends on
them all. A turn that answers without tool calls is the last. So every LLM call and every
tool call is a checkpointed step; every tool with a side effect goes through the WAL with
its own idempotency key, and the model's tool-call id is recorded with it.

The dialog is durable: each message is an AgentMessage row written as it happens
(orchestrator/agent/history.py); the request for a turn is rebuilt from them, always with a
`tool` message for every tool call. A Pause, Stop or preemption closes the stream at once;
the partial answer is kept (flagged interrupted) and the turn, when it runs again, continues
it. A `user.message` sent into the task joins the dialog at the next resume point; calls of
the last turn that had not started yet are answered "superseded" and the model decides
again. Budgets pause, never fail: no call starts with less than MIN_CALL_TOKENS of the
task's max_tokens left, and `max_turns` pauses the task too (raise it and resume).
"""
import json
import logging
import time
import uuid
from contextlib import contextmanager

from django.conf import settings
from django.db import transaction
from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..agent import history, toolbox
from ..llm import LLMCancelled, LLMClient, LLMStreamCut
from ..llm.client import estimate_prompt_tokens, estimate_tokens
from ..models import AgentMessage, WalEntry
from ..roles import is_admin
from . import register
from .base import StepSpec, TaskType

log = logging.getLogger(__name__)

MIN_CALL_TOKENS = 256  # a call is not started with less of the budget left (it could say nothing useful)
STREAM_FLUSH_SECONDS = 0.25  # streamed text reaches the page in pieces this often
DEFAULT_SYSTEM_PROMPT = ("You are a careful agent working for an operator. Use the tools to do what the goal asks; "
                         "call several tools in one turn when they do not depend on each other. When the work is "
                         "done, answer with a short report of what you did and found.")


class AgentParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    goal: str = Field(..., min_length=1, max_length=20_000, description="What the agent should do")
    model: str = Field("", max_length=200, description="The model's name (empty: LLM_MODEL)")
    tools: list[str] = Field(default_factory=lambda: list(toolbox.SAFE_DEFAULT),
                             description="The tools it may call (default: the read-only ones that reach neither the "
                                         "host nor the outside; side-effect tools must be named; shell_run, db_query "
                                         "and db_upsert need ORCH_AGENT_HOST_TOOLS and an admin)")
    system_prompt: str = Field("", max_length=20_000, description="Empty: the default prompt")
    max_turns: int = Field(30, ge=1, le=1000, description="Model calls at most (then the task pauses)")
    temperature: float | None = Field(None, ge=0, le=2)
    max_tokens_per_call: int = Field(2000, ge=16, le=100_000, description="Completion tokens per call at most")
    require_approval: list[str] = Field(default_factory=list,
                                        description="Tools whose calls wait for a reviewer's approval first (besides "
                                                    "the non-idempotent ones, which always do unless waived)")
    approval_waived: list[str] = Field(default_factory=list,
                                       description="Non-idempotent tools whose calls run without a reviewer (an "
                                                   "admin's decision, audited; emails outside "
                                                   "ORCH_AGENT_EMAIL_ALLOW still wait)")

    @field_validator("tools", "require_approval", "approval_waived")
    @classmethod
    def _known_tools(cls, names: list[str]) -> list[str]:
        unknown = [n for n in names if n not in toolbox.TOOLS]
        if unknown:
            raise ValueError(f"unknown tools {unknown}; the tools are: {', '.join(toolbox.TOOLS)}")
        return list(dict.fromkeys(names))


@contextmanager
def fenced(ctx):
    """A dialog write, fenced by the lease like every other durable write (engine/lease.py):
    a runner whose lease went stale (presumed dead, the task claimed again) gets LeaseLost and
    writes nothing — it can neither add to nor overwrite the new holder's dialog."""
    from ..engine.lease import lock_fenced

    with transaction.atomic():
        lock_fenced(ctx.lease)
        yield


def turn_id(turn: int) -> str:
    return f"turn-{turn:03d}"


def tool_step_id(turn: int, index: int) -> str:
    return f"tool-{turn:03d}-{index}"


TURN_READS = ("goal", "model", "tools", "system_prompt", "temperature", "max_tokens_per_call", "max_turns")


def grants(params: dict) -> dict:
    """What `params` grant beyond the safe default: the tools that reach the host or the
    database, and the approvals waived (both an admin's to give)."""
    return {"host_tools": [t for t in params.get("tools", ()) if t in toolbox.HOST_TOOLS],
            "approval_waived": [t for t in params.get("approval_waived", ())]}


def authorize(params: dict, *, actor, before: dict | None = None) -> list[tuple[str, str]]:
    """Who may start (or edit) an agent with these params: (field, message) for each refusal.
    Host tools must be enabled by the installation (ORCH_AGENT_HOST_TOOLS) and granted by an
    admin; waiving approval is an admin's too. `actor` None is the installation itself (the
    command line, code): it may grant what the installation enables. What an edit keeps from
    `before` is not granted again."""
    asked, had = grants(params), grants(before or {})
    problems = []
    disabled = [t for t in asked["host_tools"] if t not in settings.ORCH_AGENT_HOST_TOOLS]
    if disabled:
        problems.append(("params.tools", f"{', '.join(disabled)} reach the worker's host or the database and are not "
                                         f"enabled on this installation (ORCH_AGENT_HOST_TOOLS); ask its "
                                         f"administrator"))
    new_host = [t for t in asked["host_tools"] if t not in had["host_tools"]]
    new_waived = [t for t in asked["approval_waived"] if t not in had["approval_waived"]]
    if actor is not None and not is_admin(actor):
        if new_host:
            problems.append(("params.tools", f"only an admin may grant {', '.join(new_host)} (they reach the "
                                             f"worker's host or the database); operators may start agents with the "
                                             f"other tools"))
        if new_waived:
            problems.append(("params.approval_waived", f"only an admin may waive approval of "
                                                       f"{', '.join(new_waived)}"))
    not_offered = [t for t in asked["approval_waived"] if t not in params.get("tools", ())]
    if not_offered:
        problems.append(("params.approval_waived", f"{', '.join(not_offered)} not in tools"))
    return problems


@register
class PlanExecuteAgent(TaskType):
    name = "agent.plan_execute"
    title = "LLM agent (plan and execute)"
    description = ("Gives the goal to a language model (LLM_BASE_URL: the shipped stand-in model unless you point it "
                   "at a real one) with the chosen tools; every model call and every tool call is a durable step "
                   "added as the model decides. Side effects go through the WAL; the dialog is stored as it happens.")
    Params = AgentParams
    event_types = ("user.message",)
    awaited_event_types = ("approval.decided",)

    def plan(self, params: AgentParams) -> list[StepSpec]:
        return [StepSpec(turn_id(1), title="Turn 1: plan", reads=TURN_READS)]

    def authorize(self, params: dict, *, actor, before: dict | None = None) -> list[tuple[str, str]]:
        return authorize(params, actor=actor, before=before)

    def grants(self, params: dict) -> dict:
        return grants(params)

    def handle_event(self, event):
        from ..engine.inbox import Applied

        task_id, text, seq = event.task_id, event.payload["text"], event.seq
        turn = history.latest_turn(task_id)

        def append():
            AgentMessage.objects.update_or_create(task_id=task_id, key=f"user:{seq}", defaults={
                "turn": turn, "order": history.USER_ORDER + seq, "role": AgentMessage.Role.USER, "content": text})

        return Applied(f"appended to the dialog after turn {turn}; the model reads it at its next turn",
                       writes=[append])

    def run_step(self, ctx, step_id: str):
        if step_id.startswith("turn-"):
            return self._turn(ctx, int(step_id.split("-")[1]))
        _, turn, index = step_id.split("-")
        return self._tool_call(ctx, int(turn), int(index))

    # --- a model call ---------------------------------------------------------------------
    def _turn(self, ctx, turn: int):
        from ..engine.context import LimitExceeded

        p = ctx.params
        if turn > p.max_turns:
            raise LimitExceeded("max_turns")
        remaining = ctx.tokens_left()
        if remaining < MIN_CALL_TOKENS:
            raise LimitExceeded("max_tokens")
        if turn == 1:
            self._write_opening(ctx)
        messages = self._history(ctx, turn)
        offered = [toolbox.TOOLS[name].schema() for name in p.tools]
        # The prompt is spent too: a call starts only when the budget holds its prompt and at
        # least MIN_CALL_TOKENS of answer, and its answer is capped to what is left after the prompt.
        prompt = estimate_prompt_tokens(messages, offered)
        if remaining < prompt + MIN_CALL_TOKENS:
            raise LimitExceeded("max_tokens")
        # The attempt is a row before the first token: if this process is killed mid-stream,
        # the next attempt finds what had streamed (kept, and its tokens counted, estimated).
        with fenced(ctx):
            attempt = AgentMessage.objects.create(
                task_id=ctx.task_id, turn=turn, order=0, role=AgentMessage.Role.ASSISTANT, interrupted=True,
                accounted=False, tokens_estimated=True, step_id=ctx.step_id, generation=ctx.generation,
                key=f"{ctx.step_id}:g{ctx.generation}:attempt:{uuid.uuid4().hex[:12]}", prompt_tokens=prompt)
        stream = _PageStream(ctx, turn, attempt)
        client = LLMClient.from_settings()
        try:
            completion = client.chat(messages, tools=offered or None, model=p.model or None,
                                     temperature=p.temperature,
                                     max_tokens_cap=min(p.max_tokens_per_call, remaining - prompt),
                                     on_token=stream.add, cancel=ctx.interrupt_requested)
        except (LLMCancelled, LLMStreamCut) as exc:
            # Counted now, whatever comes next: a Stop ends the task without another attempt.
            stream.flush()
            self._keep_interrupted(ctx, attempt, exc)
            raise
        except Exception as exc:
            # Nothing streamed (the server refused or was away): nothing to keep; the attempts
            # the server read are counted all the same.
            with fenced(ctx):
                attempt.delete()
            ctx.use_tokens(getattr(exc, "retry_tokens", 0))
            raise
        finally:
            client.close()
        stream.flush()
        calls = [{"id": c.id, "name": c.name, "arguments": c.arguments, "step": tool_step_id(turn, i)}
                 for i, c in enumerate(completion.tool_calls, start=1)]
        with fenced(ctx):
            attempt.delete()  # complete: its usage is the completion's
            earlier = self._account_interrupted(ctx, turn)
            AgentMessage.objects.update_or_create(task_id=ctx.task_id, key=f"{ctx.step_id}:g{ctx.generation}",
                                                  defaults={
                "turn": turn, "order": 0, "role": AgentMessage.Role.ASSISTANT, "content": completion.content,
                "tool_calls": calls, "prompt_tokens": completion.usage.prompt_tokens,
                "completion_tokens": completion.usage.completion_tokens,
                "tokens_estimated": completion.usage.estimated, "step_id": ctx.step_id, "generation": ctx.generation})
        ctx.use_tokens(completion.usage.total_tokens + completion.retry_tokens + earlier)
        if calls:
            steps = [StepSpec(c["step"], title=f"{c['name']} ({c['id']})", depends_on=(ctx.step_id,)) for c in calls]
            # The next turn runs even when an operator skips one of these calls: the model is told
            # so ("skipped by an operator: <reason>", history.skipped_text) and decides again.
            ctx.add_steps(*steps, StepSpec(turn_id(turn + 1), title=f"Turn {turn + 1}", reads=TURN_READS,
                                           depends_on=tuple(s.id for s in steps), runs_after_skipped=True))
        return {"turn": turn, "content": completion.content, "tool_calls": calls,
                "finish_reason": completion.finish_reason, "model": completion.model,
                "usage": {"prompt": completion.usage.prompt_tokens, "completion": completion.usage.completion_tokens,
                          "estimated": completion.usage.estimated, "earlier_interrupted_attempts": earlier,
                          "retried_attempts": completion.retry_tokens},
                "final": not calls}

    def _write_opening(self, ctx) -> None:
        p = ctx.params
        for key, order, role, content in (("system", 0, AgentMessage.Role.SYSTEM,
                                            p.system_prompt or DEFAULT_SYSTEM_PROMPT),
                                           ("goal", 1, AgentMessage.Role.USER, p.goal)):
            with fenced(ctx):
                AgentMessage.objects.update_or_create(task_id=ctx.task_id, key=f"{key}:g{ctx.generation}", defaults={
                    "turn": 0, "order": order, "role": role, "content": content, "step_id": ctx.step_id,
                    "generation": ctx.generation})

    def _history(self, ctx, turn: int) -> list[dict]:
        """The request's messages, every dangling tool call answered from the durable record;
        a call whose effect is unsettled goes through the WAL first (history.Unsettled)."""
        settled: dict[str, str] = {}
        while True:
            try:
                return history.messages_for_turn(ctx.task_id, turn, settled)
            except history.Unsettled as unsettled:
                settled[unsettled.step_id] = self._settle(ctx, unsettled)

    def _settle(self, ctx, unsettled) -> str:
        """Perform a dangling call's effect again through the WAL, as its own tool step would
        (same step id and generation, so the same idempotency key; its `done` commits with this
        turn): an idempotent intent is replayed, one a reviewer found did not happen is
        performed again. A non-idempotent intent whose outcome is unknown is never replayed:
        the task goes to review first, and the reviewer's decision becomes the call's result."""
        from ..engine import wal
        from ..engine.context import StepContext

        entry, call = unsettled.entry, unsettled.call
        if entry.status == "pending" and not entry.idempotent:
            raise wal.AmbiguousEffect(entry, reason=(
                f"The model's {call['name']} call ({call['id']}) has no result and its {entry.tool} intent is still "
                f"pending: whether it happened is unknown. Your decision is what the model is told."))
        step_part = entry.idempotency_key.split(":")[1]
        generation = int(step_part.rsplit("@", 1)[1]) if "@" in step_part else 0
        replay = StepContext(task_id=ctx.task_id, step_id=unsettled.step_id, params=ctx.params._params, deps={},
                             lease=ctx.lease, token=ctx.token, generation=generation)
        ok, result = toolbox.call(replay, call["name"], call["arguments"], ctx.params.tools)
        ctx.completed_effects.extend(replay.completed_effects)
        return history.reviewed(ctx.task_id, unsettled.step_id, toolbox.as_message_text(result))

    def _keep_interrupted(self, ctx, attempt: AgentMessage, exc) -> None:
        """The partial answer of a cut or cancelled stream: kept, flagged, and its tokens
        counted at once (estimated when no usage came), with this turn's earlier attempts and
        the retried attempts the server read — a Stop may end the task before any other attempt."""
        partial = exc.partial
        if partial is not None:
            attempt.content = partial.content or attempt.content
            attempt.prompt_tokens = partial.usage.prompt_tokens or attempt.prompt_tokens
            attempt.completion_tokens = partial.usage.completion_tokens
            attempt.tokens_estimated = partial.usage.estimated
        with fenced(ctx):
            attempt.save()
            tokens = self._account_interrupted(ctx, attempt.turn)
        ctx.use_tokens(tokens + exc.retry_tokens)
        log.info("agent turn interrupted: partial answer kept",
                 extra={"task_id": attempt.task_id, "step_id": attempt.step_id})

    def _account_interrupted(self, ctx, turn: int) -> int:
        """Tokens of this turn's earlier attempts (cut, cancelled, or lost with their process)."""
        rows = AgentMessage.objects.filter(task_id=ctx.task_id, step_id=ctx.step_id, generation=ctx.generation,
                                           interrupted=True, accounted=False)
        tokens = sum(r.prompt_tokens + r.completion_tokens for r in rows)
        rows.update(accounted=True)
        return tokens

    # --- a tool call ----------------------------------------------------------------------
    def _tool_call(self, ctx, turn: int, index: int):
        call = ctx.deps[turn_id(turn)]["tool_calls"][index - 1]
        started = WalEntry.objects.filter(task_id=ctx.task_id, step_id=ctx.step_id).exists()
        arguments = _as_object(call["arguments"])
        p = ctx.params
        gate = (toolbox.needs_approval(call["name"], arguments, require=p.require_approval, waived=p.approval_waived)
                if call["name"] in p.tools else "")
        if not started and history.superseded(ctx.task_id, turn):
            ok, result = False, history.SUPERSEDED
        elif gate:
            # A reviewer decides in the review queue; the task waits holding no worker. (After a
            # crash the step asks again: the same item, and its decision event is still pending.)
            # The decision is this call's own, bound to its id and arguments (engine/approvals.py).
            decision = ctx.request_approval(call["name"], arguments, call_id=call["id"], reason=gate,
                                            context=ctx.deps[turn_id(turn)].get("content") or "")
            if decision.get("approved"):
                ok, result = toolbox.call(ctx, call["name"], json.dumps(decision["arguments"]), p.tools)
            else:
                ok, result = False, f"rejected by the reviewer: {decision.get('note') or 'no reason given'}"
        else:
            ok, result = toolbox.call(ctx, call["name"], call["arguments"], p.tools)
        # A reviewer's decision on this call's effect in doubt is what the model reads ("happened: …").
        text = history.reviewed(ctx.task_id, ctx.step_id, toolbox.as_message_text(result))
        with fenced(ctx):
            AgentMessage.objects.update_or_create(task_id=ctx.task_id, key=f"{ctx.step_id}:g{ctx.generation}",
                                                  defaults={
                "turn": turn, "order": index, "role": AgentMessage.Role.TOOL, "content": text,
                "tool_call_id": call["id"], "name": call["name"], "step_id": ctx.step_id,
                "generation": ctx.generation})
        return {"tool_call_id": call["id"], "name": call["name"], "ok": ok, "result": result}


def _as_object(arguments: str) -> dict | None:
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


class _PageStream:
    """The answer's text as it streams: sent to the task page in pieces (progress events)
    and kept on the attempt's row, so a crash mid-stream loses at most one piece."""

    def __init__(self, ctx, turn: int, attempt: AgentMessage):
        self.ctx, self.turn, self.attempt = ctx, turn, attempt
        self.pending: list[str] = []
        self.sent_at = time.monotonic()

    def add(self, text: str) -> None:
        self.pending.append(text)
        if time.monotonic() - self.sent_at >= STREAM_FLUSH_SECONDS:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        text, self.pending, self.sent_at = "".join(self.pending), [], time.monotonic()
        self.attempt.content += text
        self.attempt.completion_tokens = estimate_tokens(len(self.attempt.content))
        with fenced(self.ctx):  # one commit: the kept text and the piece sent to the page
            AgentMessage.objects.filter(pk=self.attempt.pk).update(content=self.attempt.content,
                                                                   completion_tokens=self.attempt.completion_tokens)
            self.ctx.progress("agent.stream", turn=self.turn, text=text)
