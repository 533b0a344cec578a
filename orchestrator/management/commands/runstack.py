"""`make run`: the web server (daphne), the worker cluster, the sweeper and — while
LLM_BASE_URL points at it — the stand-in model server, together. Ctrl-C (or SIGTERM) stops
all of them.

Two of them on one machine: the web port is the user's (PORT) and is never moved — taken, it
ends here with one line naming another; the stand-in's port (8011) moves to a free one when
taken, and the children are given that LLM_BASE_URL."""
import errno
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from urllib.parse import urlsplit, urlunsplit

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError


class Command(BaseCommand):
    help = "Start daphne on 127.0.0.1:$PORT, the django-q2 worker cluster and the sweeper."

    def add_arguments(self, parser):
        parser.add_argument("--host", default=os.environ.get("HOST", "127.0.0.1"))
        parser.add_argument("--port", type=int, default=settings.PORT)

    def handle(self, *args, host, port, **options):
        # The web address is the one the user opens: never move it behind their back.
        try:
            web_port_free = port_is_free(host, port)
        except OSError as exc:
            raise CommandError(f"Cannot listen on {host}:{port} ({exc.strerror}). Pick another port: "
                               f"PORT=8080 make run") from exc
        if not web_port_free:
            raise CommandError(f"Port {port} on {host} is already in use (another `make run`, or another server). "
                               f"Pick another: PORT=8080 make run")
        self.ensure_admin()
        python, manage = sys.executable, str(settings.BASE_DIR / "manage.py")
        commands = {
            "web": [python, "-m", "daphne", "-b", host, "-p", str(port), "orchestrator.asgi:application"],
            "workers": [python, manage, "qcluster"],
            "sweeper": [python, manage, "recover", "--loop"],
        }
        # The children run with this process's DEBUG, said explicitly (its default is off).
        env = {**os.environ, "DEBUG": "true" if settings.DEBUG else "false"}
        llm_base_url, moved_from = settings.LLM_BASE_URL, None
        standin_port = standin_port_to_start(settings.LLM_BASE_URL, settings.LLM_MODEL)
        if standin_port is not None:
            if not port_is_free(STANDIN_HOST, standin_port):
                # Another `make run` (or anything else) has the stand-in's port: take a free
                # one, and tell every child where the model now is.
                moved_from, standin_port = standin_port, free_port(STANDIN_HOST)
                llm_base_url = with_port(settings.LLM_BASE_URL, standin_port)
                env["LLM_BASE_URL"] = llm_base_url
            commands["model"] = [python, manage, "standin_llm", "--host", STANDIN_HOST, "--port", str(standin_port)]
        # Each in its own process group, so that stopping reaches all of a program's
        # processes (the worker cluster is several) and nothing is left running.
        procs = {name: subprocess.Popen(argv, cwd=settings.BASE_DIR, start_new_session=True, env=env)
                 for name, argv in commands.items()}
        self.stdout.write(self.style.SUCCESS(f"Orchestrator running at http://{host}:{port}/  (Ctrl-C stops everything)"))
        if standin_port is None:
            self.stdout.write(f"Model: {settings.LLM_MODEL} at {settings.LLM_BASE_URL}")
        else:
            self.stdout.write(f"Model: the stand-in at {llm_base_url} (rules, not a real model; "
                              f"set LLM_BASE_URL for a real one)")
            if moved_from is not None:
                self.stdout.write(self.style.WARNING(
                    f"Port {moved_from} (LLM_BASE_URL) was taken: the stand-in model serves on port {standin_port} "
                    f"instead, and the workers use it there"))
        stopping = False

        def stop(*_):
            nonlocal stopping
            stopping = True

        signal.signal(signal.SIGINT, stop)
        signal.signal(signal.SIGTERM, stop)
        try:
            while not stopping:
                for name, proc in procs.items():
                    if proc.poll() is not None:
                        self.stderr.write(f"{name} exited with {proc.returncode}; stopping the rest")
                        stopping = True
                time.sleep(0.2)
        finally:
            # Workers kill their running tasks' executors and hand the tasks back (they
            # continue from their checkpoints at the next start); then everything goes.
            for proc in procs.values():
                signal_group(proc, signal.SIGTERM)
            deadline = time.monotonic() + 10
            for proc in procs.values():
                try:
                    proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
                signal_group(proc, signal.SIGKILL)
            self.stdout.write("stopped")

    def ensure_admin(self) -> None:
        User = get_user_model()
        if User.objects.filter(is_superuser=True).exists():
            return
        password = os.environ.get("ADMIN_PASSWORD") or secrets.token_urlsafe(9)
        User.objects.create_superuser("admin", "admin@localhost", password)
        credentials = settings.VAR_DIR / "admin-credentials.txt"
        write_private(credentials, f"username: admin\npassword: {password}\n")
        self.stdout.write(self.style.WARNING(
            f"Created the first user: admin / {password}  (also saved in {credentials})"))


def standin_port_to_start(base_url: str, model: str) -> int | None:
    """The port to serve the stand-in model server on, or None when LLM_BASE_URL/LLM_MODEL
    name another server (a real model, or a local one such as Ollama on 127.0.0.1)."""
    parts = urlsplit(base_url)
    if parts.hostname not in ("127.0.0.1", "localhost") or not model.startswith("standin"):
        return None
    return parts.port or 80


STANDIN_HOST = "127.0.0.1"  # LLM_BASE_URL names 127.0.0.1 or localhost for the stand-in


def port_is_free(host: str, port: int) -> bool:
    """Whether a server could listen on host:port now (as the servers do: SO_REUSEADDR, so a
    port left in TIME_WAIT by a previous run counts as free)."""
    if port == 0:
        return True
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return False
            raise
    return True


def free_port(host: str) -> int:
    """A port nobody listens on now (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def with_port(url: str, port: int) -> str:
    """`url` with its port replaced: http://127.0.0.1:8011/v1 -> http://127.0.0.1:<port>/v1."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=f"{parts.hostname}:{port}"))


def write_private(path, text: str) -> None:
    """Write `text` to a file only its owner can read (0600, also when it already existed)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def signal_group(proc: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(proc.pid, signum)
    except ProcessLookupError:
        pass
