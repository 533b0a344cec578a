"""The agent's read tools over the demo's sample contracts, declared with orchestrator.sdk's
@tool as any extension's: read_only (run at once in the step, no WAL entry) and granted by
default, so an agent created with only a goal can read the contracts, as before the demo
moved out of the core."""
from pydantic import BaseModel, ConfigDict, Field

from orchestrator.sdk import READ_ONLY, ToolCall, ToolError, tool

from .tasktypes.contract_extraction import MalformedContract, list_samples, read_contract


class ContractsListArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    limit: int = Field(20, ge=1, le=100, description="how many contracts to list")


class ContractsReadArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    contract: int = Field(..., ge=1, description="the contract's number, from contracts_list")


@tool("contracts_list", effect=READ_ONLY, granted_by_default=True,
      description="List the contracts there are to read (number and file name).")
def contracts_list(args: ContractsListArgs, call: ToolCall):
    return {"contracts": [{"contract": i, "file": path.name}
                          for i, path in enumerate(list_samples()[:args.limit], start=1)]}


@tool("contracts_read", effect=READ_ONLY, granted_by_default=True,
      description="Read one contract: its parties, dates (ISO) and money amounts.")
def contracts_read(args: ContractsReadArgs, call: ToolCall):
    samples = list_samples()
    if args.contract > len(samples):
        raise ToolError(f"there is no contract {args.contract}; contracts_list shows {len(samples)}")
    path = samples[args.contract - 1]
    try:
        return {"contract": args.contract, "file": path.name, **read_contract(path)}
    except MalformedContract as exc:
        raise ToolError(str(exc)) from None
