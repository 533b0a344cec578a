"""The process tree a watchdog kills (engine/processes.py): found from the kernel's children
lists, the same as a scan of every process finds it, grandchildren included, and killed whole."""
import os
import subprocess
import sys

from orchestrator.engine import processes
from tests.conftest import wait_for

# A child that starts two grandchildren, one of which starts a great-grandchild, then waits.
TREE = """
import subprocess, sys, time
subprocess.Popen(["sleep", "600"])
subprocess.Popen(["sh", "-c", "sleep 600 & sleep 600; wait"])
time.sleep(600)
"""


def test_the_children_lists_find_the_tree_a_scan_finds_and_kill_tree_kills_it_all():
    assert os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children"), "this kernel has children lists"
    child = subprocess.Popen([sys.executable, "-c", TREE])
    try:
        tree = wait_for(lambda: (lambda found: found if len(found) >= 5 else None)(processes.descendants(child.pid)
                                                                                   + [child.pid]),
                        timeout=20, message="the whole tree to start")
        assert sorted(processes.descendants(child.pid)) == sorted(processes._descendants_by_scan(child.pid))
        assert len(processes.descendants(child.pid)) == 4  # 2 grandchildren, the shell's 2 sleeps
        killed = processes.kill_tree(child.pid)
        assert sorted(killed) == sorted(tree)
        assert [pid for pid in tree if processes.alive(pid)] == []
    finally:
        child.kill()
        child.wait()


def test_kill_tree_spares_what_it_is_told_to_spare_but_not_its_descendants():
    child = subprocess.Popen([sys.executable, "-c", TREE])
    try:
        wait_for(lambda: len(processes.descendants(child.pid)) >= 4, timeout=20, message="the tree to start")
        below = processes.descendants(child.pid)
        killed = processes.kill_tree(child.pid, sparing={child.pid})
        assert sorted(killed) == sorted(below)
        assert processes.alive(child.pid), "the spared process was killed"
    finally:
        child.kill()
        child.wait()
