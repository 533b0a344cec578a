"""Task types: a registry by name. Adding a type is one module plus one line below."""
import importlib

from ..conf import harness
from .base import StepSpec, TaskType

TASK_TYPE_MODULES = [
    "orchestrator.tasktypes.migrate_rows",
    "orchestrator.tasktypes.contracts",
    "orchestrator.tasktypes.notify",
    "orchestrator.tasktypes.pipeline",
    "orchestrator.tasktypes.agent",
]


class UnknownTaskType(LookupError):
    pass


_registry: dict[str, TaskType] = {}


def register(cls: type[TaskType]) -> type[TaskType]:
    _registry[cls.name] = cls()
    return cls


def _load() -> dict[str, TaskType]:
    """The registered types of the modules configured now (settings may change in tests)."""
    modules = TASK_TYPE_MODULES + harness.extra_task_type_modules
    for module in modules:
        importlib.import_module(module)
    return {name: t for name, t in _registry.items() if type(t).__module__ in modules}


def all_types() -> dict[str, TaskType]:
    return dict(sorted(_load().items()))


def get_type(name: str) -> TaskType:
    types = _load()
    try:
        return types[name]
    except KeyError:
        raise UnknownTaskType(f"Unknown task type {name!r}; known types: {', '.join(sorted(types))}") from None


__all__ = ["StepSpec", "TaskType", "register", "get_type", "all_types", "UnknownTaskType"]
