"""The README routes and docs/ teaches: every link in them resolves (a file, and a heading for
an #anchor), and every docs/ page is linked from the README."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
README_LIMIT = 12 * 1024


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = heading.strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    in_code = False
    found = set()
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            found.add(slug(line.lstrip("#")))
    return found


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_every_link_in_the_readme_and_docs_resolves():
    broken = []
    for page in pages():
        for target in LINK.findall(page.read_text()):
            if re.match(r"^[a-z]+:", target):  # http(s), mailto: not checked offline
                continue
            file_part, _, anchor = target.partition("#")
            linked = (page.parent / file_part).resolve() if file_part else page
            if not linked.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert broken == []


def test_the_readme_routes_to_every_docs_page_and_stays_short():
    readme = (ROOT / "README.md").read_text()
    linked = {Path(target.partition("#")[0]).name for target in LINK.findall(readme)}
    assert [p.name for p in sorted((ROOT / "docs").glob("*.md")) if p.name not in linked] == []
    assert len(readme.encode()) <= README_LIMIT
    assert "make test" in readme and "make run" in readme


def test_the_readme_says_how_to_bring_your_own_tools_mcp_servers_and_models():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Bring your own tools, MCP servers and models\n", 1)[1].split("\n## ", 1)[0]
    for needed in ("ORCH_EXTENSIONS", "ORCH_MCP_SERVERS", "LLM_MODELS", "(docs/extending.md)"):
        assert needed in section


def test_every_test_named_in_the_recovery_claims_exists():
    """docs/recovery-claims.md maps each claim of recovery.md to the tests that prove it: a
    test renamed or deleted leaves a claim with nothing behind it. `T` is the recovery table's
    own test module; `::name` alone is in the file named last; a name ending in `…` is a prefix."""
    files_named, missing = 0, []
    for line in (ROOT / "docs" / "recovery-claims.md").read_text().splitlines():
        if not re.match(r"\| \d+\w? \|", line):
            continue
        row, _claim, tests = (cell.strip() for cell in line.strip().strip("|").split("|")[:3])
        current = None
        for path, name, prefix in re.findall(r"((?:[\w/]+\.py)|\bT)?::(test_\w+)(…)?", tests):
            if path:
                current = ROOT / "tests" / ("engine/test_recovery_table.py" if path == "T" else path)
            source = current.read_text() if current is not None and current.exists() else ""
            files_named += 1
            if not re.search(r"def " + re.escape(name) + ("" if prefix else r"\("), source):
                missing.append(f"row {row}: {current}::{name}")
    assert files_named > 100  # the parser still reads the table
    assert not missing, "tests named in docs/recovery-claims.md that do not exist:\n" + "\n".join(missing)
