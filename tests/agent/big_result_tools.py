"""A tool whose result is far too long for a prompt (tests/agent/test_result_read.py), loaded with
ORCH_EXTENSIONS as any extension's: a line-numbered report of SIZE characters."""
from pydantic import BaseModel, ConfigDict

from orchestrator.sdk import READ_ONLY, ToolCall, tool

SIZE = 5_000_000


def report() -> str:
    lines, total, n = [], 0, 0
    while total < SIZE:
        line = f"line {n:07d}: measurement {n * 7919 % 100_003:06d}\n"
        lines.append(line)
        total += len(line)
        n += 1
    return "".join(lines)[:SIZE]


class ReportArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = "all"


@tool("report_fetch", effect=READ_ONLY, description="Fetch the measurement report (very long).")
def report_fetch(args: ReportArgs, call: ToolCall):
    return report()
