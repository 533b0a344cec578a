"""`manage.py tasks create TYPE --param k=v ... | list | show ID | pause|resume|stop|terminate ID`."""
import json

from django.core.management.base import BaseCommand, CommandError

from orchestrator import selectors
from orchestrator.engine import services
from orchestrator.engine.states import InvalidTransition
from orchestrator.models import Task
from orchestrator.tasktypes import all_types

CONTROLS = {"pause": services.task_pause, "resume": services.task_resume, "stop": services.task_stop,
            "terminate": services.task_terminate}


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
        for name in CONTROLS:
            control = sub.add_parser(name, help=f"{name} a task")
            control.add_argument("id", type=int)
            control.add_argument("--reason", default="")
            if name == "resume":
                control.add_argument("--limit", action="append", default=[], help="raise a limit: max_seconds=600")

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
        else:
            extra = {"limits": dict(map(parse_param, opts["limit"])) or None} if action == "resume" else {}
            try:
                task = CONTROLS[action](task_id=opts["id"], reason=opts["reason"], **extra)
            except Task.DoesNotExist:
                raise CommandError(f"There is no task #{opts['id']}.") from None
            except InvalidTransition as exc:
                raise CommandError(str(exc)) from None
            except services.InvalidInput as exc:
                raise CommandError("\n".join(f"{e.field}: {e.message}" for e in exc.errors)) from None
            self.stdout.write(f"task #{task.pk}: {task.status}" + (f" (control: {task.control})" if task.control else ""))

    def show(self, task_id: int, *, as_json: bool) -> None:
        from orchestrator.api import task_out

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
        for step in out.steps:
            took = f"{step.duration_seconds:.2f}s" if step.duration_seconds is not None else ""
            self.stdout.write(f"  {step.id:<24} {step.status:<8} attempts={step.attempts} {took}")
