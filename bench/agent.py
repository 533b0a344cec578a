"""The harness's overhead per LLM turn and per tool call of agent.plan_execute, against the
stand-in model server with zero think time (no token pacing): wall time of the run minus
the time inside the model calls and inside the tools, per turn and per tool call; commits
and SQL statements; bytes the dialog and the steps keep in the database.

    .venv/bin/python bench/agent.py [--contracts 20] [--runs 3]
    DATABASE_URL=postgres://postgres@127.0.0.1:5432/bench_agent .venv/bin/python bench/agent.py

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
    args = parser.parse_args()
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
    print("  (a step is an LLM turn or a tool call; overhead = wall - model - tools, spread over the steps)")


if __name__ == "__main__":
    main()
