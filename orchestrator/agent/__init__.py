"""The LLM agent's parts: its tools (toolbox) and its durable dialog (history); the task type is
orchestrator/tasktypes/agent.py."""
