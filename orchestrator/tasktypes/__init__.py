"""Task types: a registry by name. The core's own is the agent; every other type comes from an
extension (the demo app's, an installation's ORCH_EXTENSIONS) through orchestrator.sdk."""
import importlib

from .. import extensions
from ..conf import harness
from ..primitives.errors import HarnessError
from .base import StepSpec, TaskType

# The built-in type; the demo's (demo/) and an installation's come in as extensions.
TASK_TYPE_MODULES = [
    "orchestrator.tasktypes.agent",
]


class UnknownTaskType(HarnessError, LookupError):
    """No task type has this name (is its module in ORCH_EXTENSIONS?)."""


_registry: dict[str, TaskType] = {}


def register(cls: type[TaskType]) -> type[TaskType]:
    _registry[cls.name] = cls()
    return cls


def _load() -> dict[str, TaskType]:
    """The registered types of the modules configured now (settings may change in tests): the
    built-ins, ORCH_EXTRA_TASK_TYPES, and ORCH_EXTENSIONS (with their submodules; a module that
    cannot be imported raises, naming it)."""
    modules = TASK_TYPE_MODULES + harness.extra_task_type_modules
    for module in modules:
        importlib.import_module(module)
    extensions.require()
    return {name: t for name, t in _registry.items()
            if type(t).__module__ in TASK_TYPE_MODULES or extensions.configured(type(t).__module__)}


def all_types() -> dict[str, TaskType]:
    return dict(sorted(_load().items()))


def get_type(name: str) -> TaskType:
    types = _load()
    try:
        return types[name]
    except KeyError:
        raise UnknownTaskType(f"Unknown task type {name!r}; known types: {', '.join(sorted(types))}") from None


__all__ = ["StepSpec", "TaskType", "register", "get_type", "all_types", "UnknownTaskType"]
