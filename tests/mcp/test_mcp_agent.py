"""An agent with MCP servers as tool sources (issue 21 item 2), driven in this process with a
scripted model (tests/support/attacker_model.py): servers nobody here wrote, from their
registries (mcp-server-git and mcp-server-time from PyPI, server-everything from npm), and one
of the tests' own for what they do not do on demand (faulty_server.py)."""
import io
import json
import logging
import socket
import subprocess
import sys
import time

import pytest

from orchestrator import logging as orch_logging, selectors
from orchestrator.agent import mcp as mcp_tools, toolbox
from orchestrator.engine import services
from orchestrator.engine.services import InvalidInput
from orchestrator.engine.worker import drive_inline
from orchestrator.models import AgentMessage, Task, WalEntry
from orchestrator.tools import mcp
from review.models import ReviewItem
from review.services import review_decide
from tests.conftest import free_port, wait_for
from tests.support.attacker_model import AttackerModel

from .conftest import FAULTY_SERVER, NPM_EVERYTHING, faulty, git_server, needs_npm_server, registry_server

pytestmark = pytest.mark.django_db(transaction=True)

KEY = mcp.IDEMPOTENCY_META_KEY


@pytest.fixture
def boss(make_user):
    return make_user("boss", superuser=True)


@pytest.fixture
def scripted(settings):
    """scripted(turns) -> the model, this process's agents talking to it."""
    models = []

    def start(turns: list) -> AttackerModel:
        model = AttackerModel(turns).__enter__()
        models.append(model)
        settings.LLM_BASE_URL, settings.LLM_MODEL, settings.LLM_MAX_ATTEMPTS = model.base_url, "scripted", 1
        return model

    yield start
    for model in models:
        model.__exit__(None, None, None)


@pytest.fixture
def log_lines():
    """What this process logs from here on, formatted as in production (the JSON formatter, which
    redacts): log_lines() -> the text."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(orch_logging.JsonFormatter())
    loggers = [logging.getLogger(name) for name in ("orchestrator", "mcp", "httpx2", "httpcore2")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)
    yield stream.getvalue
    for logger, level in zip(loggers, levels):
        logger.removeHandler(handler)
        logger.setLevel(level)


def agent(actor, **params) -> Task:
    return services.task_create(type="agent.plan_execute", actor=actor,
                                params={"goal": "Look after the repository", **params})


def answers(task: Task) -> dict[str, str]:
    """The model's call id -> the tool message it read."""
    return {m.tool_call_id: m.content for m in AgentMessage.objects.filter(task=task, role="tool")}


def offered(request: dict) -> list[str]:
    return [t["function"]["name"] for t in request.get("tools") or []]


# --- mcp-server-git, end to end ------------------------------------------------------------

def test_git_reads_run_at_once_and_git_commit_waits_for_approval_then_commits_exactly_once(
        declare, git_repo, scripted, boss, reviewer):
    declare(git=git_server(git_repo))
    (git_repo.path / "notes.txt").write_text("what the agent found\n")
    repo = str(git_repo.path)
    model = scripted([
        [("git__git_status", {"repo_path": repo}), ("git__git_log", {"repo_path": repo, "max_count": 5})],
        ("git__git_add", {"repo_path": repo, "files": ["notes.txt"]}),
        ("git__git_commit", {"repo_path": repo, "message": "Add the agent's notes"}),
    ])
    task = agent(boss, tools=["git__git_status", "git__git_log", "git__git_add", "git__git_commit"])
    assert drive_inline(task.pk) == "waiting"
    # The reads ran at once, with no WAL entry, and the model read what the server said.
    got = answers(task)
    assert "notes.txt" in got["call_1_1"] and "Untracked" in got["call_1_1"]
    assert "first" in got["call_1_2"]
    # git_add is idempotent (its annotations say so): through the WAL, no reviewer.
    [add] = WalEntry.objects.filter(task=task, tool="mcp.call", args__tool="git_add")
    assert add.status == "done" and add.idempotent
    # git_commit is not: it waits for a reviewer, and nothing is committed yet.
    [item] = ReviewItem.objects.filter(task=task, kind="approval", status="open")
    assert item.tool == "git__git_commit" and item.proposal["arguments"]["message"] == "Add the agent's notes"
    assert git_repo.commits() == 1
    review_decide(item_id=item.pk, decision="approve", note="", actor=reviewer)
    assert drive_inline(task.pk) == "completed", Task.objects.get(pk=task.pk).status_reason
    assert git_repo.commits() == 2 and git_repo.messages()[0] == "Add the agent's notes"
    [commit] = WalEntry.objects.filter(task=task, tool="mcp.call", args__tool="git_commit")
    assert commit.status == "done" and not commit.idempotent
    assert not answers(task)["call_3_1"].startswith(("error", "rejected"))
    # Every read and write reached the model as <server>__<tool> with the server's own schema.
    tools = {t["function"]["name"]: t["function"] for t in model.requests[0]["tools"]}
    listed = mcp.list_tools(mcp.server("git"))
    assert tools["git__git_commit"]["parameters"] == listed["git_commit"].input_schema
    drive_inline(task.pk)  # nothing left to run: committed once
    assert git_repo.commits() == 2


def test_annotations_map_to_effect_classes_and_the_installation_overrides_them(declare, git_repo, journal):
    assert mcp.effect_class({"readOnlyHint": True, "idempotentHint": False}) == "read_only"
    assert mcp.effect_class({"idempotentHint": True, "destructiveHint": True}) == "idempotent"
    assert mcp.effect_class({"destructiveHint": False}) == "non_idempotent"
    assert mcp.effect_class({}) == mcp.effect_class(None) == "non_idempotent"  # the spec's default: destructive
    assert mcp.effect_class({"readOnlyHint": "yes"}) == "non_idempotent"  # only a true hint counts
    assert mcp.effect_class({"readOnlyHint": True}, "non_idempotent") == "non_idempotent"
    declare(git={**git_server(git_repo), "tool_effects": {"git_add": "non_idempotent", "git_commit": "keyed"}},
            faulty=faulty(journal))
    effect = {name: toolbox.find_tool(name).effect for name in mcp_tools.tools_of("git") + mcp_tools.tools_of(
        "faulty")}
    assert effect["git__git_status"] == effect["git__git_log"] == "read_only"  # readOnlyHint: true
    assert effect["git__git_reset"] == "idempotent"  # idempotentHint: true (destructive all the same)
    assert effect["git__git_checkout"] == "non_idempotent"  # neither
    assert effect["git__git_add"] == "non_idempotent"  # idempotentHint: true, overridden
    assert effect["git__git_commit"] == "keyed"  # overridden the other way
    assert effect["faulty__put"] == "idempotent" and effect["faulty__record"] == "non_idempotent"
    assert effect["faulty__echo"] == "read_only"
    why = lambda name: toolbox.needs_approval(name, {}, require=[], waived=[])  # noqa: E731
    assert why("git__git_add") and why("faulty__record") and not why("git__git_commit") and not why("faulty__put")


def test_an_admin_row_declares_a_server_and_the_environment_wins_a_name_clash(declare, journal, tmp_path):
    from orchestrator.models import McpServer

    McpServer.objects.create(name="files", command=[sys.executable, str(FAULTY_SERVER), str(journal.path)],
                             tool_effects={"echo": "non_idempotent"})
    McpServer.objects.create(name="off", command=["true"], enabled=False)
    assert sorted(mcp.servers()) == ["files"]
    assert toolbox.find_tool("files__echo").effect == "non_idempotent"
    other = tmp_path / "other.jsonl"
    declare(files={"command": [sys.executable, str(FAULTY_SERVER), str(other)]})
    assert mcp.server("files").origin == "ORCH_MCP_SERVERS"
    assert toolbox.find_tool("files__echo").effect == "read_only"  # the environment's, without the override


# --- registry servers: time (PyPI), everything (npm) --------------------------------------------

def test_a_read_only_tool_of_mcp_server_time_answers_the_model(declare, scripted, boss):
    declare(time={"command": [registry_server("mcp-server-time"), "--local-timezone", "UTC"]})
    model = scripted([("time__get_current_time", {"timezone": "Europe/Paris"}),
                      ("time__convert_time", {"source_timezone": "UTC", "time": "12:00",
                                              "target_timezone": "Asia/Tokyo"})])
    task = agent(boss, tools=["time__*"])
    assert drive_inline(task.pk) == "completed"
    got = answers(task)
    assert '"timezone": "Europe/Paris"' in got["call_1_1"] and "datetime" in got["call_1_1"]
    assert "21:00" in got["call_2_1"]
    assert not WalEntry.objects.filter(task=task).exists()  # reads: no WAL entry
    # time__* was offered as the server's tools, expanded at each turn.
    assert set(offered(model.requests[0])) == {"time__get_current_time", "time__convert_time"}
    assert Task.objects.get(pk=task.pk).params["tools"] == ["time__*"]


@needs_npm_server
def test_the_npm_server_everything_over_stdio(declare, scripted, boss):
    declare(everything={"command": [str(NPM_EVERYTHING), "stdio"]})
    model = scripted([[("everything__echo", {"message": "hello from the agent"}),
                       ("everything__get-sum", {"a": 20, "b": 22})],
                      ("everything__get-sum", {"a": "twenty"})])
    task = agent(boss, tools=["everything__echo", "everything__get-sum"])
    assert drive_inline(task.pk) == "completed"
    got = answers(task)
    assert got["call_1_1"] == "Echo: hello from the agent"
    assert "42" in got["call_1_2"]
    # Arguments that fail the server's schema go back to the model, checked before any request.
    assert got["call_2_1"].startswith("error: invalid arguments for everything__get-sum")
    assert set(offered(model.requests[0])) == {"everything__echo", "everything__get-sum"}


# --- who may grant MCP tools ----------------------------------------------------------------------

def test_only_an_admin_grants_mcp_tools_and_each_must_exist_on_its_server(declare, git_repo, operator, boss):
    declare(git=git_server(git_repo))
    with pytest.raises(InvalidInput) as refused:
        agent(operator, tools=["contracts_list", "git__git_status"])
    assert "only an admin may grant git__git_status (MCP servers' tools reach outside the harness)" in str(
        refused.value)
    with pytest.raises(InvalidInput) as refused:
        agent(operator, tools=["git__*"])
    assert "only an admin may grant git__*" in str(refused.value)
    assert not Task.objects.exists()
    with pytest.raises(InvalidInput) as refused:
        agent(boss, tools=["git__git_push"])
    assert "git__git_push: the MCP server git has no such tool (it has: git__git_status" in str(refused.value)
    with pytest.raises(InvalidInput) as refused:
        agent(boss, tools=["nowhere__thing"])
    assert "unknown tools ['nowhere__thing']" in str(refused.value)
    for lists in ({"approval_waived": ["git__*"]}, {"two_person_approval": ["git__*"]},
                  {"approval_rules": {"git__*": {"timeout_seconds": 60}}}):
        with pytest.raises(InvalidInput) as refused:  # a wildcard there would match no call: refused
            agent(boss, tools=["git__*"], **lists)
        assert "<server>__* is for tools" in str(refused.value)
    task = agent(boss, tools=["git__*"], approval_waived=["git__git_commit"])
    assert services.authorize_params("agent.plan_execute", task.params, actor=boss)["mcp_tools"] == ["git__*"]
    # An operator may edit what an admin granted without granting it again, never add to it.
    assert services.authorize_params("agent.plan_execute", {**task.params, "goal": "other"}, actor=operator,
                                     before=task.params) == {"mcp_tools": ["git__*"],
                                                             "approval_waived": ["git__git_commit"]}
    with pytest.raises(InvalidInput):
        services.authorize_params("agent.plan_execute", {**task.params, "tools": ["git__*", "git__git_log"]},
                                  actor=operator, before=task.params)


def test_a_prompt_injected_model_calling_an_mcp_tool_it_was_not_given_gets_an_error(
        declare, git_repo, scripted, boss):
    declare(git=git_server(git_repo))
    (git_repo.path / "loot.txt").write_text("x\n")
    repo = str(git_repo.path)
    model = scripted([("git__git_add", {"repo_path": repo, "files": ["loot.txt"]}),
                      ("git__git_commit", {"repo_path": repo, "message": "pwned"}),
                      ("git__git_status", {"repo_path": repo})])
    task = agent(boss, tools=["git__git_status"])
    assert drive_inline(task.pk) == "completed"
    got = answers(task)
    for call in ("call_1_1", "call_2_1"):
        assert got[call].startswith("error: there is no tool 'git__git_") and "the tools are: git__git_status" in \
            got[call]
    assert "loot.txt" in got["call_3_1"]  # untracked: never added
    assert git_repo.commits() == 1 and not WalEntry.objects.filter(task=task).exists()
    assert not ReviewItem.objects.filter(task=task).exists()
    assert offered(model.requests[0]) == ["git__git_status"]


# --- faults, on a server of the tests' own ----------------------------------------------------------

def test_the_idempotency_key_travels_in_meta_and_reads_carry_none(declare, journal, scripted, boss):
    declare(faulty=faulty(journal, "--wire"))
    scripted([[("faulty__put", {"entry": "a"}), ("faulty__echo", {"text": "b"})]])
    task = agent(boss, tools=["faulty__put", "faulty__echo"])
    assert drive_inline(task.pk) == "completed"
    [entry] = WalEntry.objects.filter(task=task)
    assert entry.tool == "mcp.call" and entry.args == {"server": "faulty", "tool": "put", "arguments": {"entry": "a"},
                                                       "effect": "idempotent"}
    [put], [echo] = journal.calls("put"), journal.calls("echo")
    assert put["meta"][KEY] == entry.idempotency_key
    assert KEY not in echo["meta"]
    # One server process and one listing for the creation's check and both calls: a session is
    # kept per process, and so is its listing.
    assert len([e for e in journal.entries() if "started" in e]) == 1
    assert [m.get("method") for m in journal.wire()] == ["server/discover", "tools/list", "tools/call", "tools/call"]


def test_a_server_that_drops_the_connection_after_the_request_arrived_sends_the_call_to_review(
        declare, journal, scripted, boss, reviewer):
    declare(faulty=faulty(journal))
    scripted([("faulty__crash", {"entry": "the one"})])
    task = agent(boss, tools=["faulty__crash"], approval_waived=["faulty__crash"])
    assert drive_inline(task.pk) == "awaiting_review"
    [item] = ReviewItem.objects.filter(task=task, status="open")
    assert item.kind == "effect" and item.wal_entry.tool == "mcp.call" and item.wal_entry.status == "pending"
    assert "the request had been sent, so it may have been performed" in item.reason
    [arrived] = journal.calls("crash")
    assert arrived["meta"][KEY] == item.wal_entry.idempotency_key
    review_decide(item_id=item.pk, decision="happened", note="the server's journal has it", actor=reviewer)
    assert drive_inline(task.pk) == "completed"
    assert len(journal.calls("crash")) == 1  # never sent again
    assert "confirmed_by_reviewer" in answers(task)["call_1_1"]


def test_an_idempotent_call_whose_connection_dropped_is_replayed_with_its_key_and_the_model_reads_the_answer(
        declare, journal, scripted, boss):
    declare(faulty=faulty(journal))
    scripted([("faulty__flaky_put", {"entry": "x"}), ("faulty__echo", {"text": "still there?"})])
    task = agent(boss, tools=["faulty__flaky_put", "faulty__echo"])
    assert drive_inline(task.pk) == "completed", task.status_reason
    got = answers(task)
    # Not "it failed" (the model could ask again with a new key): the step ran again and replayed
    # the call with the same key, to a new server process, which answered.
    assert got["call_1_1"] == "put x (already set)"
    assert got["call_2_1"] == "echo: still there?"
    first, replay = journal.calls("flaky_put")
    entry = WalEntry.objects.get(task=task)
    assert first["meta"][KEY] == replay["meta"][KEY] == entry.idempotency_key
    assert entry.status == "done" and entry.idempotent
    assert not ReviewItem.objects.filter(task=task).exists()


def test_an_idempotent_call_that_drops_on_every_replay_waits_for_an_operator_with_its_key_kept(
        declare, journal, scripted, boss, operator, reviewer):
    declare(faulty={**faulty(journal), "tool_effects": {"crash": "idempotent"}})
    scripted([("faulty__crash", {"entry": "x"})])
    task = agent(boss, tools=["faulty__crash"])
    assert drive_inline(task.pk) == "needs_human"
    entry = WalEntry.objects.get(task=task)
    calls = journal.calls("crash")
    # Replayed with the same key until the step's retries ran out; the model was never told "it
    # failed" (it could ask again with a new key). A Resume replays it with that key again.
    assert len(calls) >= 2 and {c["meta"][KEY] for c in calls} == {entry.idempotency_key}
    assert entry.status == "pending" and not AgentMessage.objects.filter(task=task, role="tool").exists()
    # The operator stops it instead: nothing will replay it now, so a reviewer records what happened.
    services.task_stop(task_id=task.pk, actor=operator, reason="the server is down for the day")
    [item] = ReviewItem.objects.filter(task=task, status="open")
    assert item.kind == "effect" and item.wal_entry_id == entry.pk
    review_decide(item_id=item.pk, decision="happened", note="the server's journal has it", actor=reviewer)
    assert WalEntry.objects.get(task=task).status == "done"
    assert len(journal.calls("crash")) == len(calls)  # nothing was sent again


def test_a_malformed_result_is_an_error_the_model_reads_and_nothing_crashes(declare, journal, scripted, boss,
                                                                              reviewer):
    declare(broken=faulty(journal, "--malformed"))
    scripted([("broken__broken_read", {}), ("broken__broken_write", {})])
    task = agent(boss, tools=["broken__broken_read", "broken__broken_write"], approval_waived=["broken__broken_write"])
    assert drive_inline(task.pk) == "awaiting_review"
    got = answers(task)
    assert got["call_1_1"].startswith("error: MCP broken__broken_read: its answer is not a valid MCP tool result")
    # A write whose answer cannot be read may have been done: a reviewer says, as for any unknown outcome.
    [item] = ReviewItem.objects.filter(task=task, status="open")
    assert "not a valid MCP tool result" in item.reason and item.wal_entry.args["tool"] == "broken_write"
    review_decide(item_id=item.pk, decision="not_happened", note="nothing written", actor=reviewer)
    # Performed again, with the same key; its answer cannot be read either: in front of a reviewer again.
    assert drive_inline(task.pk) == "awaiting_review"
    [again] = ReviewItem.objects.filter(task=task, status="open")
    assert again.wal_entry_id == item.wal_entry_id and "not a valid MCP tool result" in again.reason
    assert len(journal.calls("broken_write")) == 2
    calls = journal.calls("broken_write")
    assert calls[0]["meta"][KEY] == calls[1]["meta"][KEY]


def test_a_tool_error_result_is_a_failure_the_model_reads(declare, journal, scripted, boss):
    declare(faulty=faulty(journal))
    scripted([("faulty__refuse", {"reason": "not today"}), ("faulty__echo", {"text": 7})])
    task = agent(boss, tools=["faulty__refuse", "faulty__echo"])
    assert drive_inline(task.pk) == "completed"
    got = answers(task)
    assert got["call_1_1"].startswith("error: MCP faulty__refuse failed:") and "refused: not today" in got["call_1_1"]
    assert got["call_2_1"].startswith("error: invalid arguments for faulty__echo: text: 7 is not of type 'string'")
    assert len(journal.calls("echo")) == 0  # checked against the server's schema before sending


def test_a_tool_that_disappears_between_turns_is_an_error_the_model_reads(declare, journal, scripted, boss):
    declare(faulty=faulty(journal))
    model = scripted([("faulty__retire", {"tool": "echo"}), ("faulty__echo", {"text": "anyone?"}),
                      ("faulty__echo", {"text": "and now?"})])
    task = agent(boss, tools=["faulty__*"], approval_waived=["faulty__retire"])
    assert drive_inline(task.pk) == "completed"
    got = answers(task)
    assert got["call_1_1"] == "echo retired"
    assert got["call_2_1"].startswith("error:") and "echo" in got["call_2_1"]  # the server's answer: no such tool
    assert got["call_3_1"].startswith("error: there is no tool 'faulty__echo'")  # the listing knows it now
    assert "faulty__echo" in offered(model.requests[0])
    assert "faulty__echo" not in offered(model.requests[-1])


def test_secrets_of_a_stdio_server_never_reach_the_model_a_log_or_the_export(declare, journal, scripted, boss,
                                                                               log_lines, monkeypatch):
    secret = "faulty-secret-" + "7f3a9c2e5b1d"
    # The worker's own secrets are in its environment; the server's child gets none of them.
    monkeypatch.setenv("LLM_API_KEY", "worker-llm-key-" + "5e6f7a8b")
    monkeypatch.setenv("DJANGO_SECRET_KEY", "worker-django-secret-" + "1a2b3c4d")
    declare(faulty={**faulty(journal), "env": {"FAULTY_SECRET": secret}})
    model = scripted([("faulty__leak", {})])
    task = agent(boss, tools=["faulty__leak"])
    assert drive_inline(task.pk) == "completed"
    [leaked] = journal.calls("leak")
    assert secret in leaked["arguments"]["told"]  # the server had it: the environment reached the child
    assert "FAULTY_SECRET" in leaked["arguments"]["environment"] and "PATH" in leaked["arguments"]["environment"]
    assert not {"LLM_API_KEY", "DJANGO_SECRET_KEY"} & set(leaked["arguments"]["environment"])
    assert secret not in model.seen_text()
    assert "[redacted: environment FAULTY_SECRET of MCP server faulty]" in answers(task)["call_1_1"]
    export = json.dumps(selectors.task_export(task.pk), default=str)
    assert secret not in export
    mcp.close_all()  # the server's stderr is all read
    logs = log_lines()
    assert "leaking secret=[redacted: environment FAULTY_SECRET of MCP server faulty]" in logs  # its stderr, logged
    assert secret not in logs


@pytest.fixture
def http_server(journal, tmp_path):
    port, token = free_port(), "tok-" + "b1e2a3r4e5r6"
    log = open(tmp_path / "http-server.log", "w")
    process = subprocess.Popen([sys.executable, str(FAULTY_SERVER), str(journal.path), "--http", str(port), "--token",
                                token], stdout=log, stderr=subprocess.STDOUT)

    def listening() -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    wait_for(listening, timeout=60, message="the MCP server over HTTP")
    yield f"http://127.0.0.1:{port}/mcp", token, process
    process.kill()
    process.wait()
    log.close()


def test_a_streamable_http_server_gets_its_bearer_token_and_the_token_is_never_shown(
        declare, journal, http_server, scripted, boss, log_lines):
    url, token, _ = http_server
    declare(web={"url": url, "headers": {"Authorization": f"Bearer {token}"}},
            stranger={"url": url, "headers": {"Authorization": "Bearer not-the-token-0"}})
    model = scripted([[("web__echo", {"text": "over HTTP"}), ("web__leak", {})], ("web__record", {"entry": "e"})])
    with pytest.raises(InvalidInput) as refused:  # the server refuses a wrong token: nothing to grant
        agent(boss, tools=["stranger__echo"])
    assert "stranger__echo: the MCP server stranger could not be reached" in str(refused.value)
    task = agent(boss, tools=["web__echo", "web__leak", "web__record"], approval_waived=["web__record"])
    assert drive_inline(task.pk) == "completed"
    got = answers(task)
    assert got["call_1_1"] == "echo: over HTTP"
    assert got["call_1_2"] == "secret= authorization=[redacted: header Authorization of MCP server web]"
    [record] = journal.calls("record")
    assert record["meta"][KEY] == WalEntry.objects.get(task=task).idempotency_key  # _meta over HTTP too
    assert journal.calls("leak")[0]["arguments"]["told"].endswith(f"Bearer {token}")  # the header was sent
    assert any("refused" in e for e in journal.entries())
    assert token not in model.seen_text()
    assert token not in json.dumps(selectors.task_export(task.pk), default=str)
    assert token not in log_lines()


def test_a_write_to_a_server_gone_before_the_request_left_is_not_performed(declare, journal, http_server, scripted,
                                                                           boss):
    url, token, process = http_server

    def server_gone(loot: str):
        process.kill()
        process.wait()
        return "web__record", {"entry": "never sent"}

    scripted([("web__echo", {"text": "up"}), server_gone])
    declare(web={"url": url, "headers": {"Authorization": f"Bearer {token}"}})
    task = agent(boss, tools=["web__echo", "web__record"], approval_waived=["web__record"])
    assert drive_inline(task.pk) == "completed"
    got = answers(task)
    assert got["call_1_1"] == "echo: up"
    # Its session was open, but the connection could not be made: nothing left, nobody is asked.
    assert got["call_2_1"] == "error: MCP web__record was not sent: ConnectError: All connection attempts failed"
    entry = WalEntry.objects.get(task=task)
    assert entry.status == "failed" and not ReviewItem.objects.filter(task=task).exists()
    assert journal.calls("record") == []


def test_an_unreachable_server_is_refused_at_creation_and_not_offered(declare, boss):
    port = free_port()
    declare(gone={"url": f"http://127.0.0.1:{port}/mcp"})
    # Declared, but unreachable at creation: the admin is told (nothing to check the tools against).
    with pytest.raises(InvalidInput) as refused:
        agent(boss, tools=["gone__anything"])
    assert "gone__anything: the MCP server gone could not be reached" in str(refused.value)
    started = time.monotonic()
    assert toolbox.find_tool("gone__anything") is None  # a run's turn: not offered, a call to it an error
    assert time.monotonic() - started < 15


def test_a_call_past_orch_mcp_call_timeout_seconds_is_cut_and_the_model_reads_why(declare, journal, scripted, boss,
                                                                                   settings):
    settings.ORCH_MCP_CALL_TIMEOUT_SECONDS = 1
    declare(faulty=faulty(journal))
    scripted([("faulty__slow", {"seconds": 30}), ("faulty__echo", {"text": "still there?"})])
    task = agent(boss, tools=["faulty__slow", "faulty__echo"])
    started = time.monotonic()
    assert drive_inline(task.pk) == "completed"
    assert time.monotonic() - started < 20  # not the 30 s the server would have taken
    got = answers(task)
    assert got["call_1_1"].startswith(
        "error: MCP faulty__slow: no answer within 1 s (ORCH_MCP_CALL_TIMEOUT_SECONDS); the server was told to cancel")
    assert got["call_2_1"] == "echo: still there?"
    # The server was told: its handler was interrupted, not left running.
    wait_for(lambda: [e for e in journal.entries() if e.get("cancelled") == "slow"], timeout=10,
             message="the slow handler cancelled")
