from django.core.management.base import BaseCommand

from orchestrator.conf import harness
from orchestrator.engine import retention


class Command(BaseCommand):
    help = ("Apply the retention rules once to the finished tasks they are due for (the sweeper does this every "
            "ORCH_RETAIN_EVERY_SECONDS); prints what was pruned.")

    def handle(self, *args, **options):
        rules = harness.retention
        record = retention.run()
        self.stdout.write(
            f"retention: {record.tasks} task(s); {record.stream_events_deleted} stream event(s), "
            f"{record.events_deleted} progress event(s) compacted, {record.wal_deleted} WAL row(s), "
            f"{record.idempotency_deleted} idempotency record(s), "
            f"{record.notifications_deleted} webhook deliveries, "
            f"{record.webhook_rejections_deleted} webhook rejection row(s) deleted "
            f"(rules: stream {rules['stream_events_days']:g} d, events {rules['events_days']:g} d, "
            f"WAL {rules['wal_days']:g} d, webhook deliveries {rules['notifications_days']:g} d, "
            f"webhook rejections {rules['webhook_rejections_days']:g} d; at most {rules['batch_tasks']} tasks per rule per run)")
        if record.error:
            self.stderr.write(f"stopped early: {record.error}")
