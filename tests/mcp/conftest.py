"""MCP servers for the tests: real ones from their registries (mcp-server-git and mcp-server-time
from PyPI, installed with the test extra; server-everything from npm, installed by `make test`)
and one of the tests' own (faulty_server.py)."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from django.conf import settings as django_settings

from orchestrator.primitives import redaction
from orchestrator.tools import mcp

HERE = Path(__file__).resolve().parent
FAULTY_SERVER = HERE / "faulty_server.py"
BIN = Path(sys.executable).parent
NPM_EVERYTHING = django_settings.BASE_DIR / "var" / "mcp-npm" / "node_modules" / ".bin" / "mcp-server-everything"

needs_npm_server = pytest.mark.skipif(
    not NPM_EVERYTHING.exists() or shutil.which("node") is None,
    reason="the npm MCP server is not installed: run `make test` with Node.js and npm (apt-get install nodejs npm)")


def registry_server(name: str) -> str:
    """The command of an MCP server installed from PyPI with the test extra."""
    path = BIN / name
    if not path.exists():
        pytest.fail(f"{name} is not installed: pip install -e '.[test]' (it is in the test extra)")
    return str(path)


@pytest.fixture(autouse=True)
def fresh_sessions():
    """Each test opens its own sessions; what it opened in this process is closed after it."""
    yield
    mcp.close_all()
    mcp.configuration_changed()


@pytest.fixture
def declare(settings):
    """declare(name=spec, ...): ORCH_MCP_SERVERS for this process (the workers get it through
    their environment: `env()`)."""
    declared: dict = {}

    def add(**servers) -> dict:
        declared.update(servers)
        settings.ORCH_MCP_SERVERS = dict(declared)
        redaction.refresh()
        return declared

    add.env = lambda: {"ORCH_MCP_SERVERS": json.dumps(declared)}
    return add


class Journal:
    """What faulty_server.py saw, a JSON object a line."""

    def __init__(self, path: Path):
        self.path = path

    def entries(self) -> list[dict]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def calls(self, tool: str | None = None) -> list[dict]:
        return [e for e in self.entries() if "called" in e and (tool is None or e["called"] == tool)]

    def wire(self) -> list[dict]:
        return [e["wire"] for e in self.entries() if "wire" in e]


@pytest.fixture
def journal(tmp_path) -> Journal:
    return Journal(tmp_path / "journal.jsonl")


def faulty(journal: Journal, *flags: str) -> dict:
    return {"command": [sys.executable, str(FAULTY_SERVER), str(journal.path), *flags]}


class GitRepo:
    def __init__(self, path: Path):
        self.path = path
        git = ["git", "-c", "user.name=Tests", "-c", "user.email=tests@example.org"]
        subprocess.run(["git", "init", "-q", str(path)], check=True)
        # Whoever commits through the server commits as this (the server's environment is bare).
        subprocess.run(["git", "-C", str(path), "config", "user.name", "Agent"], check=True)
        subprocess.run(["git", "-C", str(path), "config", "user.email", "agent@example.org"], check=True)
        (path / "README.md").write_text("a repository for the MCP tests\n")
        subprocess.run([*git, "-C", str(path), "add", "README.md"], check=True)
        subprocess.run([*git, "-C", str(path), "commit", "-q", "-m", "first"], check=True)

    def commits(self) -> int:
        done = subprocess.run(["git", "-C", str(self.path), "rev-list", "--count", "HEAD"], capture_output=True,
                              text=True, check=True)
        return int(done.stdout)

    def messages(self) -> list[str]:
        done = subprocess.run(["git", "-C", str(self.path), "log", "--format=%s"], capture_output=True, text=True,
                              check=True)
        return done.stdout.split("\n")[:-1]


@pytest.fixture
def git_repo(tmp_path) -> GitRepo:
    return GitRepo(tmp_path / "repo")


def git_server(repo: GitRepo) -> dict:
    return {"command": [registry_server("mcp-server-git"), "--repository", str(repo.path)]}


def processes_running(fragment: str) -> list[int]:
    """Pids of living processes whose command line contains `fragment`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if fragment in cmdline and state != "Z":
            found.append(int(entry))
    return found
