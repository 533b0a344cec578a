"""A ticket tracker as tools and a task type: `ORCH_EXTENSIONS=examples.tickets`.

- tools.py: `tickets_search` (read_only), `tickets_create` (keyed, with a probe that asks the
  tracker by idempotency key) and `tickets_comment` (non_idempotent: an agent's call waits for a
  reviewer; an unknown outcome goes to review);
- tasktypes.py: `tickets.escalate`, which finds or opens a ticket and comments on it;
- tracker.py: the tracker itself, a small HTTP server to try them against
  (`python -m examples.tickets.tracker --port 8765`), at TICKETS_URL (default http://127.0.0.1:8765).
"""
from . import tasktypes, tools  # noqa: F401  (each registers what it defines)
