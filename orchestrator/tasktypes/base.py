"""The step contract: what a task type declares (DESIGN "The step contract")."""
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel

if TYPE_CHECKING:
    from ..engine.context import StepContext
    from ..models import Task


@dataclass(frozen=True)
class StepSpec:
    id: str
    title: str = ""
    depends_on: tuple[str, ...] = ()
    reads: tuple[str, ...] = field(default=())  # the param keys the step is declared to read


class TaskType:
    """Subclass, set `name`, `Params` and implement `plan` and `run_step`; then add the
    module to TASK_TYPE_MODULES in orchestrator/tasktypes/__init__.py."""

    name: ClassVar[str]
    title: ClassVar[str] = ""
    description: ClassVar[str] = ""
    Params: ClassVar[type[BaseModel]]

    def plan(self, params: BaseModel) -> list[StepSpec]:
        raise NotImplementedError

    def run_step(self, ctx: "StepContext", step_id: str) -> Any:
        """Execute one step; return a JSON-serialisable result (committed with the step)."""
        raise NotImplementedError

    def validate_resources(self, task: "Task") -> None:
        """Before a recovered task continues: raise with a message if an external resource
        it relies on is gone (the task then needs a human)."""

    def params_schema(self) -> dict:
        return self.Params.model_json_schema()
