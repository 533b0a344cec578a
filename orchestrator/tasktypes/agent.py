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
import math
import time
import uuid
from contextlib import contextmanager
from typing import Literal

from django.conf import settings
from django.contrib.auth.models import Group
from django.db import DatabaseError, connection, transaction
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..agent import compaction, history, mcp as mcp_tools, memory, toolbox
from ..engine.approvals import Policy
from ..engine import llm_ledger, rows_at_commit
from ..llm import LLMCancelled, LLMContextExceeded, LLMResponseGone, LLMStreamCut, profiles
from ..llm.client import estimate_prompt_tokens, estimate_tokens
from ..models import AgentMessage
from ..primitives.faults import fault_point
from ..primitives import storable
from ..roles import is_admin
from . import register
from .base import StepSpec, TaskType

log = logging.getLogger(__name__)

MIN_CALL_TOKENS = 256  # a call is not started with less of the budget left (it could say nothing useful)
STREAM_FLUSH_SECONDS = 0.25  # streamed text reaches the page in pieces this often
DEFAULT_SYSTEM_PROMPT = ("You are a careful agent working for an operator. Use the tools to do what the goal asks; "
                         "call several tools in one turn when they do not depend on each other. When the work is "
                         "done, answer with a short report of what you did and found.")


class ApprovalRule(BaseModel):
    """How one tool's approvals wait (AgentParams.approval_rules)."""
    model_config = ConfigDict(extra="forbid")
    timeout_seconds: float | None = Field(None, gt=0, le=90 * 86400,
                                          description="empty: the task's approval_timeout_seconds")
    on_expiry: Literal["reject", "keep_waiting", "escalate"] = "reject"
    escalate_to: str = Field("", max_length=150, description="the group whose reviewers take it (escalate)")

    @model_validator(mode="after")
    def _escalation_has_a_group(self):
        if self.on_expiry == "escalate" and not self.escalate_to.strip():
            raise ValueError("on_expiry 'escalate' needs escalate_to: the group whose reviewers take it")
        return self


def _profile_examples(schema: dict) -> None:
    """The profiles a task can pick, as the schema's `examples` (the new-task form offers them
    as a list; the API's schema shows them); any model name on the default server is still
    accepted. Read when the schema is built: a profile added in the admin shows at once."""
    try:
        names = profiles.known_names()
    except DatabaseError:  # the admin's profiles cannot be read now: the form still works
        names = []
    if names:
        schema["examples"] = names


class AgentParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    goal: str = Field(..., min_length=1, max_length=20_000, description="What the agent should do")
    model: str = Field("", max_length=200, description="A model profile (LLM_MODELS or the admin's), or else a "
                                                        "model's name on the default server (empty: LLM_MODEL)",
                       json_schema_extra=_profile_examples)
    tools: list[str] = Field(default_factory=lambda: toolbox.safe_default(),
                             description="The tools it may call (default: the read-only ones that reach neither the "
                                         "host nor the outside; side-effect tools must be named; shell_run, db_query "
                                         "and db_upsert need ORCH_AGENT_HOST_TOOLS and an admin; MCP servers' tools, "
                                         "<server>__<tool> or <server>__* for all of one server's, need an admin)")
    system_prompt: str = Field("", max_length=20_000, description="Empty: the default prompt")
    agent_name: str = Field("", max_length=60, pattern=r"^[A-Za-z0-9_.-]*$",
                            description="Whose long-term memory it shares: the owner's agents with the same name "
                                        "(empty: the owner's unnamed agents). Facts are recalled into each turn "
                                        "when memory_search is among its tools")
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

    approval_timeout_seconds: float | None = Field(
        None, gt=0, le=90 * 86400, description="How long an approval waits for a reviewer before it expires (empty: "
                                               "ORCH_APPROVAL_TIMEOUT_SECONDS); approval_rules may set it per tool")
    approval_rules: dict[str, ApprovalRule] = Field(
        default_factory=dict, description='Per tool: {"email_send": {"timeout_seconds": 3600, "on_expiry": '
                                          '"escalate", "escalate_to": "managers"}}; on_expiry is reject (the '
                                          'default: the model reads that the approval expired), keep_waiting or '
                                          'escalate (to that group\'s reviewers, for one more timeout)')
    two_person_approval: list[str] = Field(default_factory=list,
                                           description="Tools whose calls need two different reviewers to approve "
                                                       "(removing one later is an admin's decision)")

    @field_validator("approval_rules")
    @classmethod
    def _known_rule_tools(cls, rules: dict) -> dict:
        # As _known_tools: an MCP tool of a declared server is taken by its name (never asking the
        # server when a run loads its params), and rules name tools one by one.
        unknown = [n for n in rules if not mcp_tools.declared(n) and toolbox.find_tool(n) is None]
        if unknown:
            raise ValueError(f"unknown tools {unknown}; the tools are: {', '.join(toolbox.known_names())}")
        wildcards = [n for n in rules if mcp_tools.is_wildcard(n)]
        if wildcards:
            raise ValueError(f"{', '.join(wildcards)}: <server>__* is for tools; name the MCP tools one by one here")
        return rules

    @field_validator("tools", "require_approval", "approval_waived", "two_person_approval")
    @classmethod
    def _known_tools(cls, names: list[str], info) -> list[str]:
        # An MCP tool of a declared server is taken by its name: whether the server has it is
        # asked when the task is created (authorize) and at each turn, never when a run loads
        # its params (a tool gone since is then an error the model reads, not a broken task).
        unknown = [n for n in names if not mcp_tools.declared(n) and toolbox.find_tool(n) is None]
        if unknown:
            raise ValueError(f"unknown tools {unknown}; the tools are: {', '.join(toolbox.known_names())}")
        wildcards = [n for n in names if mcp_tools.is_wildcard(n)]
        if wildcards and info.field_name != "tools":
            raise ValueError(f"{', '.join(wildcards)}: <server>__* is for tools; name the MCP tools one by one here")
        return list(dict.fromkeys(names))


@contextmanager
def fenced(ctx):
    """A dialog write, fenced by the lease like every other durable write (engine/lease.py):
    a runner whose lease went stale (presumed dead, the task claimed again) gets LeaseLost and
    writes nothing — it can neither add to nor overwrite the new holder's dialog."""
    from ..engine.lease import hold_fenced

    with transaction.atomic():
        hold_fenced(ctx.lease)
        yield


def turn_id(turn: int) -> str:
    return f"turn-{turn:03d}"


def tool_step_id(turn: int, index: int) -> str:
    return f"tool-{turn:03d}-{index}"


def compact_step_id(turn: int) -> str:
    return f"compact-{turn:03d}"


TURN_READS = ("goal", "model", "tools", "system_prompt", "temperature", "max_tokens_per_call", "max_turns",
              "agent_name")


def approval_policy(p: AgentParams, tool: str) -> Policy:
    """How a call of `tool` waits for its approval: the tool's rule, else the task's timeout
    (else the installation's, ORCH_APPROVAL_TIMEOUT_SECONDS), and how many reviewers."""
    rule = p.approval_rules.get(tool) or ApprovalRule()
    return Policy(timeout_seconds=rule.timeout_seconds if rule.timeout_seconds is not None
                  else p.approval_timeout_seconds, on_expiry=rule.on_expiry, escalate_to=rule.escalate_to.strip(),
                  approvers=2 if tool in p.two_person_approval else 1)


def grants(params: dict) -> dict:
    """What `params` grant beyond the safe default: the tools that reach the host or the
    database, and the approvals waived (both an admin's to give)."""
    tools = params.get("tools", ())
    return {"host_tools": [t for t in tools if not mcp_tools.declared(t) and toolbox.reaches_host(t)],
            "mcp_tools": [t for t in tools if mcp_tools.declared(t)],
            "approval_waived": [t for t in params.get("approval_waived", ())]}


def _mcp_problems(asked: list[str], had: list[str], *, actor) -> list[tuple[str, str]]:
    """MCP servers' tools reach outside the harness, as host tools do: only an admin (or the
    installation itself) grants them; the server being declared by the installation is what
    enables it. Each newly granted one must be a tool its server has now."""
    new = [t for t in asked if t not in had]
    if not new:
        return []
    if actor is not None and not is_admin(actor):
        return [("params.tools", f"only an admin may grant {', '.join(new)} (MCP servers' tools reach outside the "
                                 f"harness); operators may start agents with the other tools")]
    return [("params.tools", problem) for problem in mcp_tools.missing(new)]


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
    problems += _mcp_problems(asked["mcp_tools"], had["mcp_tools"], actor=actor)
    not_offered = [t for t in asked["approval_waived"] if not mcp_tools.covered(t, params.get("tools", ()))]
    if not_offered:
        problems.append(("params.approval_waived", f"{', '.join(not_offered)} not in tools"))
    problems += _approval_rule_problems(params, actor=actor, before=before)
    model_problem = profiles.problem_with(params.get("model"))
    if model_problem:
        problems.append(("params.model", model_problem))
    return problems


def _approval_rule_problems(params: dict, *, actor, before: dict | None) -> list[tuple[str, str]]:
    """Anyone who may start an agent may make its approvals stricter (two reviewers, a shorter
    deadline, an escalation: only reviewers ever decide, an escalation narrows them to a group's).
    Dropping a second reviewer an earlier version asked for is an admin's decision, as waiving
    approval is; and an escalation must name a group that exists, or nobody but an admin could act."""
    problems = []
    dropped = [t for t in (before or {}).get("two_person_approval", ()) if t not in params.get("two_person_approval", ())]
    if dropped and actor is not None and not is_admin(actor):
        problems.append(("params.two_person_approval", f"only an admin may drop two-person approval of "
                                                       f"{', '.join(dropped)}"))
    groups = {rule.get("escalate_to", "").strip() for rule in (params.get("approval_rules") or {}).values()
              if rule.get("on_expiry") == "escalate"}
    missing = sorted(groups - set(Group.objects.filter(name__in=groups).values_list("name", flat=True)))
    if missing:
        problems.append(("params.approval_rules", f"no group named {', '.join(map(repr, missing))} to escalate to"))
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

    def compat_fingerprint(self, params: dict) -> dict[str, str]:
        # Besides the plan: the prompts (digests), the model the profile resolves to, and the
        # schema of every tool it may call (its grants and the implicit ones).
        from .fingerprint import sha256, tool_digests

        found = super().compat_fingerprint(params)
        found["prompt:system"] = sha256(params.get("system_prompt") or DEFAULT_SYSTEM_PROMPT)
        found["prompt:summary"] = sha256(compaction.SUMMARY_PROMPT)
        found["model"] = model_fingerprint(params.get("model") or "")
        found.update(tool_digests([*(params.get("tools") or ()), *toolbox.IMPLICIT]))
        return found

    def grants(self, params: dict) -> dict:
        return grants(params)

    def on_rollback(self, task, kept: set[str]) -> dict:
        # Facts this task's memory_write calls stored after the version: gone with the steps that
        # wrote them (the steps run again and write them again, if the model still decides so).
        return {"memory_facts_removed": memory.forget_after(task.pk, kept)}

    def handle_event(self, event):
        from ..engine.inbox import Applied

        task_id, text, seq = event.task_id, event.payload["text"], event.seq
        turn = history.latest_turn(task_id)

        def append():
            history.write(task_id, f"user:{seq}", turn=turn, order=history.USER_ORDER + seq,
                          role=AgentMessage.Role.USER, content=text)

        return Applied(f"appended to the dialog after turn {turn}; the model reads it at its next turn",
                       writes=[append])

    def run_step(self, ctx, step_id: str):
        if step_id.startswith("turn-"):
            return self._turn(ctx, int(step_id.split("-")[1]))
        if step_id.startswith("compact-"):
            return self._compact(ctx, int(step_id.split("-")[1]))
        _, turn, index = step_id.split("-")
        return self._tool_call(ctx, int(turn), int(index))

    # --- a model call ---------------------------------------------------------------------
    def _turn(self, ctx, turn: int):
        from ..engine.signals import LimitExceeded

        p = ctx.params
        if turn > p.max_turns:
            raise LimitExceeded("max_turns")
        remaining = ctx.tokens_left()
        if remaining < MIN_CALL_TOKENS:
            raise LimitExceeded("max_tokens")
        llm_ledger.check_cost(ctx)
        if turn == 1:
            self._write_opening(ctx)
        # The profile `model` names: its server, key, window, prices (orchestrator/llm/profiles.py).
        profile = profiles.resolve(p.model)
        messages, offered, prompt = self._request(ctx, turn, profile)
        if remaining < prompt + MIN_CALL_TOKENS:
            raise LimitExceeded("max_tokens")
        compacted = None
        if prompt + min(p.max_tokens_per_call, profile.context_window // 4) > profile.context_window:
            # Never sent a request the window cannot hold: the earlier turns are summarised
            # first (in this step; a compact step usually did it before the dialog got here).
            compacted = self._compact_now(ctx, turn, profile, reason=(
                f"the dialog (~{prompt} tokens) leaves no room for the answer in the {profile.context_window}-token "
                f"window"))
            messages, offered, prompt = self._request(ctx, turn, profile)
        self._check_window(profile, prompt)
        try:
            result = self._ask(ctx, turn, profile, messages, offered, prompt, remaining)
        except LLMContextExceeded as exc:
            # The server counts differently from our estimate: compact (once) and ask again;
            # past that the task pauses with the server's words, never fails.
            if compacted is not None and compacted.get("compacted"):
                raise LimitExceeded("context_window", detail=f"{exc} The dialog was compacted and still does not fit;"
                                                             f" pick a model with a larger window (Edit params: "
                                                             f"model)") from None
            compacted = self._compact_now(ctx, turn, profile, reason=f"the server refused the request: {exc}")
            messages, offered, prompt = self._request(ctx, turn, profile)
            self._check_window(profile, prompt)
            try:
                result = self._ask(ctx, turn, profile, messages, offered, prompt, ctx.tokens_left())
            except LLMContextExceeded as again:
                raise LimitExceeded("context_window", detail=f"{again} The dialog was compacted and still does not "
                                                             f"fit; pick a model with a larger window (Edit params: "
                                                             f"model)") from None
        if compacted is not None:
            result["compacted"] = compacted
        return result

    def _request(self, ctx, turn: int, profile) -> tuple[list[dict], list[dict], int]:
        """The turn's messages, the tools offered, and the prompt's tokens (a calibrated estimate)."""
        messages = self._history(ctx, turn, include_reasoning=profile.send_reasoning_back)
        with_recall(ctx.task_id, ctx.params, messages)
        offered = offered_tools(ctx.params, messages, profile)
        return messages, offered, calibrated_prompt_tokens(ctx, turn, messages, offered)

    def _check_window(self, profile, prompt: int) -> None:
        from ..engine.signals import LimitExceeded

        if profile.context_window < prompt + MIN_CALL_TOKENS:
            raise LimitExceeded("context_window", detail=(
                f"the dialog (~{prompt} tokens, estimated) leaves less than {MIN_CALL_TOKENS} tokens of the "
                f"{profile.context_window}-token window of model {profile.model!r}, even compacted; pick a model "
                f"with a larger window (Edit params: model)"))

    def _compact_now(self, ctx, turn: int, profile, *, reason: str) -> dict:
        """Summarise the turns before `turn` within this turn's step (recorded in its result)."""
        from ..engine.signals import LimitExceeded

        try:
            return compaction.compact(ctx, history.current(ctx.task_id), up_to_turn=turn - 1, profile=profile,
                                      fenced=fenced, reason=reason)
        except compaction.NothingToCompact:
            raise LimitExceeded("context_window", detail=(
                f"{reason}, with no earlier turns to summarise: shorten the goal or pick a model with a larger "
                f"window (Edit params)")) from None

    def _compact(self, ctx, turn: int) -> dict:
        """compact-NNN, between turn NNN's tool calls and the next turn: when the next request
        would pass ORCH_AGENT_COMPACT_AT of the window, the model summarises the earlier turns
        (compaction.py). It looks at the real dialog, so it may find nothing to do."""
        p = ctx.params
        profile = profiles.resolve(p.model)
        try:
            messages = history.messages_for_turn(ctx.task_id, turn + 1, include_reasoning=profile.send_reasoning_back)
        except history.Unsettled:  # the next turn settles it first; compacting can wait for the turn after
            return {"compacted": False, "reason": "a tool call's effect is still to settle"}
        offered = offered_tools(p, messages, profile)
        prompt = calibrated_prompt_tokens(ctx, turn + 1, messages, offered)
        limit = compaction.threshold(profile.context_window, p.max_tokens_per_call)
        if prompt <= limit:
            return {"compacted": False, "prompt_tokens": prompt, "threshold": limit,
                    "reason": f"the next request (~{prompt} tokens) is within {limit} tokens"}
        rows = history.current(ctx.task_id)
        # The latest turn stays as it is when it is small: the model reads its own last step whole.
        keep_last = sum(len(r.content) + len(json.dumps(r.tool_calls)) for r in rows if r.turn == turn) // 4 <= limit // 3
        up_to = turn - 1 if keep_last and compaction.compactable(rows, turn - 1)[-1:] and turn > 1 else turn
        try:
            return compaction.compact(ctx, rows, up_to_turn=up_to, profile=profile, fenced=fenced, reason=(
                f"the next request (~{prompt} tokens) passes {limit} tokens (ORCH_AGENT_COMPACT_AT of the "
                f"{profile.context_window}-token window less the answer's cap)"))
        except compaction.NothingToCompact:
            return {"compacted": False, "prompt_tokens": prompt, "threshold": limit,
                    "reason": "nothing earlier to summarise"}

    def _ask(self, ctx, turn: int, profile, messages, offered, prompt: int, remaining: int) -> dict:
        """One model call for the turn, streamed to the page, its answer kept as the turn's row."""
        from ..engine.signals import LimitExceeded

        p = ctx.params
        cap = min(p.max_tokens_per_call, remaining - prompt, profile.context_window - prompt)
        # The attempt is a row before the first token: if this process is killed mid-stream,
        # the next attempt finds what had streamed (kept, and its tokens counted, estimated).
        # Asked in background mode, the row also gets the response's id before the first token,
        # and the next attempt retrieves that response instead (profile.background_responses).
        attempt = _background_attempt_left(ctx) if profile.background_responses else None
        if attempt is None:
            attempt = _new_attempt(ctx, turn, estimate_prompt_tokens(messages, offered))
        stream = _PageStream(ctx, turn, attempt)
        client = profile.client()
        reattached = False
        try:
            completion = None
            if attempt.response_id:
                try:
                    attempt.content, attempt.reasoning = "", ""  # the whole answer comes back
                    completion = client.reattach(attempt.response_id, model=profile.model,
                                                 cancel=ctx.interrupt_requested, on_token=stream.add,
                                                 on_reasoning=stream.add_reasoning)
                    reattached = True
                except LLMResponseGone as exc:
                    # Asked again: the earlier attempt stays a lost one (counted below).
                    log.info("agent turn: the response of the attempt lost with its process is gone; asking again",
                             extra={"task_id": ctx.task_id, "step_id": ctx.step_id, "reason": str(exc)})
                    attempt = _new_attempt(ctx, turn, estimate_prompt_tokens(messages, offered))
                    stream = _PageStream(ctx, turn, attempt)
            if completion is None:
                completion = client.chat(messages, tools=offered or None, model=profile.model,
                                         temperature=p.temperature, max_tokens_cap=cap, on_token=stream.add,
                                         on_reasoning=stream.add_reasoning, cancel=ctx.interrupt_requested,
                                         background=profile.background_responses,
                                         on_response_id=lambda response_id: _note_response_id(ctx, attempt,
                                                                                              response_id))
        except (LLMCancelled, LLMStreamCut) as exc:
            # Counted now, whatever comes next: a Stop ends the task without another attempt.
            stream.flush()
            llm_ledger.record_failures(ctx, purpose="turn", profile=profile, failed_attempts=exc.failed_attempts)
            self._keep_interrupted(ctx, attempt, exc.partial, profile, outcome=(
                llm_ledger.Outcome.CANCELLED if isinstance(exc, LLMCancelled) else llm_ledger.Outcome.CUT))
            raise
        except Exception as exc:
            # Nothing streamed (the server refused or was away): nothing to keep; the attempts
            # the server read are counted all the same, and each is in the ledger.
            with fenced(ctx):
                attempt.delete()
            llm_ledger.record_call_failure(ctx, exc, purpose="turn", profile=profile)
            raise
        stream.flush()
        if completion.finish_reason == "length":
            # The answer reached its cap before the model finished: kept as an interrupted answer
            # (the turn continues it on resume; its cut tool calls are dropped), counted, and the
            # task pauses — a budget never fails a task.
            llm_ledger.record_failures(ctx, purpose="turn", profile=profile,
                                       failed_attempts=completion.failed_attempts)
            self._keep_interrupted(ctx, attempt, completion, profile, outcome=llm_ledger.Outcome.LENGTH)
            budget = cap < p.max_tokens_per_call
            raise LimitExceeded("max_tokens" if budget else "max_tokens_per_call", detail=(
                f"the model's answer reached {cap} tokens before it finished (finish_reason: length); its text is "
                f"kept and the turn continues it on resume; raise "
                + ("the task's max_tokens" if budget else "max_tokens_per_call (Edit params)") + " if it needs more"))
        calls = [{"id": c.id, "name": c.name, "arguments": c.arguments, "step": tool_step_id(turn, i)}
                 for i, c in enumerate(completion.tool_calls, start=1)]
        cost = profile.cost(completion.usage)
        llm_ledger.record_failures(ctx, purpose="turn", profile=profile, failed_attempts=completion.failed_attempts)
        # The answer, its ledger row and the end of its attempt commit together (one transaction):
        # a process that dies before leaves the attempt row, which the next run counts as lost.
        answer = history.row(ctx.task_id, f"{ctx.step_id}:g{ctx.generation}", turn=turn, order=0,
                             role=AgentMessage.Role.ASSISTANT, content=completion.content,
                             reasoning=completion.reasoning, tool_calls=calls,
                             prompt_tokens=completion.usage.prompt_tokens,
                             completion_tokens=completion.usage.completion_tokens, cost=cost,
                             tokens_estimated=completion.usage.estimated, step_id=ctx.step_id,
                             generation=ctx.generation)
        usage = dict(purpose="turn", profile=profile,
                     outcome=llm_ledger.Outcome.REATTACHED if reattached else llm_ledger.Outcome.COMPLETED,
                     prompt_tokens=completion.usage.prompt_tokens, completion_tokens=completion.usage.completion_tokens,
                     cached_tokens=completion.usage.cached_tokens, estimated=completion.usage.estimated)
        earlier = 0
        if getattr(attempt, "earlier_unaccounted", True):
            # An earlier run's attempts of this step to count first (lost with their process):
            # read and written in the same fenced transaction.
            with fenced(ctx):
                attempt.delete()  # complete: its usage is the completion's
                earlier = llm_ledger.account_attempt_rows(ctx, profile=profile, role=AgentMessage.Role.ASSISTANT,
                                                          fence_held=True)
                llm_ledger.record(ctx, **usage, fence_held=True)
                rows_at_commit.write_in_transaction([answer])
        else:  # the usual turn: one fenced write (on PostgreSQL one statement)
            llm_ledger.record_with(ctx, [answer], deleted=((AgentMessage, attempt.pk),), **usage)
        if calls:
            steps = [StepSpec(c["step"], title=f"{c['name']} ({c['id']})", depends_on=(ctx.step_id,)) for c in calls]
            before_next = tuple(s.id for s in steps)
            if self._may_pass_threshold(completion, prompt, len(calls), profile, p):
                # The next request may pass ORCH_AGENT_COMPACT_AT of the window once these calls'
                # results are in: a compact step between them and the next turn looks, and
                # summarises the earlier turns if it does (it runs after a skipped call too).
                compact = StepSpec(compact_step_id(turn), title=f"Compact the dialog (after turn {turn})",
                                   reads=("model", "tools", "max_tokens_per_call"), depends_on=before_next,
                                   runs_after_skipped=True)
                steps.append(compact)
                before_next = (compact.id,)
            # The next turn runs even when an operator skips one of these calls: the model is told
            # so ("skipped by an operator: <reason>", history.skipped_text) and decides again.
            ctx.add_steps(*steps, StepSpec(turn_id(turn + 1), title=f"Turn {turn + 1}", reads=TURN_READS,
                                           depends_on=before_next, runs_after_skipped=True))
        return {"turn": turn, "content": completion.content, "tool_calls": calls,
                "finish_reason": completion.finish_reason, "model": completion.model, "profile": profile.name,
                "usage": {"prompt": completion.usage.prompt_tokens, "completion": completion.usage.completion_tokens,
                          "cached": completion.usage.cached_tokens, "estimated": completion.usage.estimated,
                          "prompt_estimate": estimate_prompt_tokens(messages, offered),
                          "earlier_interrupted_attempts": earlier, "retried_attempts": completion.retry_tokens,
                          "retries": len(completion.failed_attempts)},
                "cost": str(cost) if cost is not None else None,
                "final": not calls}

    @staticmethod
    def _may_pass_threshold(completion, prompt: int, calls: int, profile, p) -> bool:
        """Whether the next request may pass the compaction threshold: this request, this answer,
        and each call's result at the most the dialog holds of one (ORCH_AGENT_RESULT_INLINE_CHARS),
        but no more than an eighth of the window each."""
        per_result = min(estimate_tokens(settings.ORCH_AGENT_RESULT_INLINE_CHARS), profile.context_window // 8)
        size = max(completion.usage.prompt_tokens, prompt) + completion.usage.completion_tokens + calls * per_result
        return size > compaction.threshold(profile.context_window, p.max_tokens_per_call)

    def _write_opening(self, ctx) -> None:
        p = ctx.params
        with fenced(ctx):
            for key, order, role, content in (("system", 0, AgentMessage.Role.SYSTEM,
                                                p.system_prompt or DEFAULT_SYSTEM_PROMPT),
                                               ("goal", 1, AgentMessage.Role.USER, p.goal)):
                history.write(ctx.task_id, f"{key}:g{ctx.generation}", turn=0, order=order, role=role,
                              content=content, step_id=ctx.step_id, generation=ctx.generation)

    def _history(self, ctx, turn: int, *, include_reasoning: bool = False) -> list[dict]:
        """The request's messages, every dangling tool call answered from the durable record;
        a call whose effect is unsettled goes through the WAL first (history.Unsettled)."""
        settled: dict[str, str] = {}
        while True:
            try:
                return history.messages_for_turn(ctx.task_id, turn, settled, include_reasoning=include_reasoning)
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
        ok, result = toolbox.call(replay, call["name"], call["arguments"], _granted(ctx.params))
        ctx.completed_effects.extend(replay.completed_effects)
        return history.reviewed(ctx.task_id, unsettled.step_id, toolbox.as_message_text(result))

    def _keep_interrupted(self, ctx, attempt: AgentMessage, partial, profile, *, outcome: str) -> None:
        """The partial answer of a cut or cancelled stream (or one cut at its token cap): kept,
        flagged, and its tokens counted at once in the ledger (estimated when no usage came),
        with this turn's attempts lost earlier — a Stop may end the task before any other
        attempt. Its tool calls are never kept (the next attempt decides again)."""
        if partial is not None:
            attempt.content = partial.content or attempt.content
            attempt.reasoning = partial.reasoning or attempt.reasoning
            attempt.prompt_tokens = partial.usage.prompt_tokens or attempt.prompt_tokens
            attempt.completion_tokens = partial.usage.completion_tokens
            attempt.tokens_estimated = partial.usage.estimated
        attempt.cost = profiles.cost_of(profile, attempt.prompt_tokens, attempt.completion_tokens,
                                        partial.usage.cached_tokens if partial is not None else 0)
        with fenced(ctx):
            attempt.save(update_fields=["content", "reasoning", "prompt_tokens", "completion_tokens",
                                        "tokens_estimated", "cost"])
        llm_ledger.account_attempt_rows(ctx, profile=profile, role=AgentMessage.Role.ASSISTANT, current=attempt,
                                 outcome=outcome)
        log.info("agent turn interrupted: partial answer kept",
                 extra={"task_id": attempt.task_id, "step_id": attempt.step_id})

    # --- a tool call ----------------------------------------------------------------------
    def _tool_call(self, ctx, turn: int, index: int):
        call = ctx.deps[turn_id(turn)]["tool_calls"][index - 1]
        started, superseded = history.call_state(ctx.task_id, ctx.step_id, turn)
        arguments = _as_object(call["arguments"])
        p = ctx.params
        granted = _granted(p)  # each <server>__* as that server's tools now, and result_read
        gate = (toolbox.needs_approval(call["name"], arguments, require=p.require_approval, waived=p.approval_waived)
                if call["name"] in granted else "")
        if not started and superseded:
            ok, result = False, history.SUPERSEDED
        elif gate:
            # A reviewer decides in the review queue; the task waits holding no worker. (After a
            # crash the step asks again: the same item, and its decision event is still pending.)
            # The decision is this call's own, bound to its id and arguments (engine/approvals.py).
            decision = ctx.request_approval(call["name"], arguments, call_id=call["id"], reason=gate,
                                            context=ctx.deps[turn_id(turn)].get("content") or "",
                                            policy=approval_policy(p, call["name"]),
                                            schema=toolbox.approval_schema(call["name"]))
            if decision.get("approved"):
                ok, result = toolbox.call(ctx, call["name"], json.dumps(decision["arguments"]), granted)
            elif decision.get("expired"):  # nobody said no: the model may ask again, or do without
                ok, result = False, f"not executed: {decision.get('note') or 'the approval expired'}"
            else:
                ok, result = False, f"rejected by the reviewer: {decision.get('note') or 'no reason given'}"
        else:
            ok, result = toolbox.call(ctx, call["name"], call["arguments"], granted)
        # A tool's result is stored (the dialog, the step's result): a NUL in it (a binary file, a
        # hostile server) is replaced, as PostgreSQL stores none (primitives/storable.py).
        result = storable.value(result)
        text = toolbox.as_message_text(result, ref=ctx.step_id)
        if started:
            # A reviewer's decision on this call's effect in doubt is what the model reads
            # ("happened: …"); only an intent an earlier run left can have been reviewed.
            text = history.reviewed(ctx.task_id, ctx.step_id, text)
        # Its row in the dialog commits with the step (no transaction of its own).
        history.write_with_step(ctx, f"{ctx.step_id}:g{ctx.generation}", turn=turn, order=index,
                                role=AgentMessage.Role.TOOL, content=text, tool_call_id=call["id"], name=call["name"],
                                step_id=ctx.step_id, generation=ctx.generation)
        return {"tool_call_id": call["id"], "name": call["name"], "ok": ok, "result": result}


def with_recall(task_id: int, p, messages: list[dict]) -> None:
    """The facts of the task's memory that match its goal and the latest user message, appended
    to the system prompt of this request (not to the stored dialog), when it may search its
    memory (memory_search among its tools)."""
    if "memory_search" not in p.tools or not messages or messages[0]["role"] != "system":
        return
    latest_user = next((m.get("content") or "" for m in reversed(messages) if m["role"] == "user"), "")
    recalled = memory.recall_text(task_id, f"{p.goal} {latest_user if latest_user != p.goal else ''}")
    if recalled:
        messages[0] = {**messages[0], "content": (messages[0].get("content") or "") + recalled}


def offered_tools(p, messages: list[dict], profile) -> list[dict]:
    """The tools' schemas a request offers. A tool that went away since the task was created (an
    MCP server's tool, an extension removed) is not offered; a call to it is an error the model
    reads (toolbox.call). A server that takes no tools (supports_tools false) gets none: the model
    answers directly."""
    if not profile.supports_tools:
        return []
    names = mcp_tools.expand(p.tools)
    if any(m["role"] == "tool" and toolbox.SHORTENED_MARK in (m.get("content") or "") for m in messages):
        names += [t for t in toolbox.IMPLICIT if t not in names]  # to read on (result_read)
    return [tool.schema() for tool in map(toolbox.find_tool, names) if tool is not None]


# An estimate is corrected by what the server reported for the previous turn, within these bounds
# (a server that counts oddly, or a usage that is off, must not make the estimate absurd).
CALIBRATION_BOUNDS = (0.5, 3.0)
CALIBRATION_MARGIN = 1.05


def calibrated_prompt_tokens(ctx, turn: int, messages: list[dict], offered: list[dict]) -> int:
    """The request's prompt in tokens: characters / 4 (no tokenizer to download), scaled by how the
    server counted the previous turn's prompt against the same estimate (its `usage`), with a margin."""
    raw = estimate_prompt_tokens(messages, offered)
    factor = 1.0
    # The previous turn finished before this step started (every turn depends on the one before,
    # through its tool calls): its result is the run's, read without a query.
    previous = ctx.result_of(turn_id(turn - 1)) if turn > 1 else None
    usage = previous.get("usage") if isinstance(previous, dict) else None
    if isinstance(usage, dict) and not usage.get("estimated") and usage.get("prompt") and usage.get("prompt_estimate"):
        factor = min(max(usage["prompt"] / usage["prompt_estimate"], CALIBRATION_BOUNDS[0]), CALIBRATION_BOUNDS[1])
    return math.ceil(raw * factor * CALIBRATION_MARGIN)


def model_fingerprint(name: str) -> str:
    """The profile a task names and the model it resolves to now (for the compatibility gate)."""
    try:
        return f"{name or '(default)'}: {profiles.resolve(name).model}"
    except Exception as exc:  # an unreadable LLM_MODELS, a disabled profile: that is what it is now
        return f"{name or '(default)'}: unavailable ({type(exc).__name__})"


def _granted(p) -> list[str]:
    """What a call may run: the task's tools (each `<server>__*` as that server's tools now), and
    the implicit result_read (it reads only what this task's own tools returned)."""
    names = mcp_tools.expand(p.tools)
    return names + [t for t in toolbox.IMPLICIT if t not in names]


def _as_object(arguments: str) -> dict | None:
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _new_attempt(ctx, turn: int, prompt_tokens: int) -> AgentMessage:
    """The attempt's row, fenced (on PostgreSQL one statement); it also says whether an earlier
    run left attempts of this step not yet counted (`earlier_unaccounted`: the turn's end counts
    them), read in the same write."""
    values = dict(task_id=ctx.task_id, turn=turn, order=0, role=AgentMessage.Role.ASSISTANT, interrupted=True,
                  accounted=False, tokens_estimated=True, step_id=ctx.step_id, generation=ctx.generation,
                  key=f"{ctx.step_id}:g{ctx.generation}:attempt:{uuid.uuid4().hex[:12]}",
                  prompt_tokens=prompt_tokens)  # as billed, if the process dies
    table = connection.ops.quote_name(AgentMessage._meta.db_table)
    unaccounted = (f"EXISTS (SELECT 1 FROM {table} WHERE task_id = %(a_task)s AND step_id = %(a_step)s "
                   f"AND generation = %(a_generation)s AND role = %(a_role)s AND interrupted AND NOT accounted)",
                   {"a_task": ctx.task_id, "a_step": ctx.step_id, "a_generation": ctx.generation,
                    "a_role": AgentMessage.Role.ASSISTANT})
    (pk,), earlier = rows_at_commit.write_fenced(ctx.lease, [rows_at_commit.RowAtCommit(AgentMessage, (), values)],
                                                 probe=unaccounted)
    attempt = AgentMessage(pk=pk, **values)
    attempt._state.adding, attempt._state.db = False, connection.alias
    attempt.earlier_unaccounted = bool(earlier)
    return attempt


def _background_attempt_left(ctx) -> AgentMessage | None:
    """The attempt of this step a dead process asked in background mode (not yet accounted:
    nobody has counted it lost), whose response the server may still have."""
    return (AgentMessage.objects.filter(task_id=ctx.task_id, step_id=ctx.step_id, generation=ctx.generation,
                                        role=AgentMessage.Role.ASSISTANT, interrupted=True, accounted=False)
            .exclude(response_id="").order_by("-id").first())


def _note_response_id(ctx, attempt: AgentMessage, response_id: str) -> None:
    """Recorded before the first token, fenced: the step run after a crash finds it."""
    attempt.response_id = response_id
    with fenced(ctx):
        AgentMessage.objects.filter(pk=attempt.pk).update(response_id=response_id)
    fault_point("background_response_started", ctx.step_id)


class _PageStream:
    """The answer's text (and its reasoning, apart) as it streams: sent to the task page in
    pieces (progress events) and kept on the attempt's row, so a crash mid-stream loses at most
    one piece."""

    def __init__(self, ctx, turn: int, attempt: AgentMessage):
        self.ctx, self.turn, self.attempt = ctx, turn, attempt
        self.pending: list[str] = []
        self.pending_reasoning: list[str] = []
        self.sent_at = time.monotonic()

    def add(self, text: str) -> None:
        self.pending.append(storable.text(text))  # stored as it streams: no NUL (PostgreSQL stores none)
        self._maybe_flush()

    def add_reasoning(self, text: str) -> None:
        self.pending_reasoning.append(storable.text(text))
        self._maybe_flush()

    def _maybe_flush(self) -> None:
        if time.monotonic() - self.sent_at >= STREAM_FLUSH_SECONDS:
            self.flush()

    def flush(self) -> None:
        if not self.pending and not self.pending_reasoning:
            return
        text, reasoning = "".join(self.pending), "".join(self.pending_reasoning)
        self.pending, self.pending_reasoning, self.sent_at = [], [], time.monotonic()
        self.attempt.content += text
        self.attempt.reasoning += reasoning
        self.attempt.completion_tokens = estimate_tokens(len(self.attempt.content) + len(self.attempt.reasoning))
        # One commit: the piece sent to the page (its event fenced by the lease, the task row
        # locked) and the kept text.
        with transaction.atomic():
            self.ctx.progress("agent.stream", turn=self.turn, text=text, **({"reasoning": reasoning} if reasoning else {}))
            AgentMessage.objects.filter(pk=self.attempt.pk).update(content=self.attempt.content,
                                                                   reasoning=self.attempt.reasoning,
                                                                   completion_tokens=self.attempt.completion_tokens)
