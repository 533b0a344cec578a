"""The harness's overhead per LLM turn and per tool call of agent.plan_execute, against the
stand-in model server with zero think time (no token pacing): wall time of the run minus
the time inside the model calls and inside the tools, per turn and per tool call; commits
and SQL statements; bytes the dialog and the steps keep in the database.

    .venv/bin/python bench/agent.py [--contracts 20] [--runs 3]
    DATABASE_URL=postgres://postgres@127.0.0.1:5432/bench_agent .venv/bin/python bench/agent.py
    .venv/bin/python bench/agent.py --long 200 [--window 8192]

--long N: one agent reading N items, one per turn, in a model window of --window tokens (the
dialog is compacted as it goes; tool `item_read` from tests/agent/long_run_tools.py): the
harness's overhead per turn near turn 10 and near the last turn (a history rebuilt from more
and more rows would make the late turns slower), and the request size over the run.

Prints figures; asserts nothing.
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import _django  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contracts", type=int, default=20)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--long", type=int, default=0, help="one long run of this many turns instead")
    parser.add_argument("--window", type=int, default=8192)
    args = parser.parse_args()
    if args.long:
        _django.setup("bench_agent_long", ORCH_EXTENSIONS="tests.agent.long_run_tools",
                      LLM_CONTEXT_WINDOW=str(args.window))
        long_run(args.long, args.window)
        return
    _django.setup("bench_agent")

    from django.conf import settings
    from django.db import connection

    from bench.measure import DjangoCounters
    from orchestrator.agent import toolbox
    from orchestrator.engine import services
    from orchestrator.engine.worker import drive_inline
    from orchestrator.llm import client as llm_client
    from orchestrator.llm.standin import StandinServer
    from orchestrator.models import AgentMessage, Step, TaskEvent

    timed = {"model": 0.0, "tools": 0.0}
    real_chat, real_call = llm_client.LLMClient.chat, toolbox.call

    def chat(self, *a, **k):
        started = time.perf_counter()
        try:
            return real_chat(self, *a, **k)
        finally:
            timed["model"] += time.perf_counter() - started

    def call(*a, **k):
        started = time.perf_counter()
        try:
            return real_call(*a, **k)
        finally:
            timed["tools"] += time.perf_counter() - started

    llm_client.LLMClient.chat, toolbox.call = chat, call
    counters = DjangoCounters().install()
    goal = f"Parse the {args.contracts} contracts and remember the summary"
    rows = []
    with StandinServer(token_seconds=0) as model:
        settings.LLM_BASE_URL, settings.LLM_API_KEY, settings.LLM_MODEL = model.base_url, "standin", "standin-planner"
        for _ in range(args.runs):
            timed.update(model=0.0, tools=0.0)
            commits0, statements0 = counters.read()
            task = services.task_create(type="agent.plan_execute", params={
                "goal": goal, "tools": ["contracts_list", "contracts_read", "memory_write"]})
            started = time.perf_counter()
            outcome = drive_inline(task.pk, watched=True)
            wall = time.perf_counter() - started
            commits, statements = (n - m for n, m in zip(counters.read(), (commits0, statements0)))
            turns = Step.objects.filter(task=task, step_id__startswith="turn-").count()
            tools = Step.objects.filter(task=task, step_id__startswith="tool-").count()
            steps = turns + tools
            overhead = wall - timed["model"] - timed["tools"]
            dialog_bytes = sum(len(m.content) + len(json.dumps(m.tool_calls)) for m in AgentMessage.objects.filter(task=task))
            step_bytes = sum(len(json.dumps(s.result)) for s in Step.objects.filter(task=task))
            events = TaskEvent.objects.filter(task=task).count()
            rows.append({"outcome": outcome, "turns": turns, "tools": tools, "wall": wall, "model": timed["model"],
                         "tool_time": timed["tools"], "overhead_per_step_ms": overhead / steps * 1000,
                         "commits_per_step": commits / steps, "statements_per_step": statements / steps,
                         "dialog_bytes": dialog_bytes, "step_bytes": step_bytes, "events": events})
    print(f"agent.plan_execute on {_django.database_label()} ({connection.vendor}), stand-in model, zero think time, "
          f"goal: {goal!r}, {args.runs} runs")
    first = rows[0]
    print(f"  per run: {first['turns']} LLM turns, {first['tools']} tool calls, outcome {first['outcome']}")
    for key, label in (("wall", "wall time (s)"), ("model", "inside model calls (s)"),
                       ("tool_time", "inside tools (s)"), ("overhead_per_step_ms", "harness overhead per step (ms)"),
                       ("commits_per_step", "commits per step"), ("statements_per_step", "SQL statements per step"),
                       ("dialog_bytes", "dialog bytes (AgentMessage)"), ("step_bytes", "step result bytes"),
                       ("events", "progress events")):
        values = [r[key] for r in rows]
        print(f"  {label:34s} median {statistics.median(values):10.2f}   min {min(values):10.2f}")
    print("  (a step is an LLM turn or a tool call; overhead = wall - model - tools, spread over the steps;")
    print("   commits: Django's transaction commits — a statement run in autocommit, as each step's PostgreSQL")
    print("   commit statement and the turn's fenced writes are, commits on its own and is not counted)")


def long_run(items: int, window: int) -> None:
    from django.conf import settings
    from django.db import connection

    from orchestrator.agent import compaction, toolbox
    from orchestrator.engine import services
    from orchestrator.engine.worker import drive_inline
    from orchestrator.llm import client as llm_client
    from orchestrator.llm.standin import StandinServer, _estimate_prompt_tokens
    from orchestrator.models import Step

    calls: list[tuple[float, float, bool]] = []  # (start, end, is a summary) of each model call
    tool_time: list[tuple[float, float]] = []
    real_chat, real_call = llm_client.LLMClient.chat, toolbox.call

    def chat(self, messages, *a, **k):
        started = time.perf_counter()
        try:
            return real_chat(self, messages, *a, **k)
        finally:
            calls.append((started, time.perf_counter(), messages[0].get("content") == compaction.SUMMARY_PROMPT))

    def call(*a, **k):
        started = time.perf_counter()
        try:
            return real_call(*a, **k)
        finally:
            tool_time.append((started, time.perf_counter()))

    llm_client.LLMClient.chat, toolbox.call = chat, call
    goal = f"Read items 1 to {items} with item_read, one per turn, keeping a running total; then answer with the total."
    with StandinServer(token_seconds=0) as model:
        settings.LLM_BASE_URL, settings.LLM_API_KEY = model.base_url, "standin"
        settings.LLM_MODEL = f"standin-planner+context_window={window}"
        task = services.task_create(type="agent.plan_execute", params={
            "goal": goal, "tools": ["item_read"], "max_turns": items + 10, "max_tokens_per_call": 300})
        started = time.perf_counter()
        outcome = drive_inline(task.pk)
        wall = time.perf_counter() - started
        requests = [r for r in model.requests if r.path.endswith("/chat/completions")]
    turn_calls = [c for c in calls if not c[2]]
    # A turn's overhead: from the end of its model call to the start of the next turn's, less the
    # time inside tools between them; turns next to a compaction are left out (they include it).
    overheads = []
    for (_, end, _), (start_next, _, _) in zip(turn_calls, turn_calls[1:]):
        if any(end <= c[0] < start_next for c in calls if c[2]):
            overheads.append(None)
            continue
        inside = sum(min(t1, start_next) - max(t0, end) for t0, t1 in tool_time if t0 < start_next and t1 > end)
        overheads.append((start_next - end - inside) * 1000)

    def near(turn: int) -> float:
        around = [o for o in overheads[max(0, turn - 6):turn + 5] if o is not None]
        return statistics.median(around)

    sizes = [_estimate_prompt_tokens(r.body) for r in requests if r.body["messages"][0].get("content")
             != compaction.SUMMARY_PROMPT]
    compactions = sum(1 for s in Step.objects.filter(task=task, step_id__startswith="compact-", status="done")
                      if (s.result or {}).get("compacted"))
    print(f"agent.plan_execute, one run of {items} items on {_django.database_label()} ({connection.vendor}), stand-in "
          f"model with a {window}-token window, zero think time: outcome {outcome}, {len(turn_calls)} turns, "
          f"{compactions} compactions, wall {wall:.1f} s")
    early, late = near(10), near(len(overheads) - 5)
    print(f"  harness overhead per turn near turn 10: {early:8.1f} ms   near turn {len(overheads)}: {late:8.1f} ms   "
          f"ratio {late / early:.2f} (turns next to a compaction left out)")
    marks = sorted({0, 9, len(sizes) // 4, len(sizes) // 2, 3 * len(sizes) // 4, len(sizes) - 1})
    print("  request size (estimated prompt tokens) at turn: "
          + ", ".join(f"{m + 1}: {sizes[m]}" for m in marks) + f"; largest {max(sizes)} of the {window}-token window")


if __name__ == "__main__":
    main()
