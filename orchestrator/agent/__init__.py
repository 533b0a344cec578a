"""The LLM agent's parts: its tools (toolbox) and its durable dialog (history); the task type is
orchestrator/tasktypes/agent.py."""

# The toolbox with all its sources, whichever module of this package is imported first: the
# tools of the declared MCP servers register themselves as a source (agent/mcp.py imports the
# toolbox; the toolbox does not import it, so the two do not import each other).
from . import toolbox  # noqa: E402,F401
from . import mcp  # noqa: E402,F401
