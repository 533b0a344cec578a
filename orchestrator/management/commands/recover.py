from django.core.management.base import BaseCommand

from orchestrator.engine.recovery import sweep, sweep_loop


class Command(BaseCommand):
    help = "Recover tasks whose worker died: one sweep, or --loop to keep sweeping."

    def add_arguments(self, parser):
        parser.add_argument("--loop", action="store_true")
        parser.add_argument("--interval", type=float, default=None)

    def handle(self, *args, loop, interval, **options):
        if loop:
            self.stdout.write("sweeping for stale tasks (Ctrl-C stops)")
            sweep_loop(interval)
        recovered = sweep()
        self.stdout.write(f"recovered {len(recovered)} task(s): {', '.join(map(str, recovered)) or '-'}")
