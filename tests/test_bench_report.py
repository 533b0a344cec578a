"""bench/report.py: the summary `make bench` prints and writes into the docs (the benchmark
itself is not a test; what it writes is checked here with made-up figures)."""
from types import SimpleNamespace

import pytest

from bench.report import END, START, Report, replace_between_markers


def figures(label, ms, commits=1.0):
    return SimpleNamespace(label=label, ms=ms, commits=commits)


def a_report() -> Report:
    report = Report(runs=3, steps=500, machine="2 cores (test CPU), 24 GiB, PostgreSQL 15")
    for run in range(3):
        report.add_step_figures(figures("floor: one-row commit", 0.30 + run / 100))
        report.add_step_figures(figures("ours, pure chain", [0.70, 0.75, 0.90][run], 0.01))
        report.add_step_figures(figures("ours, side-effect chain", [1.6, 1.7, 1.8][run]))
        report.add_step_figures(figures("ours, side-effect chain at commit", [1.3, 1.4, 1.5][run]))
        report.add_step_figures(figures("DBOS 3.4.0", 4.5))
        report.add_step_figures(figures("LangGraph 1.2.22 (sync)", 2.9))
        report.add_step_figures(figures("LangGraph 1.2.22 (async)", 1.6))
        report.add_latency({"post_to_first_step_p50_ms": 50.0, "post_to_first_step_p95_ms": 130.0,
                            "tasks_per_second": 40.0 + run, "errors": 0})
    return report


def test_the_summary_gives_min_median_max_and_each_target_met_or_missed():
    text = a_report().text()
    assert "0.70 / 0.75 / 0.90" in text  # ours, pure: min / median / max
    assert "0.75 ms" in text and "≤ 0.8 ms: met" in text and "≥ 50 tasks/s: MISSED" in text
    by_name = {t.name: t.verdict for t in a_report().targets()}
    assert by_name["pure step"] == "met"  # 0.75 <= 0.8
    assert by_name['pure step / LangGraph durability="sync"'] == "met"  # 0.75 / 2.9 = 0.26
    assert by_name['pure step / LangGraph durability="async"'] == "met"
    assert by_name["side-effect step, in place"] == "MISSED"  # 1.7 > 1.5
    assert by_name["side-effect step, in place / DBOS step"] == "MISSED"  # 1.7 / 4.5 = 0.38 > 0.35
    assert by_name["side-effect step, at commit"] == "met"  # 1.4 <= 1.5
    assert by_name["side-effect step, at commit / DBOS step"] == "met"  # 1.4 / 4.5 = 0.31
    assert by_name["POST -> first step, p50"] == "met"
    assert by_name["POST -> first step, p95"] == "MISSED"
    assert by_name["three-step tasks in flight, completed per second"] == "MISSED"  # 41 < 50


def test_a_section_not_run_is_not_measured_rather_than_met():
    report = Report(runs=1, steps=10, machine="m")
    report.add_step_figures(figures("ours, pure chain", 0.5))
    by_name = {t.name: t.verdict for t in report.targets()}
    assert by_name["pure step"] == "met"
    assert by_name["side-effect step, in place / DBOS step"] == "not measured"
    assert by_name["side-effect step, at commit"] == "not measured"
    assert by_name["three-step tasks in flight, completed per second"] == "not measured"


def test_the_docs_get_the_markdown_between_their_markers_and_a_missing_marker_is_a_clear_error(tmp_path):
    for name in ("docs/benchmarks.md", "README.md"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(f"before\n{START}\nold figures\n{END}\nafter\n")
    report = a_report()
    report.write_docs(tmp_path)
    docs = (tmp_path / "docs/benchmarks.md").read_text()
    assert docs.startswith("before\n") and docs.endswith("after\n") and "old figures" not in docs
    assert "| ours, pure step | 0.70 / 0.75 / 0.90 |" in docs and "2 cores (test CPU)" in docs
    assert "MISSED" in docs
    readme = (tmp_path / "README.md").read_text()
    assert "a pure step 0.75 ms" in readme and "benchmarks.md" in readme
    with pytest.raises(ValueError, match="expected one"):
        replace_between_markers("no markers here", "x", "README.md")


def test_the_repository_docs_have_the_markers_the_bench_writes_between():
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    for name in ("docs/benchmarks.md", "README.md"):
        text = (root / name).read_text()
        assert replace_between_markers(text, "figures", name).count("figures") >= 1
