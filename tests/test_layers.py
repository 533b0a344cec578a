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


def import_cycles(package_names=("orchestrator", "review")) -> list[list[str]]:
    """Groups of modules that import each other, directly or round a loop (the strongly connected
    components of the import graph), counting imports inside functions; imports made only for
    type checkers (`if TYPE_CHECKING:`) left out. Tarjan's algorithm, iterative."""
    import grimp

    graph = grimp.build_graph(*package_names, exclude_type_checking_imports=True, cache_dir=None)
    index, low, on_stack, stack, groups, counter = {}, {}, set(), [], [], 0
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            module, imported = work[-1]
            descended = False
            for other in imported:
                if other not in index:
                    index[other] = low[other] = counter
                    counter += 1
                    stack.append(other)
                    on_stack.add(other)
                    work.append((other, iter(sorted(graph.find_modules_directly_imported_by(other)))))
                    descended = True
                    break
                if other in on_stack:
                    low[module] = min(low[module], index[other])
            if descended:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[module])
            if low[module] == index[module]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == module:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))
    return groups


def test_no_two_modules_import_each_other():
    """No import cycle (issue 23): a registry imports what registers itself, never the reverse; what
    two modules share lives in a third (tools/mcp_protocol.py, tools/process_groups.py,
    engine/signals.py, admin_guards.py)."""
    assert import_cycles() == []


def test_the_cycle_finder_finds_a_cycle(tmp_path, monkeypatch):
    """The finder is not blind: two modules importing each other (one inside a function) are found."""
    package = tmp_path / "cyclic"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "first.py").write_text("from . import second\n")
    (package / "second.py").write_text("def late():\n    from . import first\n")
    (package / "third.py").write_text("from . import first\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert import_cycles(("cyclic",)) == [["cyclic.first", "cyclic.second"]]
