"""benchmarks/launch_overhead.py on CPU (Pallas calls through the interpreter): every kind's chain gives x + N (or
x + N / B in each of B branches) and the report has the per-kernel numbers."""

import json

import pytest

from benchmarks import launch_overhead


def test_each_kind_runs_its_chain_and_reports_per_kernel_times(tmp_path, capsys):
    rows = launch_overhead.main(["--kernels", "4", "--calls", "2", "--out", str(tmp_path)])
    assert [r["kind"] for r in rows] == list(launch_overhead.KINDS)
    for row in rows:
        assert row["kernels"] == 4 and row["issue_us"] > 0 and row["wall_us"] >= row["issue_us"]
        assert row["issue_us_per_kernel"] == pytest.approx(row["issue_us"] / 4)
    saved = json.loads((tmp_path / "launch_overhead.json").read_text())
    assert [r["kind"] for r in saved["rows"]] == list(launch_overhead.KINDS)
    assert "us/kernel" in capsys.readouterr().out


def test_branches_under_a_graph_scheduling_each_add_their_share(tmp_path, capsys):
    """--branches 2 --graph-scheduling concurrent: two independent chains of 3 kernels (each array + 3; measure checks
    it), compiled with the CUDA-graph option (accepted and ignored on CPU)."""
    rows = launch_overhead.main(["--kernels", "6", "--calls", "2", "--kinds", "mixed", "--branches", "2",
                                 "--graph-scheduling", "concurrent", "--out", str(tmp_path)])
    assert [(r["kind"], r["branches"], r["scheduling"]) for r in rows] == [("mixed", 2, "concurrent")]
    assert "6 kernels in 2 branch(es), concurrent" in capsys.readouterr().out


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        launch_overhead.parse_args(["--kernels", "1"])
    with pytest.raises(ValueError, match="kind 'tpu'"):
        launch_overhead.chain("tpu", 4, interpret=True)
    with pytest.raises(SystemExit):
        launch_overhead.parse_args(["--kernels", "6", "--branches", "4"])
    with pytest.raises(ValueError, match="6 kernels in 4 branches"):
        launch_overhead.chain("xla", 6, interpret=True, branches=4)
