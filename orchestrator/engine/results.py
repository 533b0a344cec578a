"""Step results as a runner needs them: loaded when a dependant runs, not all at start.

A result larger than ORCH_RESULT_INLINE_BYTES is stored apart (a StepResult row) and read
only here, or when a page or the API asks for it — a run whose remaining steps do not
depend on it never loads it.
"""
from collections import OrderedDict
from typing import Any

from ..models import Step, StepResult

CACHED = 256  # results of the latest steps kept in memory for their dependants


class ResultCache:
    def __init__(self, task_id: int, size: int = CACHED):
        self.task_id = task_id
        self.size = size
        self._cache: OrderedDict[str, Any] = OrderedDict()

    def put(self, step_id: str, result: Any) -> None:
        self._cache[step_id] = result
        self._cache.move_to_end(step_id)
        while len(self._cache) > self.size:
            self._cache.popitem(last=False)

    def get_many(self, step_ids) -> dict[str, Any]:
        """The results of `step_ids` (None for a step without one, e.g. a skipped one)."""
        found = {sid: self._cache[sid] for sid in step_ids if sid in self._cache}
        missing = [sid for sid in step_ids if sid not in found]
        if missing:
            found.update(load(self.task_id, missing))
        return {sid: found.get(sid) for sid in step_ids}


def load(task_id: int, step_ids: list[str]) -> dict[str, Any]:
    rows = list(Step.objects.filter(task_id=task_id, step_id__in=step_ids)
                .values_list("step_id", "result", "result_stored_apart"))
    loaded = {sid: result for sid, result, apart in rows if not apart}
    apart = [sid for sid, _, stored_apart in rows if stored_apart]
    if apart:
        loaded.update(StepResult.objects.filter(task_id=task_id, step_id__in=apart).values_list("step_id", "data"))
    return loaded


def result_of(step: Step) -> Any:
    """A Step row's result, wherever it is stored."""
    if not step.result_stored_apart:
        return step.result
    return StepResult.objects.filter(task_id=step.task_id, step_id=step.step_id).values_list("data", flat=True).first()
