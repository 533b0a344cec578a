"""Revising a paused task: edit its parameters, or roll it back to a snapshot version.

Both start with a preview (a dry run that changes nothing) and apply in one transaction,
refusing (409) when the task changed since the preview.

Impact of a parameter edit on each finished step:
- unaffected: it read none of the changed keys (the keys it *actually* read at run time,
  recorded by the step context) and depends on no invalidated step — kept as is;
- invalidated: it read a changed key, or depends (transitively) on an invalidated step —
  reset, and run again with new idempotency keys (a new step generation);
The remaining plan is regenerated from the new params (a new batch_size means new batches).

No silent repeats: a step that runs again performs its side effects again under new
idempotency keys. Idempotent ones (an upsert) replay harmlessly; every non-idempotent one
(an email, a POST) is listed in the preview ("will be sent again") and the apply is
refused (409) unless the operator confirms each by key (`repeat_effects`). Each confirmed
repeat is audited.
"""
from dataclasses import asdict, dataclass, field, replace

from django.db import transaction

from ..models import InboundEvent, Step, StepStatus, Task, TaskStatus as S, WalEntry, WalStatus
from ..tasktypes import get_type
from ..tasktypes.base import StepSpec
from ..tools.base import ToolError
from ..tools.catalog import get_tool
from . import actions, approvals, compat, inbox, scheduler, snapshots, states
from .checkpoint import snapshot_now
from .step_rows import step_row
from .events import append_event
from .inbox import INBOX_ADDER
from .audit import audit
from .services import FieldError, InvalidInput, authorize_params, validate_limits, validate_params


class StalePreview(states.InvalidTransition):
    """The task changed since the preview was made (HTTP 409)."""


class RepeatNotConfirmed(states.InvalidTransition):
    """The operation would perform non-idempotent effects again and the operator has not
    confirmed each of them (HTTP 409)."""

    def __init__(self, task: Task, missing: list[dict]):
        listed = "; ".join(f"{e['step']}: {e['tool']} {e['consequence']} ({e['idempotency_key']})" for e in missing[:10])
        super().__init__(task, S.QUEUED, f"Not applied: this would perform {len(missing)} non-idempotent side "
                         f"effect(s) again: {listed}. Confirm each one (repeat_effects: [keys]) to go ahead, or "
                         f"start a new task instead.")
        self.missing = missing


@dataclass
class Preview:
    task_id: int
    version: int  # the task's event seq when previewed: the apply refuses if it moved
    param_diff: dict = field(default_factory=dict)  # key -> [old, new]
    kept: list[str] = field(default_factory=list)
    rerun: list[str] = field(default_factory=list)  # finished steps invalidated
    removed: list[str] = field(default_factory=list)  # finished steps the new plan drops
    pending: list[str] = field(default_factory=list)  # steps still to run (new plan)
    # Side effects of the steps that run again, each with its `consequence` ("will be sent
    # again to ..."); the non-idempotent ones must be confirmed by key (`must_confirm`).
    repeated_effects: list[dict] = field(default_factory=list)
    must_confirm: list[str] = field(default_factory=list)
    effects_after: list[dict] = field(default_factory=list)  # rollback: effects after the version (not undone)
    rollback_to: int | None = None
    # The compatibility gate (engine/compat.py): the type's policy and what changed in its code
    # since the task paused; `needs_acceptance` (ask): confirm with accept_changes.
    compatibility: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


def _effects(task: Task, step_ids) -> list[dict]:
    effects = []
    for w in WalEntry.objects.filter(task=task, step_id__in=list(step_ids), status=WalStatus.DONE).order_by("id"):
        try:
            consequence = get_tool(w.tool).repeat_consequence(w.args, idempotent=w.idempotent)
        except ToolError:  # a tool no longer installed: say so plainly
            consequence = "will be performed again" if not w.idempotent else "replays (idempotent)"
        effects.append({"step": w.step_id, "tool": w.tool, "idempotency_key": w.idempotency_key,
                        "idempotent": w.idempotent, "consequence": consequence,
                        "completed_at": w.completed_at.isoformat() if w.completed_at else None})
    return effects


def _set_repeats(preview: Preview, task: Task, running_again) -> None:
    preview.repeated_effects = _effects(task, running_again)
    preview.must_confirm = [e["idempotency_key"] for e in preview.repeated_effects if not e["idempotent"]]


def _confirm_repeats(task: Task, preview: Preview, repeat_effects, *, actor, ip) -> None:
    """Refuse unless every non-idempotent repeat is confirmed; audit each confirmed one."""
    confirmed = set(repeat_effects or ())
    unknown = confirmed - set(preview.must_confirm)
    if unknown:
        raise InvalidInput([FieldError("repeat_effects", f"not an effect this operation repeats: "
                                                         f"{', '.join(sorted(unknown))}")])
    missing = [e for e in preview.repeated_effects if not e["idempotent"] and e["idempotency_key"] not in confirmed]
    if missing:
        raise RepeatNotConfirmed(task, missing)
    for effect in preview.repeated_effects:
        if not effect["idempotent"]:
            audit(action="effect.repeat_confirmed", actor=actor, ip=ip, task=task,
                  reason=f"{effect['tool']} {effect['consequence']}",
                  after={"idempotency_key": effect["idempotency_key"], "step": effect["step"], "tool": effect["tool"]})


# --- parameter edits ------------------------------------------------------------------------

def edited_params(task: Task, changes: dict) -> dict:
    """The params an edit asks for, validated: `changes` are merged over the task's current
    params (keys not given keep their values). The API, the pages and the CLI all mean this."""
    return validate_params(task.type, {**task.params, **(changes or {})})


def preview_edit(task: Task, new_params: dict, actor=None, *, admitted: dict | None = None) -> tuple[Preview, list]:
    """The impact of replacing `task.params` by `new_params` (already validated). A task
    whose type migrates params for changed code is previewed with the migration applied
    under the edit (`admitted`: the gate as apply_edit found it, the migration done)."""
    actions.require(task, "edit", actor)
    gate = admitted
    if gate is None:
        gate = compat.preview(task)
        if gate.get("migrated_params") is not None:
            new_params = compat.overlay(task.params, gate["migrated_params"], new_params)
    old = task.params
    changed = {k for k in set(old) | set(new_params) if old.get(k) != new_params.get(k)}
    preview = Preview(task_id=task.pk, version=task.event_seq,
                      param_diff={k: [old.get(k), new_params.get(k)] for k in sorted(changed)}, compatibility=gate)
    task_type = get_type(task.type)
    static_specs = task_type.plan(task_type.Params.model_validate(new_params))
    static_ids = {spec.id for spec in static_specs}
    steps = {s.step_id: s for s in Step.objects.filter(task=task).order_by("position")}
    invalid: set[str] = set()
    regenerate = any(s.added_by for s in steps.values()) and task_type.regenerate_added_steps(old, new_params)
    adders = {s.added_by for s in steps.values() if s.added_by}
    for step in steps.values():  # positions are a topological order: dependencies first
        reads = set(step.reads if step.status == StepStatus.DONE else step.declared_reads)
        if (reads & changed or any(dep in invalid for dep in step.depends_on)
                or (regenerate and step.step_id in adders)):
            invalid.add(step.step_id)
    spread = True
    while spread:  # a step put `before` an earlier one is a dependency later in position order
        spread = False
        for step in steps.values():
            if step.step_id not in invalid and any(dep in invalid for dep in step.depends_on):
                invalid.add(step.step_id)
                spread = True
    kept, dropped_added = set(), []
    for step in steps.values():
        survives = (step.step_id in static_ids if not step.added_by
                    else adder_stays(step.added_by, kept, lambda adder: True)
                    and (step.added_by.startswith(INBOX_ADDER) or not regenerate))
        if step.added_by and not survives:
            dropped_added.append(step.step_id)
        if step.status != StepStatus.DONE:
            continue
        if not survives:
            preview.removed.append(step.step_id)
        elif step.step_id in invalid:
            preview.rerun.append(step.step_id)
        else:
            preview.kept.append(step.step_id)
            kept.add(step.step_id)
    # Steps added by a step that runs again are dropped and added anew by it: their
    # effects may be performed again too.
    _set_repeats(preview, task, preview.rerun + [sid for sid in preview.removed if sid in set(dropped_added)])
    new_specs = static_specs + added_specs(steps.values(), kept)
    preview.pending = [spec.id for spec in new_specs if spec.id not in kept]
    return preview, new_specs


def added_specs(steps, kept: set[str], events_kept=lambda adder: True) -> list:
    """The steps added at run time that stay in a revised plan: those whose adder is kept
    (steps in position order, so an adder is decided before what it added), and those an
    inbox event added, while `events_kept(adder)` says the event still stands."""
    specs = []
    for step in steps:
        if step.added_by and adder_stays(step.added_by, kept, events_kept):
            before = tuple(step.before or ())
            specs.append(StepSpec(step.step_id, title=step.title, depends_on=tuple(step.depends_on),
                                  reads=tuple(step.declared_reads), on_failure=step.on_failure,
                                  runs_after_skipped=step.runs_after_skipped, before=before))
    return specs


def adder_stays(added_by: str, kept: set[str], events_kept) -> bool:
    if added_by.startswith(INBOX_ADDER):
        return events_kept(added_by)  # an event is not run again: what it added stays while it stands
    return added_by in kept


def events_consumed_by(task: Task, version: int):
    """For a rollback to `version`: the inbox adders whose event was consumed at or before it
    (events consumed later are not re-applied, EVENTS.md)."""
    seqs = set(InboundEvent.objects.filter(task=task, consumed_in_version__lte=version)
               .values_list("seq", flat=True))
    return lambda adder: int(adder[len(INBOX_ADDER):] or 0) in seqs


def with_before(specs: list) -> list:
    """`specs` with each `before` target depending on the step put in front of it."""
    extra: dict[str, list[str]] = {}
    for spec in specs:
        for target in spec.before:
            extra.setdefault(target, []).append(spec.id)
    if not extra:
        return specs
    return [replace(spec, depends_on=(*spec.depends_on, *[d for d in extra[spec.id] if d not in spec.depends_on]))
            if spec.id in extra else spec for spec in specs]


def kept_stack(stack: list, step_ids: set[str]) -> list:
    """The frames of `stack` whose subtask steps are all still in the plan."""
    return [frame for frame in stack or [] if all(s in step_ids for s in frame.get("steps", ()))]


def apply_edit(*, task_id: int, new_params: dict, expected_version: int | None, limits: dict | None = None,
               repeat_effects: list[str] | None = None, actor=None, ip=None, accept_changes: bool = False) -> Preview:
    with transaction.atomic():
        task = states.lock_task(task_id)
        actions.require(task, "edit", actor)
        _check_fresh(task, expected_version)
        # The code may have changed since the task paused: the type's policy first (engine/compat.py).
        gate = compat.preview(task)
        migrated = compat.admit(task, accept_changes=accept_changes, actor=actor, ip=ip, action="edit and resume")
        if migrated is not None:
            new_params = validate_params(task.type, compat.overlay(task.params, migrated, new_params))
        preview, new_specs = preview_edit(task, new_params, actor, admitted=gate)
        # An edit cannot grant what its author could not grant at creation (a tool that
        # reaches the host, a waived approval); what the task held already stays.
        granted = authorize_params(task.type, new_params, actor=actor, before=task.params)
        _confirm_repeats(task, preview, repeat_effects, actor=actor, ip=ip)
        before = {"params": task.params, "limits": task.limits, "checkpoint_version": task.checkpoint_version}
        task.params = new_params
        compat.record(task)  # what it continues on, with its new params
        if limits:
            task.limits = validate_limits({**task.limits, **limits})
        _rewrite_plan(task, new_specs, keep=set(preview.kept))
        append_event(task, "params_edited", {"diff": preview.param_diff, "rerun": preview.rerun[:200],
                                             "removed": preview.removed[:200]})
        states.transition(task, S.QUEUED, reason=f"parameters edited ({', '.join(preview.param_diff)}); resuming",
                          actor=actor, ip=ip, extra={"diff": preview.param_diff})
        audit(action="task.edit_params", actor=actor, ip=ip, task=task, before=before,
              after={"params": new_params, "limits": task.limits, "preview": preview.as_dict()})
        if granted and granted != {k: v for k, v in get_type(task.type).grants(before["params"]).items() if v}:
            audit(action="task.grant", actor=actor, ip=ip, task=task, reason="granted by a parameter edit",
                  after=granted)
        # An operator action like pause or resume: an inbox row with its outcome, committed with it.
        inbox.record_control(task, "edit", actor=actor, payload={
            "diff": preview.param_diff, "rerun": preview.rerun[:200], "removed": preview.removed[:200],
            "limits": task.limits if limits else None})
        inbox.settle_control(task, "edit", f"applied: parameters edited ({', '.join(preview.param_diff) or 'none'}); "
                                           f"{len(preview.rerun)} finished step(s) run again; queued from "
                                           f"checkpoint v{task.checkpoint_version}")
        scheduler.enqueue(task.pk)
    return preview


def _check_fresh(task: Task, expected_version: int | None) -> None:
    if expected_version is not None and expected_version != task.event_seq:
        raise StalePreview(task, S.QUEUED, f"Task #{task.pk} changed since this preview (it is now at event "
                           f"{task.event_seq}, the preview was made at {expected_version}); review the new preview.")


_REWRITTEN_FIELDS = ("position", "title", "depends_on", "declared_reads", "on_failure", "runs_after_skipped", "status",
                     "result", "error", "reads", "attempts", "failure_fingerprint", "started_at", "finished_at",
                     "generation")


def _rewrite_plan(task: Task, specs, *, keep: set[str]) -> None:
    """Make the Step rows match `specs`: keep the `keep` steps' results, reset every other
    step (new generation: new idempotency keys), drop steps no longer planned."""
    specs = with_before(specs)
    task.stack = kept_stack(task.stack, {spec.id for spec in specs})
    existing = {s.step_id: s for s in Step.objects.filter(task=task)}
    Step.objects.filter(task=task).exclude(step_id__in=[s.id for s in specs]).delete()
    # Only the rows an edit changes are written, in batches: an edit of a 10,000-step plan
    # that resets five steps wrote 10,000 rows one statement each (17 s on PostgreSQL).
    new, changed = [], []
    for position, spec in enumerate(specs):
        step = existing.get(spec.id)
        if step is None:
            new.append(step_row(task, spec, position))
            continue
        planned = {"position": position, "title": spec.title or spec.id, "depends_on": list(spec.depends_on),
                   "declared_reads": list(spec.reads), "on_failure": spec.on_failure,
                   "runs_after_skipped": spec.runs_after_skipped}
        dirty = any(getattr(step, name) != value for name, value in planned.items())
        for name, value in planned.items():
            setattr(step, name, value)
        if spec.id not in keep and (step.status != StepStatus.PENDING or step.attempts):
            step.status, step.result, step.error, step.reads = StepStatus.PENDING, None, "", []
            step.attempts, step.failure_fingerprint = 0, ""
            step.started_at = step.finished_at = None
            step.generation += 1
            dirty = True
        if dirty:
            changed.append(step)
    Step.objects.bulk_create(new, batch_size=2000)
    Step.objects.bulk_update(changed, _REWRITTEN_FIELDS, batch_size=500)
    task.steps_total = Step.objects.filter(task=task).count()
    task.steps_done = Step.objects.filter(task=task, status=StepStatus.DONE).count()
    task.checkpoint_version += 1
    task.save()
    snapshot_now(task)
    # A step reset or dropped will not take an open approval's decision: revoked.
    approvals.revoke(task_id=task.pk, reason="the step that asked was reset or removed by an edit or a rollback",
                     stale_steps_only=True)


# --- rollback ---------------------------------------------------------------------------------

def preview_rollback(task: Task, version: int, actor=None) -> Preview:
    actions.require(task, "rollback", actor)
    state = snapshots.materialize(task.pk, version)
    if state is None:
        raise states.InvalidTransition(task, S.QUEUED, f"Task #{task.pk} has no snapshot v{version}; "
                                       f"the kept versions are {snapshots.kept_versions(task.pk)}.")
    at_version = state.get("steps", {})
    gens_then = state.get("generations", {})
    preview = Preview(task_id=task.pk, version=task.event_seq, rollback_to=version,
                      compatibility=compat.preview(task, state["params"]),
                      param_diff={k: [task.params.get(k), state["params"].get(k)]
                                  for k in sorted(set(task.params) | set(state["params"]))
                                  if task.params.get(k) != state["params"].get(k)})
    task_type = get_type(task.type)
    static_specs = task_type.plan(task_type.Params.model_validate(state["params"]))
    static_ids = {spec.id for spec in static_specs}
    steps = list(Step.objects.filter(task=task).order_by("position"))
    kept: set[str] = set()
    events_kept = events_consumed_by(task, version)
    for step in steps:  # in position order: an added step's adder is decided first
        survives = adder_stays(step.added_by, kept, events_kept) if step.added_by else step.step_id in static_ids
        if (survives and at_version.get(step.step_id) == StepStatus.DONE
                and gens_then.get(step.step_id, 0) == step.generation):
            kept.add(step.step_id)
    for step in steps:
        if step.status == StepStatus.DONE:
            (preview.kept if step.step_id in kept else preview.rerun).append(step.step_id)
    preview.effects_after = _effects(task, preview.rerun)
    new_specs = static_specs + added_specs(steps, kept, events_kept)
    planned = {spec.id for spec in static_specs}
    # Steps that run again: the static ones re-planned, and added ones their adder adds anew.
    _set_repeats(preview, task, [sid for sid in preview.rerun
                                 if sid in planned or any(s.step_id == sid and s.added_by for s in steps)])
    preview.pending = [spec.id for spec in new_specs if spec.id not in kept]
    return preview


def apply_rollback(*, task_id: int, version: int, expected_version: int | None,
                   repeat_effects: list[str] | None = None, actor=None, ip=None, accept_changes: bool = False) -> Preview:
    with transaction.atomic():
        task = states.lock_task(task_id)
        preview = preview_rollback(task, version, actor)
        _check_fresh(task, expected_version)
        _confirm_repeats(task, preview, repeat_effects, actor=actor, ip=ip)
        before = {"params": task.params, "checkpoint_version": task.checkpoint_version}
        state = snapshots.materialize(task.pk, version)
        # The code may have changed since the task paused: the type's policy (engine/compat.py).
        migrated = compat.admit(task, accept_changes=accept_changes, actor=actor, ip=ip, action="roll back",
                                params=state["params"])
        task.params = state["params"] if migrated is None else migrated
        compat.record(task)
        task_type = get_type(task.type)
        steps = list(Step.objects.filter(task=task).order_by("position"))
        specs = task_type.plan(task_type.Params.model_validate(task.params)) + added_specs(
            steps, set(preview.kept), events_consumed_by(task, version))
        task.stack = kept_stack(state.get("stack") or [], {spec.id for spec in specs})
        _rewrite_plan(task, specs, keep=set(preview.kept))
        undone = task_type.on_rollback(task, set(preview.kept))
        append_event(task, "rolled_back", {"to_version": version, "rerun": preview.rerun[:200],
                                           "effects_after": len(preview.effects_after), **undone})
        states.transition(task, S.QUEUED, reason=f"rolled back to v{version}; resuming", actor=actor, ip=ip,
                          extra={"to_version": version})
        audit(action="task.rollback", actor=actor, ip=ip, task=task, before=before,
              after={"to_version": version, "params": task.params, "preview": preview.as_dict(), **undone})
        inbox.record_control(task, "rollback", actor=actor, payload={
            "to_version": version, "rerun": preview.rerun[:200], "effects_after": len(preview.effects_after)})
        inbox.settle_control(task, "rollback", f"applied: rolled back to v{version}; {len(preview.rerun)} finished "
                                               f"step(s) run again; {len(preview.effects_after)} side effect(s) "
                                               f"performed after it are not undone; queued from checkpoint "
                                               f"v{task.checkpoint_version}")
        scheduler.enqueue(task.pk)
    return preview
