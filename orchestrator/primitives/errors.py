"""The harness's two kinds of exception.

`HarnessError`: every error the harness raises to whoever called it (an operator's request, a
reviewer's decision, an engineer's task type or tool through `orchestrator.sdk`, the API, the
command line) derives from it, and its text is a message a person can act on: what was refused
and what to do instead. `except HarnessError` catches what the harness refused, and nothing else.

`StepSignal`: control flow that passes *through* a step's code to the runner — a wait for an
event (`WaitForEvent`), a limit that ran out (`LimitExceeded`), an effect in doubt
(`AmbiguousEffect`), a lease another worker took (`LeaseLost`). It derives from BaseException, as
asyncio's CancelledError and KeyboardInterrupt do, so that a step's `except Exception:` cannot
swallow it: a step that did would complete as if its event had come, commit past an effect
nobody settled, or go on after another worker took its task. Catch one by name, and re-raise.

Not a StepSignal: `Cancelled` (primitives/cancellation.py). A tool raises it to say "stopped
before anything was performed", and tools and clients catch it by name; a step that swallows it
is ended by the Stop's grace (escalated to Force-terminate), not by the exception.
"""


class HarnessError(Exception):
    """An error the harness raises for a person to read: its text says what to do."""

    @property
    def user_message(self) -> str:
        return str(self)


class StepSignal(BaseException):
    """Control flow from the harness through a step to the runner; never a step's failure."""
