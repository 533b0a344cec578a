"""The soak counts as stray what a kill -9 of an executor, worker or cluster left alive: the
victim's process tree is taken just before the kill, and whatever of it still lives
KILL_STRAY_SECONDS later is a stray (and is killed). A pid reused by a new process is not."""
import importlib.util
import os
import shutil
import signal
import subprocess

from tests.conftest import ROOT, wait_for


def load_soak():
    spec = importlib.util.spec_from_file_location("soak_under_test", ROOT / "bench" / "soak.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_what_a_kill_left_alive_is_counted_as_stray_and_killed(monkeypatch):
    soak_module = load_soak()
    monkeypatch.setattr(soak_module, "KILL_STRAY_SECONDS", 0.2)
    soak = soak_module.Soak(soak_module.parse_args(["--short"]))
    victim = subprocess.Popen(["sh", "-c", "sleep 300 & sleep 300 & wait"],
                              env={**os.environ, "SOAK_RUN_ID": soak.marker.value})
    try:
        tree = wait_for(lambda: (lambda t: t if len(t) == 3 else None)(soak_module.tree_of(victim.pid)),
                        timeout=10, message="the victim and its two children")
        survivor, cleaned_up = sorted(pid for pid in tree if pid != victim.pid)
        assert soak.kill(victim.pid, fault="kill_worker")
        victim.wait(timeout=10)
        os.kill(cleaned_up, signal.SIGKILL)  # what a keeper does: this one is not a stray
        soak.check_kill_watches(all_of_them=True)
        assert list(soak.kill_strays) == [survivor]
        assert "after kill_worker" in soak.kill_strays[survivor] and "sleep 300" in soak.kill_strays[survivor]
        wait_for(lambda: soak_module.start_time(survivor) is None, timeout=5, message="the stray to be killed")
        assert soak.kill_watches == []
    finally:
        for pid in soak_module.tree_of(victim.pid) if victim.poll() is None else []:
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(soak.run_dir, ignore_errors=True)


def test_a_process_that_is_not_of_this_run_is_never_killed_nor_watched():
    soak_module = load_soak()
    soak = soak_module.Soak(soak_module.parse_args(["--short"]))
    outsider = subprocess.Popen(["sleep", "300"])  # no SOAK_RUN_ID in its environment
    try:
        assert not soak.kill(outsider.pid, fault="kill_executor")
        assert outsider.poll() is None and soak.kill_watches == []
    finally:
        outsider.kill()
        outsider.wait()
        shutil.rmtree(soak.run_dir, ignore_errors=True)
