"""The step contract: what a task type declares and what the engine guarantees it."""
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel

if TYPE_CHECKING:
    from ..engine.context import StepContext
    from ..engine.inbox import Applied
    from ..models import Task


@dataclass(frozen=True)
class StepSpec:
    id: str
    title: str = ""
    depends_on: tuple[str, ...] = ()
    reads: tuple[str, ...] = field(default=())  # the param keys the step is declared to read
    # After its retries: "needs_human" | "skip" | "fail"; "" means the type's on_step_failure.
    on_failure: str = ""
    # Run even when a dependency was skipped (ctx.skipped says which, with their errors);
    # otherwise a skipped dependency skips this step too.
    runs_after_skipped: bool = False
    # Steps added at run time only: pending steps that must wait for this one (they then
    # depend on it and see its result in ctx.deps), e.g. a summary that must use a re-parse.
    before: tuple[str, ...] = ()
    # Seconds the step may run before it is cancelled through its token; the cut is a failed
    # attempt (its retries, then its failure policy, apply). None: the type's `step_timeout`,
    # else ORCH_STEP_TIMEOUT_SECONDS. Read from the type's plan at each run (and from steps
    # added in the same run): a step added by an earlier run gets the type's default.
    timeout: float | None = None
    # Whether a Pause (after ORCH_PAUSE_GRACE_SECONDS) or a limit running out may cut the step
    # in flight to run it again on resume. Safe by default: effects go through ctx.effect, and
    # a step is never cut while a non-idempotent effect of it is in flight. False: always let
    # it finish (a step that acts on the world outside ctx.effect).
    safe_to_cancel: bool = True

    def __post_init__(self):
        if self.on_failure not in ("", *FAILURE_POLICIES):
            raise ValueError(f"step {self.id!r}: on_failure must be one of {', '.join(FAILURE_POLICIES)}")
        if self.timeout is not None and not self.timeout > 0:
            raise ValueError(f"step {self.id!r}: timeout must be a positive number of seconds, or None for the "
                             f"type's default")


# What happens when a step has failed for good (its retries used up, or the same failure twice):
# - needs_human: the task waits for an operator (fix the cause and Resume, or Skip step);
# - skip: the step is skipped (and its dependants, unless they run after skipped steps), the task goes on;
# - fail: the task ends `failed`.
FAILURE_POLICIES = ("needs_human", "skip", "fail")

# What a resume does when the code changed since the task paused (TaskType.on_incompatible_resume).
RESUME_POLICIES = ("pin", "migrate", "ask")


class TaskType:
    """Subclass (from orchestrator.sdk), set `name`, `Params` and implement `plan` and
    `run_step`; decorate it with `register_task_type` in a module of ORCH_EXTENSIONS
    (docs/extending.md; the demo's in demo/tasktypes/)."""

    name: ClassVar[str]
    title: ClassVar[str] = ""
    description: ClassVar[str] = ""
    Params: ClassVar[type[BaseModel]]
    on_step_failure: ClassVar[str] = "needs_human"  # one of FAILURE_POLICIES; a StepSpec may override it
    # Seconds a step of this type may run (StepSpec.timeout overrides it); None: ORCH_STEP_TIMEOUT_SECONDS.
    step_timeout: ClassVar[float | None] = None

    # The compatibility gate of a resume (engine/compat.py, docs/operating.md "Resuming after a
    # deploy"): a paused task records the fingerprint of the code it ran against (`version`, a
    # digest of `plan`, the schemas of the tools in `uses_tools`); a resume on code whose
    # fingerprint differs follows `on_incompatible_resume`:
    # - "ask" (the default): refused until an operator, shown the differences, accepts them;
    # - "pin": refused, with the differences (finish it on the old code, or start a new task);
    # - "migrate": `migrate(params, differences)` gives the params it continues with.
    # Raise `version` when a change breaks what a paused task holds (a result's shape, a step id).
    version: ClassVar[str] = "1"
    uses_tools: ClassVar[tuple[str, ...]] = ()  # the tools its steps call (call_tool / ctx.effect)
    on_incompatible_resume: ClassVar[str] = "ask"  # one of RESUME_POLICIES

    def plan(self, params: BaseModel) -> list[StepSpec]:
        raise NotImplementedError

    def compat_fingerprint(self, params: dict) -> dict[str, str]:
        """The flat {key: value} map a paused task is compared on (tasktypes/fingerprint.py);
        extend it (call super()) with digests of your own, e.g. a prompt template's."""
        from .fingerprint import base_fingerprint

        return base_fingerprint(self, params)

    def migrate(self, params: dict, differences: list[dict]) -> dict:
        """With on_incompatible_resume = "migrate": the params a paused task continues with on
        this code, from those it paused with and the `differences` ({"key", "before", "after",
        "text"} each). Pure: it may run for a preview too. Raise ValueError to refuse the resume
        (the message is shown). Finished steps are kept; to re-run some, edit the params instead."""
        raise NotImplementedError(f"{self.name} has on_incompatible_resume = 'migrate' but no migrate()")

    def run_step(self, ctx: "StepContext", step_id: str) -> Any:
        """Execute one step; return a JSON-serialisable result (committed with the step)."""
        raise NotImplementedError

    # Event types (engine/inbox.py REGISTRY) this type acts on at a resume point, beyond the
    # operator controls and the information types every task takes; handle_event decides.
    event_types: ClassVar[tuple[str, ...]] = ()
    # Event types its steps wait for (ctx.wait_for): accepted, and left for the wait to take.
    awaited_event_types: ClassVar[tuple[str, ...]] = ()

    def handle_event(self, event) -> "Applied":
        """Apply one inbox event of `event_types` (an InboundEvent) at a resume point:
        return inbox.Applied(outcome, add_steps=[StepSpec...]) — committed, with the steps,
        in the consumption's checkpoint."""
        raise NotImplementedError(f"{self.name} lists event types but does not handle them")

    def authorize(self, params: dict, *, actor, before: dict | None = None) -> list[tuple[str, str]]:
        """Refusals (field, message) when `actor` may not start a task with `params` (validated),
        or edit `before` into them: the place for grants only some roles may give."""
        return []

    def grants(self, params: dict) -> dict:
        """What `params` grant beyond the type's safe defaults (recorded in the audit log)."""
        return {}

    # Urgent subtasks a `preempt` event may name (engine/preemption.py): name -> what it does.
    subtasks: ClassVar[dict[str, str]] = {}

    def plan_subtask(self, name: str, args: dict, params: BaseModel, event_seq: int) -> list[StepSpec]:
        """The steps of the urgent subtask `name` (one of `subtasks`), run before anything
        else of the task; raise ValueError with a message a person can act on when `args`
        do not make sense. Step ids must be new to the plan (`event_seq` helps)."""
        raise NotImplementedError(f"{self.name} declares subtasks but does not plan them")

    def frame_references(self, params: BaseModel) -> dict:
        """What a suspended frame holds on to outside the database (resources, temporary
        files and their cleanup policy), recorded in the frame so an operator sees it."""
        return {}

    def frame_temp_files(self, params: BaseModel, task_id: int, *, interrupted: list[str],
                         steps: list[str]) -> list[str]:
        """The files a preemption leaves to clean up: those the `interrupted` steps had begun
        (they write them anew when they run again) and those the subtask's `steps` write.
        Recorded in the frame (`references.temp_files`) and deleted when the frame is popped
        (engine/preemption.py); absolute paths, the type's own scratch files only."""
        return []

    def regenerate_added_steps(self, old_params: dict, new_params: dict) -> bool:
        """After a parameter edit: should the steps that steps added at run time be dropped
        and their adders run again (to add them anew from the new params)? By default they
        stay as long as their adder is kept (an invalidated adder always re-adds its steps)."""
        return False

    def on_rollback(self, task: "Task", kept: set[str]) -> dict:
        """Undo the type's own records that steps not in `kept` wrote (they ran after the version
        rolled back to), inside the rollback's transaction: {what: how many}, for its event and
        audit entry. The world outside (emails, POSTs) is never undone: the preview lists it."""
        return {}

    def validate_resources(self, task: "Task") -> None:
        """Before a recovered task continues: raise with a message if an external resource
        it relies on is gone (the task then needs a human)."""

    def params_schema(self) -> dict:
        return self.Params.model_json_schema()
