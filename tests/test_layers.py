"""The import contracts in pyproject.toml ([tool.importlinter]) hold: the core (engine, tools,
task types, models, selectors, websockets, the review queue's services) does not import the
pages (orchestrator.web) or the API (orchestrator.api), and those two are independent."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_import_contracts_are_kept():
    lint_imports = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint_imports), "--no-cache"], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout
