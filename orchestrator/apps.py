from django.apps import AppConfig


class OrchestratorConfig(AppConfig):
    name = "orchestrator"
    verbose_name = "Orchestrator"

    def ready(self):
        from . import checks  # noqa: F401  (registers the system checks)
        from . import telemetry

        telemetry.configure()  # traces only when OTEL_EXPORTER_OTLP_ENDPOINT or ORCH_OTEL_CONSOLE=1

        from .engine import worker_queues

        worker_queues.install()  # a worker killed while idle no longer leaves its cluster deaf (django-q2 #23)

        from . import redaction_sources

        redaction_sources.register()  # webhook secrets and API token hashes join the redacted secrets

        from . import extensions

        # The installation's own tools and task types, in every process (web, workers and the
        # executors they fork, the sweeper). One that cannot be imported is recorded here and
        # stops the start as the system check orchestrator.E030 (checks.py).
        extensions.load()
