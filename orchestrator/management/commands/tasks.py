"""`manage.py tasks create TYPE --param k=v ... | list | show ID | pause|resume|stop ID |
terminate ID --reason TEXT | skip-step ID --step S --reason TEXT` (the operator verbs: a
subcommand per record of engine/verbs.py, its inputs as options),
`tasks send ID TYPE --payload '{...}' [--priority P1]` (an event into the task's inbox),
`--accept-changes` on resume/skip-step/rollback: continue on changed task-type code (engine/compat.py),
plus revising a paused task: `tasks resume ID --param k=v ... [--limit k=v] [--dry-run]` (edit
its params and resume) and `tasks rollback ID --version N [--dry-run]`."""
import json

from django.core.management.base import BaseCommand, CommandError

from orchestrator import selectors
from orchestrator.engine import inbox, revisions, services, verbs
from orchestrator.engine.states import InvalidTransition
from orchestrator.models import Task
from orchestrator.tasktypes import all_types


def parse_param(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise CommandError(f"--param takes key=value; got {text!r}")
    try:
        return key, json.loads(value)  # numbers, booleans, lists: `--param recipients='["a@x.org"]'`
    except json.JSONDecodeError:
        return key, value


class Command(BaseCommand):
    help = "Create, list, show and control tasks."

    def add_arguments(self, parser):
        sub = parser.add_subparsers(dest="action", required=True)
        create = sub.add_parser("create", help="create a task")
        create.add_argument("type", help=f"one of: {', '.join(all_types())}")
        create.add_argument("--param", action="append", default=[], help="key=value (value parsed as JSON if it can be)")
        create.add_argument("--limit", action="append", default=[], help="max_steps=N, max_seconds=S, ...")
        create.add_argument("--title", default="")
        lister = sub.add_parser("list", help="list tasks, newest first")
        lister.add_argument("--status", default="")
        lister.add_argument("--type", default="")
        lister.add_argument("--limit", type=int, default=50)
        show = sub.add_parser("show", help="show one task with its steps")
        show.add_argument("id", type=int)
        show.add_argument("--json", action="store_true")
        # The operator verbs (engine/verbs.py): a subcommand each, its inputs as options.
        for verb in verbs.generic():
            control = sub.add_parser(verb.word, help=verb.description or f"{verb.label} a task")
            control.add_argument("id", type=int)
            for spec in verb.inputs:
                if spec.is_flag:
                    control.add_argument(spec.flag, dest=spec.name, action="store_true", help=spec.help)
                else:
                    control.add_argument(spec.flag, dest=spec.name, type=spec.kind, required=spec.required,
                                         default=None, help=spec.help)
        resume = sub.add_parser("resume", help=verbs.get("resume").description)
        resume.add_argument("id", type=int)
        resume.add_argument("--reason", default="")
        resume.add_argument("--limit", action="append", default=[], help="raise a limit: max_seconds=600")
        resume.add_argument("--param", action="append", default=[],
                            help="edit a parameter first: key=value (the other params stay)")
        resume.add_argument("--dry-run", action="store_true",
                            help="print the impact of the edit (steps kept, re-run; effects repeated) and change nothing")
        resume.add_argument("--repeat-effect", action="append", default=[], metavar="KEY",
                            help="confirm that this non-idempotent effect (idempotency key) is performed again; every "
                                 "one the preview lists must be confirmed")
        resume.add_argument("--accept-changes", action="store_true",
                            help="continue although the task type's code changed since the task paused (its policy "
                                 "ask: the dry run lists the changes); audited")
        send = sub.add_parser("send", help="send an event into a task (its inbox): user.message, instruction, ...")
        send.add_argument("id", type=int)
        send.add_argument("type", help="an event type: " + ", ".join(inbox.REGISTRY))
        send.add_argument("--payload", default="{}", help="the payload as a JSON object")
        send.add_argument("--priority", default=None, help="0-4 or P0-P4 (default: the type's)")
        send.add_argument("--source-event-id", default="", help="your id for it: a repeat is answered, not re-sent")
        send.add_argument("--merge-key", default="")
        rollback = sub.add_parser("rollback", help="roll a paused task back to a snapshot version and resume")
        rollback.add_argument("id", type=int)
        rollback.add_argument("--version", type=int, required=True, help="a kept snapshot version (see `show`)")
        rollback.add_argument("--dry-run", action="store_true", help="print the preview and change nothing")
        rollback.add_argument("--repeat-effect", action="append", default=[], metavar="KEY",
                              help="confirm that this non-idempotent effect is performed again")
        rollback.add_argument("--accept-changes", action="store_true", help="as for resume")

    def handle(self, *args, action, **opts):
        if action == "create":
            try:
                task = services.task_create(type=opts["type"], params=dict(map(parse_param, opts["param"])),
                                            limits=dict(map(parse_param, opts["limit"])) or None, title=opts["title"])
            except services.InvalidInput as exc:
                raise CommandError("\n".join(f"{e.field}: {e.message}" for e in exc.errors)) from None
            self.stdout.write(f"created task #{task.pk} ({task.type}, {task.status})")
            self.stdout.write(str(task.pk))
        elif action == "list":
            rows, _ = selectors.task_page(selectors.task_list(status=opts["status"], type=opts["type"]),
                                          limit=opts["limit"])
            self.stdout.write(f"{'ID':>6}  {'TYPE':<20} {'STATUS':<16} {'PROGRESS':>10}  CREATED")
            for t in rows:
                self.stdout.write(f"{t.pk:>6}  {t.type:<20} {t.status:<16} {t.steps_done:>4}/{t.steps_total:<5}"
                                  f"  {t.created_at:%Y-%m-%d %H:%M:%S}")
        elif action == "show":
            self.show(opts["id"], as_json=opts["json"])
        elif action == "resume" and (opts["param"] or opts["dry_run"]):
            self.edit(opts["id"], params=dict(map(parse_param, opts["param"])),
                      limits=dict(map(parse_param, opts["limit"])), dry_run=opts["dry_run"],
                      repeat_effects=opts["repeat_effect"], accept_changes=opts["accept_changes"])
        elif action == "send":
            self.send(opts["id"], opts["type"], payload=opts["payload"], priority=opts["priority"],
                      source_event_id=opts["source_event_id"], merge_key=opts["merge_key"])
        elif action == "rollback":
            self.rollback(opts["id"], version=opts["version"], dry_run=opts["dry_run"],
                          repeat_effects=opts["repeat_effect"], accept_changes=opts["accept_changes"])
        elif action == "resume":
            limits = dict(map(parse_param, opts["limit"]))
            self.verb(verbs.get("resume"), opts["id"], {"reason": opts["reason"],
                                                        "accept_changes": opts["accept_changes"]},
                      **({"limits": limits} if limits else {}))
        else:
            verb = verbs.by_word(action)
            self.verb(verb, opts["id"], {spec.name: opts[spec.name] for spec in verb.inputs
                                         if opts.get(spec.name) is not None})

    def verb(self, verb, task_id: int, inputs: dict, **extra) -> None:
        """An operator verb (engine/verbs.py) through its service; its report line, or the
        refusal as the command's error."""
        try:
            if extra:  # a resume that raises limits: the service takes them beside the verb's inputs
                result = verb.call(task_id=task_id, **inputs, **extra)
            else:
                result = services.task_verb(name=verb.name, task_id=task_id, inputs=inputs)
        except Task.DoesNotExist:
            raise CommandError(f"There is no task #{task_id}.") from None
        except InvalidTransition as exc:
            raise CommandError(str(exc)) from None
        except services.InvalidInput as exc:
            raise CommandError("\n".join(f"{e.field}: {e.message}" for e in exc.errors)) from None
        if verb.report is not None:
            self.stdout.write(verb.report(result, task_id))
        else:
            task = self._task(task_id)
            self.stdout.write(f"task #{task.pk}: {task.status}" + (f" (control: {task.control})" if task.control else ""))

    def show(self, task_id: int, *, as_json: bool) -> None:
        from orchestrator.api.presenters import task_out

        try:
            task = selectors.task_detail(task_id)
        except Task.DoesNotExist:
            raise CommandError(f"There is no task #{task_id}.") from None
        out = task_out(task)
        if as_json:
            self.stdout.write(out.model_dump_json(indent=2))
            return
        self.stdout.write(f"task #{task.pk} {task.type}  status={task.status}  {task.status_reason}")
        self.stdout.write(f"progress {task.steps_done}/{task.steps_total}  checkpoint v{task.checkpoint_version}  "
                          f"params {json.dumps(task.params)}")
        self.stdout.write("actions " + (", ".join(a.name for a in out.actions if a.allowed) or "none"))
        for step in out.steps:
            took = f"{step.duration_seconds:.2f}s" if step.duration_seconds is not None else ""
            self.stdout.write(f"  {step.id:<24} {step.status:<8} attempts={step.attempts} {took}")

    def send(self, task_id: int, type_name: str, *, payload: str, priority, source_event_id: str,
             merge_key: str) -> None:
        try:
            body = json.loads(payload)
        except json.JSONDecodeError as exc:
            raise CommandError(f"--payload is not JSON ({exc}): give an object, e.g. '{{\"text\": \"hi\"}}'") from None
        if not isinstance(body, dict):
            raise CommandError("--payload must be a JSON object, e.g. '{\"text\": \"hi\"}'")
        self._task(task_id)
        verb = verbs.by_event_type(type_name)
        if verb is not None:
            raise CommandError(f"{type_name} is an operator control: use `tasks {verb.word} {task_id}`")
        try:
            sent = inbox.send(task_id=task_id, type=type_name, payload=body, priority=priority, source="operator",
                              source_event_id=source_event_id, merge_key=merge_key)
        except inbox.InboxRefused as exc:
            retry = f" (retry after {exc.retry_after} s)" if exc.retry_after else ""
            raise CommandError(f"refused ({exc.status}): {exc}{retry}") from None
        event = sent.event
        self.stdout.write(f"task #{task_id}: event #{event.seq} {event.type} P{event.priority} {event.state}"
                          + (" (a repeat: the first event)" if sent.duplicate else ""))

    # --- revisions of a paused task ----------------------------------------------------------

    def _task(self, task_id: int) -> Task:
        try:
            return selectors.task_detail(task_id)
        except Task.DoesNotExist:
            raise CommandError(f"There is no task #{task_id}.") from None

    def edit(self, task_id: int, *, params: dict, limits: dict, dry_run: bool, repeat_effects: list[str],
             accept_changes: bool = False) -> None:
        """Edit params and resume, at the task's current version (or only preview it)."""
        task = self._task(task_id)
        try:
            new_params = revisions.edited_params(task, params)
            if limits:
                services.validate_limits({**task.limits, **limits})
            preview, _ = revisions.preview_edit(task, new_params)
        except services.InvalidInput as exc:
            raise CommandError("\n".join(f"{e.field}: {e.message}" for e in exc.errors)) from None
        except InvalidTransition as exc:
            raise CommandError(str(exc)) from None
        unconfirmed = set(preview.must_confirm) - set(repeat_effects)
        if dry_run or unconfirmed or (preview.compatibility.get("differences") and not accept_changes):
            self.print_preview(task, preview, title="edit preview", limits=limits)
        if dry_run:
            self.stdout.write("dry run: nothing changed")
            return
        try:
            preview = revisions.apply_edit(task_id=task.pk, new_params=new_params, expected_version=preview.version,
                                           limits=limits or None, repeat_effects=repeat_effects,
                                           accept_changes=accept_changes)
        except InvalidTransition as exc:  # StalePreview too: the task moved meanwhile
            raise CommandError(str(exc)) from None
        except services.InvalidInput as exc:
            raise CommandError("\n".join(f"{e.field}: {e.message}" for e in exc.errors)) from None
        task = self._task(task_id)
        self.stdout.write(f"task #{task.pk}: params edited ({', '.join(preview.param_diff) or 'no change'}); "
                          f"{len(preview.rerun)} step(s) to re-run; {task.status}")

    def rollback(self, task_id: int, *, version: int, dry_run: bool, repeat_effects: list[str],
                 accept_changes: bool = False) -> None:
        task = self._task(task_id)
        try:
            preview = revisions.preview_rollback(task, version)
            if dry_run:
                self.print_preview(task, preview, title=f"rollback preview to v{version}")
                self.stdout.write("dry run: nothing changed")
                return
            if set(preview.must_confirm) - set(repeat_effects):
                self.print_preview(task, preview, title=f"rollback preview to v{version}")
            preview = revisions.apply_rollback(task_id=task.pk, version=version, expected_version=preview.version,
                                               repeat_effects=repeat_effects, accept_changes=accept_changes)
        except InvalidTransition as exc:
            raise CommandError(str(exc)) from None
        except services.InvalidInput as exc:
            raise CommandError("\n".join(f"{e.field}: {e.message}" for e in exc.errors)) from None
        task = self._task(task_id)
        self.stdout.write(f"task #{task.pk}: rolled back to v{version}; {len(preview.rerun)} step(s) to re-run; "
                          f"{len(preview.effects_after)} side effect(s) after v{version} not undone; {task.status}")

    def print_preview(self, task: Task, preview, *, title: str, limits: dict | None = None) -> None:
        write = self.stdout.write
        write(f"task #{task.pk} {task.type}: {title} (at event {preview.version})")
        write("params:" if preview.param_diff else "params: no change")
        for key, (old, new) in preview.param_diff.items():
            write(f"  {key}: {json.dumps(old)} -> {json.dumps(new)}")
        changed_limits = {k: v for k, v in (limits or {}).items() if task.limits.get(k) != v}
        for key, value in changed_limits.items():
            write(f"  limit {key}: {json.dumps(task.limits.get(key))} -> {json.dumps(value)}")
        for label, ids in (("kept", preview.kept), ("re-run", preview.rerun), ("removed", preview.removed),
                           ("still to run", preview.pending)):
            if label == "removed" and not ids:
                continue
            shown = ", ".join(ids[:20]) + (f", ... (+{len(ids) - 20} more)" if len(ids) > 20 else "")
            write(f"{label} ({len(ids)}): {shown or '-'}")
        if preview.rollback_to is not None:
            write(f"side effects after v{preview.rollback_to} (NOT undone) ({len(preview.effects_after)}):")
            for effect in preview.effects_after:
                write(f"  {effect['step']:<16} {effect['tool']:<12} {effect['idempotency_key']}")
        write(f"side effects performed again ({len(preview.repeated_effects)}):")
        for effect in preview.repeated_effects:
            write(f"  {effect['step']:<16} {effect['tool']:<12} {effect['idempotency_key']}  {effect['consequence']}"
                  f"{'' if effect['idempotent'] else '  NOT idempotent: confirm with --repeat-effect KEY'}")
        write(f"must confirm: {', '.join(preview.must_confirm) or 'nothing'}")
        gate = preview.compatibility or {}
        if gate.get("differences"):
            write(f"code changed since the task paused (policy {gate['policy']}):")
            for difference in gate["differences"]:
                write(f"  {difference['text']}")
            write({"pin": "  refused: the type pins the code a task started with",
                   "migrate": f"  the type's migrate() gives: {json.dumps(gate.get('migrated_params'))}"
                              + (f" (refused: {gate['migrate_error']})" if gate.get("migrate_error") else ""),
                   "ask": "  confirm with --accept-changes"}[gate["policy"]])
