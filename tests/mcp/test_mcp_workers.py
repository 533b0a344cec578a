"""MCP servers under real worker processes: a stdio server is a child of the executor's tree
(it dies with it), a kill -9 after an approved git_commit went out sends the call to review and
the repository gets exactly one commit, and Stop or Pause in the middle of a call tells the
server (`notifications/cancelled`, seen on the wire)."""
import os
import signal
import subprocess

import pytest

from orchestrator.engine import services
from orchestrator.models import Task, WalEntry
from orchestrator.tools import mcp
from review.models import ReviewItem
from review.services import review_decide
from tests.conftest import wait_for
from tests.support.attacker_model import AttackerModel
from tests.support.helpers import settle

from .conftest import faulty, git_server, processes_running

pytestmark = [pytest.mark.workers, pytest.mark.django_db(transaction=True)]


def model_env(model: AttackerModel) -> dict:
    return {"LLM_BASE_URL": model.base_url, "LLM_API_KEY": "scripted", "LLM_MODEL": "scripted",
            "LLM_MAX_ATTEMPTS": 1}


def test_an_approved_git_commit_cut_by_kill_9_goes_to_review_and_the_repository_gets_one_commit(
        declare, git_repo, start_workers, make_user, tmp_path):
    (git_repo.path / "notes.txt").write_text("found by the agent\n")
    subprocess.run(["git", "-C", str(git_repo.path), "add", "notes.txt"], check=True)
    repo = str(git_repo.path)
    declare(git=git_server(git_repo))
    boss, reviewer = make_user("boss", superuser=True), make_user("rita", "reviewer")
    with AttackerModel([("git__git_status", {"repo_path": repo}),
                        ("git__git_commit", {"repo_path": repo, "message": "Notes from the agent"})]) as model:
        # The executor dies right after the commit call came back, before the WAL knew it was done.
        start_workers(1, **model_env(model), **declare.env(), ORCH_FAULTS="after_effect@tool-002-1:kill-once",
                      ORCH_VAR_DIR=tmp_path)
        task = services.task_create(type="agent.plan_execute", actor=boss, params={
            "goal": "Commit the notes", "tools": ["git__git_status", "git__git_commit"]})
        mcp.close_all()  # this process's session (creating the task asked the server): not the one watched
        wait_for(lambda: Task.objects.get(pk=task.pk).status == "waiting", timeout=90,
                 message="git_commit waiting for approval")
        assert git_repo.commits() == 1
        [approval] = ReviewItem.objects.filter(task=task, kind="approval")
        review_decide(item_id=approval.pk, decision="approve", note="", actor=reviewer)
        wait_for(lambda: Task.objects.get(pk=task.pk).status == "awaiting_review", timeout=90,
                 message="the call in doubt going to review")
        assert (tmp_path / "faults" / "after_effect@tool-002-1").exists(), "the crash did not happen"
        [doubt] = ReviewItem.objects.filter(task=task, kind="effect", status="open")
        assert doubt.wal_entry.tool == "mcp.call" and doubt.wal_entry.args["tool"] == "git_commit"
        assert git_repo.commits() == 2  # it did go out before the kill: the reviewer sees it in the log
        # The server died with the executor that started it (nothing runs the task while it waits).
        wait_for(lambda: not processes_running(repo), timeout=15, message="the git server gone with its executor")
        review_decide(item_id=doubt.pk, decision="happened", note="the commit is in the log", actor=reviewer)
        task = settle(task.pk, timeout=90)
    assert task.status == "completed", task.status_reason
    assert git_repo.commits() == 2 and git_repo.messages() == ["Notes from the agent", "first"]
    assert WalEntry.objects.get(task=task, args__tool="git_commit").status == "done"
    wait_for(lambda: not processes_running(repo), timeout=15, message="the git server closed with its executor")


def test_stop_and_pause_mid_call_cancel_it_on_the_server(declare, journal, start_workers, make_user):
    declare(faulty=faulty(journal, "--wire"))
    boss = make_user("boss", superuser=True)
    with AttackerModel([("faulty__slow", {"seconds": 120})] * 2) as model:
        start_workers(1, **model_env(model), **declare.env(), ORCH_PAUSE_GRACE_SECONDS=0.5)
        task = services.task_create(type="agent.plan_execute", actor=boss,
                                    params={"goal": "Wait for it", "tools": ["faulty__slow"]})

        def calls_of_slow() -> list[dict]:
            return [m for m in journal.wire() if m.get("method") == "tools/call" and m["params"]["name"] == "slow"]

        def cancelled() -> list:
            return [m["params"]["requestId"] for m in journal.wire() if m.get("method") == "notifications/cancelled"]

        # Pause: the read is cut after the grace period, and the server is told.
        wait_for(lambda: journal.calls("slow"), timeout=90, message="the slow call arriving")
        services.task_pause(task_id=task.pk)
        wait_for(lambda: Task.objects.get(pk=task.pk).status == "paused", timeout=30, message="paused")
        wait_for(lambda: cancelled(), timeout=15, message="notifications/cancelled after the pause")
        assert cancelled() == [calls_of_slow()[0]["id"]]
        assert [e for e in journal.entries() if e.get("cancelled") == "slow"]  # its handler was interrupted
        # Resumed, the call runs again; Stop cuts it at once, and the server is told again.
        services.task_resume(task_id=task.pk)
        wait_for(lambda: len(journal.calls("slow")) == 2, timeout=90, message="the slow call again")
        services.task_stop(task_id=task.pk)
        wait_for(lambda: Task.objects.get(pk=task.pk).status == "stopped", timeout=30, message="stopped")
        wait_for(lambda: len(cancelled()) == 2, timeout=15, message="notifications/cancelled after the stop")
        assert cancelled()[1] == calls_of_slow()[1]["id"]
        assert len([e for e in journal.entries() if e.get("cancelled") == "slow"]) == 2
    assert not WalEntry.objects.filter(task=task).exists()  # a read: nothing in the WAL



def test_stop_mid_write_tells_the_server_and_a_reviewer_says_whether_it_happened(declare, journal, start_workers,
                                                                                  make_user):
    declare(faulty=faulty(journal, "--wire"))
    boss = make_user("boss", superuser=True)
    with AttackerModel([("faulty__slow_write", {"seconds": 120})]) as model:
        start_workers(1, **model_env(model), **declare.env())
        task = services.task_create(type="agent.plan_execute", actor=boss, params={
            "goal": "Write it", "tools": ["faulty__slow_write"], "approval_waived": ["faulty__slow_write"]})
        wait_for(lambda: journal.calls("slow_write"), timeout=90, message="the write arriving")
        services.task_stop(task_id=task.pk)
        wait_for(lambda: Task.objects.get(pk=task.pk).status == "stopped", timeout=30, message="stopped")
        wait_for(lambda: [e for e in journal.entries() if e.get("cancelled") == "slow_write"], timeout=15,
                 message="the server's handler cancelled")
    [call] = [m for m in journal.wire() if m.get("method") == "tools/call"]
    assert [m["params"]["requestId"] for m in journal.wire() if m.get("method") == "notifications/cancelled"] == [
        call["id"]]
    # It was sent: whether it took effect is a reviewer's to say, never guessed.
    entry = WalEntry.objects.get(task=task)
    assert entry.status == "pending" and call["params"]["_meta"][mcp.IDEMPOTENCY_META_KEY] == entry.idempotency_key
    [item] = ReviewItem.objects.filter(task=task, wal_entry=entry, status="open")
    assert "cancelled (stop) after the request was sent" in item.reason and "say whether it happened" in item.reason


def test_a_stdio_server_dies_with_its_worker_killed_9_mid_call(declare, journal, start_workers, make_user):
    """The server is in the executor's session (not a session of its own, as the SDK's stdio client
    would start it): when the worker dies, its session keeper kills it with the executor."""
    declare(faulty=faulty(journal))
    boss = make_user("boss", superuser=True)
    with AttackerModel([("faulty__slow", {"seconds": 120})]) as model:
        start_workers(1, **model_env(model), **declare.env())
        task = services.task_create(type="agent.plan_execute", actor=boss,
                                    params={"goal": "Wait for it", "tools": ["faulty__slow"]})
        mcp.close_all()  # this process's own session (creating the task asked the server)
        wait_for(lambda: journal.calls("slow"), timeout=90, message="the slow call arriving")
        [server] = [e["started"] for e in journal.entries() if "started" in e][-1:]
        executor = Task.objects.get(pk=task.pk).worker_pid
        assert _stat(server)["session"] == _stat(executor)["session"] == executor  # the executor's own session
        worker = _stat(executor)["ppid"]
        os.kill(worker, signal.SIGKILL)
        wait_for(lambda: not _alive(server), timeout=15, message="the MCP server dying with the worker")
        wait_for(lambda: not _alive(executor), timeout=15, message="the executor dying with the worker")
        services.task_stop(task_id=task.pk)


def _stat(pid: int) -> dict:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return {"state": fields[0], "ppid": int(fields[1]), "session": int(fields[3])}


def _alive(pid: int) -> bool:
    try:
        return _stat(pid)["state"] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False
