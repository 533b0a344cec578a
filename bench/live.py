"""Step commit -> websocket client latency, in both live modes.

    .venv/bin/python bench/live.py            # embedded (SQLite, no Redis) and Redis modes

A real daphne serves the websocket; the task runs in this process (another process than
daphne, as a worker would). Latency = the client's receive time minus the event's
`created_at`, stamped inside the step's commit transaction (so it slightly overstates).
Targets: p95 <= 100 ms with Redis, <= 500 ms embedded. Prints figures, asserts nothing.
"""
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEPS = int(os.environ.get("BENCH_STEPS", "150"))
SLEEP_MS = int(os.environ.get("BENCH_STEP_MS", "40"))
REDIS_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/3")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def child_env(mode: str, database_url: str) -> dict:
    env = {**os.environ, "DATABASE_URL": database_url, "ORCH_LOG_LEVEL": "WARNING",
           "DJANGO_SETTINGS_MODULE": "orchestrator.settings", "PYTHONPATH": str(ROOT)}
    env.pop("REDIS_URL", None)
    if mode == "redis":
        env["REDIS_URL"] = REDIS_URL
    return env


def run_mode(mode: str) -> list[float]:
    database_url = os.environ.get("DATABASE_URL") or f"sqlite:///{tempfile.mkdtemp()}/live-bench.sqlite3"
    env = child_env(mode, database_url)
    # The "worker" side runs in a child process of its own too, so this process stays a pure client.
    setup = subprocess.run([sys.executable, str(Path(__file__).with_name("_live_worker.py")), "setup"], env=env,
                           capture_output=True, text=True, check=True)
    info = json.loads(setup.stdout.strip().splitlines()[-1])
    port = free_port()
    web = subprocess.Popen([sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port),
                            "orchestrator.asgi:application"], cwd=ROOT, env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.1)
        return asyncio.run(measure(port, info, env))
    finally:
        os.killpg(web.pid, signal.SIGTERM)
        web.wait(timeout=10)


async def measure(port: int, info: dict, env: dict) -> list[float]:
    import websockets

    latencies = []
    url = f"ws://127.0.0.1:{port}/ws/tasks/{info['task_id']}/?resume_from={info['seq']}"
    async with websockets.connect(url, origin=f"http://127.0.0.1:{port}",
                                  additional_headers={"Cookie": f"sessionid={info['session']}"}) as ws:
        await ws.recv()  # the state
        worker = subprocess.Popen([sys.executable, str(Path(__file__).with_name("_live_worker.py")), "run",
                                   str(info["task_id"])], env=env)
        done = 0
        while done < STEPS:
            message = json.loads(await asyncio.wait_for(ws.recv(), timeout=60))
            received = time.time()
            if message["type"] == "event" and message["kind"] == "step_done":
                done += 1
                created = datetime.fromisoformat(message["created_at"]).timestamp()
                latencies.append((received - created) * 1000)
        worker.wait(timeout=60)
    return latencies


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else values[0]


def main():
    print(f"{STEPS} steps of ~{SLEEP_MS} ms each; latency = step commit -> websocket client")
    for mode, target in (("embedded", 500), ("redis", 100)):
        lat = run_mode(mode)
        print(f"{mode:>8}: p50 {pct(lat, 50):6.1f} ms   p95 {pct(lat, 95):6.1f} ms   max {max(lat):6.1f} ms"
              f"   (target p95 <= {target} ms, n={len(lat)})")


if __name__ == "__main__":
    main()
