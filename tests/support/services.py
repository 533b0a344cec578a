"""Private instances of the services a test breaks on purpose: a Redis server (and, for
the outage tests, a PostgreSQL cluster) on ports of their own, so the shared servers on
the standard ports are never restarted."""
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def port_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.2)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def wait_port(port: int, *, open_: bool, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while port_open(port) != open_:
        if time.monotonic() > deadline:
            raise AssertionError(f"port {port} did not {'open' if open_ else 'close'} within {timeout}s")
        time.sleep(0.05)


class RedisServer:
    """`redis-server` on its own port, keeping nothing on disk (like the production
    broker's restarts: whatever was queued is gone)."""

    def __init__(self, port: int, log_path: Path):
        self.port, self.log_path, self.proc = port, log_path, None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisServer":
        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        self.proc = subprocess.Popen([binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--logfile", str(self.log_path)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
        wait_port(self.port, open_=True)
        return self

    def kill(self) -> None:
        """kill -9: every queued message and every connection is gone."""
        if self.proc and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        wait_port(self.port, open_=False)

    def restart(self) -> None:
        self.kill()
        self.start()

    def stop(self) -> None:
        self.kill()


class PostgresCluster:
    """A throwaway PostgreSQL cluster (initdb + pg_ctl) on its own port and directory."""

    def __init__(self, port: int):
        self.port = port
        self.dir = Path(tempfile.mkdtemp(prefix="orch-pg-"))
        self.data = self.dir / "data"
        bindir = Path(next(iter(sorted(Path("/usr/lib/postgresql").glob("*/bin")))))
        self.initdb, self.pg_ctl = bindir / "initdb", bindir / "pg_ctl"

    def _run(self, *argv) -> None:
        env = {**os.environ, "LC_ALL": "C.UTF-8"}
        run_as = [] if os.geteuid() != 0 else ["runuser", "-u", "postgres", "--"]
        subprocess.run([*run_as, *map(str, argv)], check=True, env=env, capture_output=True, cwd=self.dir)

    def init(self) -> "PostgresCluster":
        if os.geteuid() == 0:
            shutil.chown(self.dir, "postgres", "postgres")
        self._run(self.initdb, "-D", self.data, "-U", "postgres", "--auth=trust", "-E", "UTF8")
        return self

    def start(self) -> None:
        self._run(self.pg_ctl, "-D", self.data, "-l", self.dir / "log", "-w", "-o",
                  f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off", "start")
        wait_port(self.port, open_=True)

    def stop(self, mode: str = "immediate") -> None:
        self._run(self.pg_ctl, "-D", self.data, "-m", mode, "-w", "stop")
        wait_port(self.port, open_=False)

    def restart(self) -> None:
        self.stop()
        self.start()

    def destroy(self) -> None:
        try:
            self.stop()
        except subprocess.CalledProcessError:
            pass
        shutil.rmtree(self.dir, ignore_errors=True)
