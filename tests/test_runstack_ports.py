"""Two `make run` on one machine: the stand-in model's port (8011 by default) taken by
something else moves the stand-in to a free port that every child is told about; the web
port taken ends `make run` with one line saying how to pick another, no traceback."""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import urllib.request

import pytest

from tests.conftest import ROOT, free_port, process_env, wait_for

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def occupied_port():
    """A port something else listens on (and never answers HTTP)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def start_runstack(tmp_path, **env):
    log = open(tmp_path / "runstack.log", "w")
    proc = subprocess.Popen([sys.executable, str(ROOT / "manage.py"), "runstack"], cwd=ROOT,
                            # Its own var directory: the first user's credentials file goes there.
                            env=process_env(ADMIN_PASSWORD="pw-for-tests", ORCH_VAR_DIR=tmp_path / "var", **env),
                            stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    return proc, log


def output(tmp_path) -> str:
    return (tmp_path / "runstack.log").read_text()


def stop(proc) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)  # runstack stops its children's process groups
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def models_at(port: int):
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=1) as response:
            return json.load(response)
    except OSError:
        return None


def environment_of(pid: int) -> dict:
    with open(f"/proc/{pid}/environ", "rb") as f:
        pairs = [item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item]
    return {k.decode(): v.decode(errors="replace") for k, v in pairs}


def children(pid: int) -> dict[int, str]:
    # -ww: the whole command line (ps cuts it at $COLUMNS or 80 otherwise: under a long checkout path,
    # as CI's fresh clone in /tmp/tmp.XXXXXXXXXX, "... manage.py qcluster" lost its last word).
    out = subprocess.run(["ps", "-ww", "-o", "pid=,args=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return {int(line.split(None, 1)[0]): line.split(None, 1)[1] for line in out.strip().splitlines()}


def test_the_standin_moves_to_a_free_port_when_its_port_is_taken(tmp_path, occupied_port):
    web = free_port()
    proc, log = start_runstack(tmp_path, PORT=web, LLM_BASE_URL=f"http://127.0.0.1:{occupied_port}/v1",
                               LLM_MODEL="standin-planner")
    try:
        said = wait_for(lambda: re.search(r"the stand-in model serves on port (\d+) instead", output(tmp_path))
                        or proc.poll() is not None, timeout=60, message="runstack to say where the stand-in is")
        assert proc.poll() is None, output(tmp_path)
        moved_to = int(said.group(1))
        assert moved_to != occupied_port
        assert f"Model: the stand-in at http://127.0.0.1:{moved_to}/v1" in output(tmp_path)
        assert wait_for(lambda: models_at(moved_to), timeout=30, message="the stand-in to answer there")
        # The children that call the model (workers, web, sweeper) are told where it is.
        # A child just forked still shows runstack's own command line until it execs: wait for the
        # workers' process by what it runs, not for a count of children.
        try:
            kids = wait_for(lambda: (lambda k: k if any("qcluster" in a for a in k.values()) else None)(
                children(proc.pid)), timeout=30, message="runstack's workers (qcluster)")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; runstack said:\n{output(tmp_path)[-5000:]}") from None
        workers = next(pid for pid, args in kids.items() if "qcluster" in args)
        assert environment_of(workers)["LLM_BASE_URL"] == f"http://127.0.0.1:{moved_to}/v1"
        assert "Traceback" not in output(tmp_path)
    finally:
        stop(proc)
        log.close()
    assert "stopped" in output(tmp_path)


def test_a_taken_web_port_ends_make_run_with_one_clear_line(tmp_path, occupied_port):
    proc, log = start_runstack(tmp_path, PORT=occupied_port, LLM_BASE_URL=f"http://127.0.0.1:{free_port()}/v1")
    try:
        proc.wait(timeout=60)
    finally:
        stop(proc)
        log.close()
    text = output(tmp_path)
    assert proc.returncode == 1, text
    assert "Traceback" not in text
    assert f"Port {occupied_port} on 127.0.0.1 is already in use" in text and "PORT=8080 make run" in text
    assert "Orchestrator running" not in text  # nothing was started


def test_the_standin_command_refuses_a_taken_port_in_one_line(occupied_port):
    done = subprocess.run([sys.executable, str(ROOT / "manage.py"), "standin_llm", "--port", str(occupied_port)],
                          cwd=ROOT, env=process_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert f"Port {occupied_port} on 127.0.0.1 is already in use" in done.stderr
