"""MCP tools in the compatibility fingerprint (issue 24, item 7; tasktypes/fingerprint.py): an
agent paused after a turn, its MCP server replaced by one whose tool takes another argument (the
tests' own FastMCP server, `--echo-v2`), is not resumed silently: the resume is refused with the
difference until an operator accepts it. A server that cannot be reached at the check is not
compared (and its last digests are kept), rather than taken for a change. Real server processes
over stdio, the scripted model, the inline runner."""
import sys

import pytest

from orchestrator.engine import compat, services
from orchestrator.engine.worker import drive_inline
from orchestrator.models import Task
from orchestrator.tools import mcp

from .conftest import faulty
from .test_mcp_agent import agent, boss, scripted  # noqa: F401 (fixtures)

pytestmark = pytest.mark.django_db(transaction=True)


def paused_after_one_turn(actor, tools: list[str]) -> Task:
    task = services.task_create(type="agent.plan_execute", actor=actor, limits={"max_steps": 1},
                                params={"goal": "Look after the repository", "tools": tools})
    assert drive_inline(task.pk) == "paused"
    return Task.objects.get(pk=task.pk)


def deploy(declare, **servers) -> None:
    """The servers are replaced (a new version, or one that does not start): this process's
    sessions are closed, as a new deploy's processes would have none."""
    declare(**servers)
    mcp.close_all()
    mcp.configuration_changed()


def test_a_changed_mcp_tool_signature_is_caught_on_resume_and_runs_only_once_accepted(
        declare, journal, scripted, boss, operator):  # noqa: F811
    declare(faulty=faulty(journal))
    scripted([[("faulty__echo", {"text": "a"})], [("faulty__echo", {"text": "b", "loud": True})]])
    task = paused_after_one_turn(boss, ["faulty__echo"])
    recorded = task.compat["tool:faulty__echo"]
    assert compat.check(task).compatible  # the same server: nothing to say

    deploy(declare, faulty=faulty(journal, "--echo-v2"))
    gate = compat.check(task)
    assert [(d["key"], d["text"].split(" (")[0]) for d in gate.differences] == [
        ("tool:faulty__echo", "tool faulty__echo: its argument schema changed")]
    with pytest.raises(compat.IncompatibleResume, match="tool faulty__echo: its argument schema changed"):
        services.task_resume(task_id=task.pk, limits={"max_steps": 10})
    assert Task.objects.get(pk=task.pk).status == "paused"
    services.task_resume(task_id=task.pk, limits={"max_steps": 10}, accept_changes=True, actor=operator)
    assert Task.objects.get(pk=task.pk).compat["tool:faulty__echo"] not in (recorded, None)
    assert drive_inline(task.pk) == "completed"
    assert [c["arguments"] for c in journal.calls("echo")][-1] == {"text": "b", "loud": True}


def test_a_wildcard_grant_fingerprints_every_tool_and_an_unreachable_server_is_not_a_difference(
        declare, journal, scripted, boss):  # noqa: F811
    declare(faulty=faulty(journal))
    scripted([[("faulty__echo", {"text": "a"})]])
    task = paused_after_one_turn(boss, ["faulty__*"])
    tools = {k for k in task.compat if k.startswith("tool:faulty__")}
    assert {"tool:faulty__echo", "tool:faulty__put", "tool:faulty__record"} <= tools
    before = dict(task.compat)

    # The server does not start at the check: not compared, and recording keeps what it last ran on.
    deploy(declare, faulty={"command": [sys.executable, "-c", "import sys; sys.exit(3)"]})
    gate = compat.check(task)
    assert gate.compatible, gate.differences
    assert not compat.record(task) and task.compat == before

    # Back, changed: only the changed tool is a difference.
    deploy(declare, faulty=faulty(journal, "--echo-v2"))
    assert [d["key"] for d in compat.check(task).differences] == ["tool:faulty__echo"]
