from django.core.management.base import BaseCommand

from orchestrator import otlp_metrics
from orchestrator.engine.recovery import sweep, sweep_loop
from orchestrator.notifications import courier


class Command(BaseCommand):
    help = ("Recover tasks whose worker died: one sweep, or --loop to keep sweeping (and to send the "
            "notification webhooks that are due: docs/notifications.md).")

    def add_arguments(self, parser):
        parser.add_argument("--loop", action="store_true")
        parser.add_argument("--interval", type=float, default=None)

    def handle(self, *args, loop, interval, **options):
        if loop:
            self.stdout.write("sweeping for stale tasks (Ctrl-C stops)")
            courier.start(min(interval or 1.0, 1.0))
            if otlp_metrics.start():  # where an OTLP endpoint is configured (orchestrator/otlp_metrics.py)
                self.stdout.write("pushing the metrics over OTLP")
            try:
                sweep_loop(interval)
            finally:
                otlp_metrics.shutdown()
        recovered = sweep()
        self.stdout.write(f"recovered {len(recovered)} task(s): {', '.join(map(str, recovered)) or '-'}")
