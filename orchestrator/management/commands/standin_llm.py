"""`manage.py standin_llm`: serve the stand-in model server (orchestrator/llm/standin.py), a
rule-based stand-in for a real model that speaks the OpenAI Chat Completions protocol.
`make run` starts it when LLM_BASE_URL points at it (see runstack)."""
import errno
import logging
import signal
import threading

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from orchestrator.llm.standin import DEFAULT_PORT, STANDIN_MODEL, StandinServer

logger = logging.getLogger(__name__)


class Command(BaseCommand):
    help = "Serve the stand-in model server (OpenAI-compatible /v1/chat/completions, rule-based planning)."

    def add_arguments(self, parser):
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=DEFAULT_PORT)
        parser.add_argument("--token-seconds", type=float, default=settings.LLM_STANDIN_TOKEN_SECONDS,
                            help="pace of the stream, seconds per token (LLM_STANDIN_TOKEN_SECONDS; default 0.005)")

    def handle(self, *args, host, port, token_seconds, **options):
        try:
            server = StandinServer(host=host, port=port, token_seconds=token_seconds)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            raise CommandError(f"Port {port} on {host} is already in use; serve the stand-in on another "
                               f"(--port), and point LLM_BASE_URL at it") from exc

        def stop(*_):
            # shutdown() waits for serve_forever to return, so it must run off its thread.
            threading.Thread(target=server.stop, daemon=True).start()

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        self.stdout.write(self.style.SUCCESS(
            f"Stand-in model server (rules, not a real model) at {server.base_url}  model: {STANDIN_MODEL}  "
            f"pace: {token_seconds * 1000:g} ms/token"))
        logger.info("standin model server started", extra={"standin_url": server.base_url,
                                                           "standin_token_seconds": token_seconds})
        server.serve_forever()
        self.stdout.write("stand-in model server stopped")
