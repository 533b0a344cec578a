"""A tool for long agent runs (tests/agent/test_compaction.py), loaded with ORCH_EXTENSIONS as
any extension's: item_read(item) returns the item's value and a few hundred characters of notes,
so that a run of many turns outgrows a small context window."""
from pydantic import BaseModel, ConfigDict, Field

from orchestrator.sdk import READ_ONLY, ToolCall, tool

NOTES = 60  # words of notes per item


def value_of(item: int) -> int:
    return item * 37 % 101


class ItemArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    item: int = Field(..., ge=1, le=100_000)


@tool("item_read", effect=READ_ONLY, description="Read one item: its value and notes.")
def item_read(args: ItemArgs, call: ToolCall):
    notes = " ".join(f"note{(args.item * 13 + i) % 997}" for i in range(NOTES))
    return {"item": args.item, "value": value_of(args.item), "notes": notes}
