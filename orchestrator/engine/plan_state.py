"""The runner's view of a task's plan (PlanState): which steps are pending, ready, running,
done or skipped, kept incrementally in memory. Only the lease holder changes step states, and
only once the checkpoint that records the change committed (engine/checkpoint.py)."""
import heapq
from dataclasses import dataclass, field

from ..models import StepStatus, Task
from ..primitives.errors import HarnessError

FINISHED = (StepStatus.DONE, StepStatus.SKIPPED)


class InvalidPlanGrowth(HarnessError, ValueError):
    """A step tried to add steps that cannot join the plan (a duplicate id, an unknown dependency)."""


@dataclass
class PlanState:
    """The runner's view of the plan; only the lease holder changes step states.

    Kept incrementally: counters of done and finished steps, each step's dependants and
    its number of unfinished dependencies, and a ready queue (by plan position) of pending
    steps whose dependencies are all finished — so nothing rescans the plan per step."""

    order: list[str] = field(default_factory=list)
    depends_on: dict[str, tuple[str, ...]] = field(default_factory=dict)
    status: dict[str, str] = field(default_factory=dict)
    attempts: dict[str, int] = field(default_factory=dict)
    fingerprints: dict[str, str] = field(default_factory=dict)
    generations: dict[str, int] = field(default_factory=dict)
    on_failure: dict[str, str] = field(default_factory=dict)  # steps with a policy of their own
    runs_after_skipped: set[str] = field(default_factory=set)
    added_by: dict[str, str] = field(default_factory=dict)  # steps added at run time, by their adder
    position: dict[str, int] = field(default_factory=dict)
    dependants: dict[str, list[str]] = field(default_factory=dict)
    unfinished_deps: dict[str, int] = field(default_factory=dict)
    version: int = 0  # the task's checkpoint version as this runner last committed it
    stack: list = field(default_factory=list)  # the task stack (engine/preemption.py), as committed
    running: set = field(default_factory=set)  # steps in flight in this run (the runner keeps it)
    done: int = 0
    finished_count: int = 0
    _ready: list[tuple[int, str]] = field(default_factory=list)
    _queued: set[str] = field(default_factory=set)

    # --- building ---------------------------------------------------------------------------
    def add(self, step_id: str, depends_on, status: str = StepStatus.PENDING, *, position: int | None = None,
            attempts: int = 0, fingerprint: str = "", generation: int = 0, on_failure: str = "",
            runs_after_skipped: bool = False, added_by: str = "") -> None:
        self.order.append(step_id)
        self.position[step_id] = len(self.order) - 1 if position is None else position
        self.depends_on[step_id] = tuple(depends_on)
        self.status[step_id] = status
        self.attempts[step_id] = attempts
        self.dependants.setdefault(step_id, [])
        if fingerprint:
            self.fingerprints[step_id] = fingerprint
        if generation:
            self.generations[step_id] = generation
        if on_failure:
            self.on_failure[step_id] = on_failure
        if runs_after_skipped:
            self.runs_after_skipped.add(step_id)
        if added_by:
            self.added_by[step_id] = added_by
        unfinished = 0
        for dep in self.depends_on[step_id]:
            self.dependants.setdefault(dep, []).append(step_id)
            if self.status.get(dep) not in FINISHED:
                unfinished += 1
        self.unfinished_deps[step_id] = unfinished
        if status == StepStatus.DONE:
            self.done += 1
        if status in FINISHED:
            self.finished_count += 1
        self.requeue(step_id)

    def add_dependency(self, step_id: str, dependency: str) -> None:
        """`step_id` (pending, not running) now waits for `dependency` too (StepSpec.before)."""
        self.depends_on[step_id] = (*self.depends_on[step_id], dependency)
        self.dependants.setdefault(dependency, []).append(step_id)
        if self.status.get(dependency) not in FINISHED:
            self.unfinished_deps[step_id] += 1  # its queue entry, if any, is stale now

    def next_position(self) -> int:
        return max(self.position.values(), default=-1) + 1

    # --- state changes ------------------------------------------------------------------------
    def set_status(self, step_id: str, status: str) -> None:
        old = self.status[step_id]
        if old == status:
            return
        self.status[step_id] = status
        self.done += (status == StepStatus.DONE) - (old == StepStatus.DONE)
        was_finished, is_finished = old in FINISHED, status in FINISHED
        if was_finished != is_finished:
            self.finished_count += 1 if is_finished else -1
            for dependant in self.dependants.get(step_id, ()):
                self.unfinished_deps[dependant] += -1 if is_finished else 1
                if is_finished:
                    self.requeue(dependant)
        self.requeue(step_id)

    def requeue(self, step_id: str) -> None:
        """Put a pending step whose dependencies are finished in the ready queue (once)."""
        if (self.status[step_id] == StepStatus.PENDING and not self.unfinished_deps[step_id]
                and step_id not in self._queued):
            self._queued.add(step_id)
            heapq.heappush(self._ready, (self.position[step_id], step_id))

    def take_ready(self, count: int, eligible=lambda step_id: True) -> list[str]:
        """Up to `count` ready steps in plan order, taken out of the queue; steps that are
        ready but not `eligible` now (a retry waiting out its backoff) stay queued."""
        taken, held = [], []
        while self._ready and len(taken) < count:
            entry = heapq.heappop(self._ready)
            step_id = entry[1]
            self._queued.discard(step_id)
            if self.status[step_id] != StepStatus.PENDING or self.unfinished_deps[step_id]:
                continue  # stale entry: the step moved on since it was queued
            if eligible(step_id):
                taken.append(step_id)
            else:
                held.append(entry)
        for entry in held:
            self._queued.add(entry[1])
            heapq.heappush(self._ready, entry)
        return taken

    # --- questions ----------------------------------------------------------------------------
    def has_ready(self) -> bool:
        """Whether the ready queue holds a step (it may hold stale entries: then it says yes)."""
        return bool(self._ready)

    def done_count(self) -> int:
        return self.done

    def finished(self, step_id: str) -> bool:
        """Done, or skipped: either way, nothing more to run for it."""
        return self.status[step_id] in FINISHED

    def all_finished(self) -> bool:
        return self.finished_count == len(self.order)

    def skip_cascade(self, step_id: str) -> list[str]:
        """`step_id` and every unfinished step that (transitively) depends on it and does
        not run after skipped steps — in plan order (dependencies first)."""
        skipped, frontier = {step_id}, [step_id]
        while frontier:
            for dependant in self.dependants.get(frontier.pop(), ()):
                if dependant in skipped or self.finished(dependant) or dependant in self.runs_after_skipped:
                    continue
                skipped.add(dependant)
                frontier.append(dependant)
        return [step_id] + sorted(skipped - {step_id}, key=self.position.__getitem__)

    def validate_growth(self, adder: str, specs: list) -> None:
        """Raise InvalidPlanGrowth unless `specs` can join the plan as they are."""
        known = set()
        for spec in specs:
            if spec.id in self.status or spec.id in known:
                raise InvalidPlanGrowth(f"step {adder!r} tried to add step {spec.id!r}, but the plan already "
                                        f"has a step with that id")
            missing = [d for d in spec.depends_on if d not in self.status and d not in known]
            if missing:
                raise InvalidPlanGrowth(f"step {adder!r} added step {spec.id!r} depending on {missing}, which are "
                                        f"neither in the plan nor added before it")
            late = [b for b in spec.before if self.status.get(b) != StepStatus.PENDING or b in self.running]
            if late:
                raise InvalidPlanGrowth(f"step {adder!r} put step {spec.id!r} before {late}, which are not pending "
                                        f"steps of the plan (a step can only be put before one that has not started)")
            known.add(spec.id)

    def snapshot_state(self, task: Task) -> dict:
        """The full state of the current version (O(plan): written every FULL_EVERY versions)."""
        state = {"params": task.params, "limits": task.limits, "status": task.status,
                 "steps": {sid: self.status[sid] for sid in self.order},
                 "counters": {"steps_done": self.done_count(), "tokens_used": task.tokens_used,
                              "active_seconds": round(task.active_seconds, 3)}}
        generations = {sid: g for sid, g in self.generations.items() if g}
        if generations:  # only steps re-run after an edit or rollback
            state["generations"] = generations
        if self.added_by:
            state["added_by"] = dict(self.added_by)
        state["stack"] = list(self.stack)
        return state


def plan_from(rows) -> PlanState:
    """The plan from its Step rows (PLAN_FIELDS, in plan order)."""
    plan = PlanState()
    for step_id, depends_on, status, attempts, fingerprint, generation, on_failure, after_skipped, added_by, \
            position in rows:
        # A step that was running when its worker died, or failed before a resume, runs again.
        status = StepStatus.PENDING if status in (StepStatus.RUNNING, StepStatus.FAILED) else status
        plan.add(step_id, depends_on, status, position=position, attempts=attempts, fingerprint=fingerprint,
                 generation=generation, on_failure=on_failure, runs_after_skipped=after_skipped, added_by=added_by)
    return plan
