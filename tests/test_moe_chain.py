"""benchmarks/moe_chain.py on CPU (the Pallas kernels through the interpreter): both weight layouts run the chain of
MoE sublayers (router launch, expert launches) and match float32 layer by layer; a wrong sublayer fails the check."""

import json

import jax.numpy as jnp
import pytest

from benchmarks import moe_chain

SMALL = ["--dim", "256", "--inner", "128", "--layers", "2", "--pool", "16"]


def test_each_layout_runs_the_chain_and_matches_float32(tmp_path, capsys):
    rows = moe_chain.main(SMALL + ["--out", str(tmp_path)])
    assert [r["layout"] for r in rows] == list(moe_chain.LAYOUTS)
    for row in rows:
        assert row["ok"] and row["rel_max_error"] < 1e-2 and row["us_per_layer"] > 0
    saved = json.loads((tmp_path / "moe_chain.json").read_text())
    assert [r["layout"] for r in saved["rows"]] == list(moe_chain.LAYOUTS)
    assert "us per layer" in capsys.readouterr().out


def test_a_sublayer_without_its_experts_fails_the_check(tmp_path, monkeypatch):
    monkeypatch.setattr(moe_chain, "experts", lambda h, *args: jnp.zeros_like(h))
    rows = moe_chain.main(SMALL + ["--out", str(tmp_path)])
    assert not any(row["ok"] for row in rows) and min(row["rel_max_error"] for row in rows) > moe_chain.ERROR_BOUND


def test_a_chain_that_fails_to_build_is_recorded_and_the_others_run(tmp_path, monkeypatch):
    build = moe_chain.chain

    def chain(layout, *args):
        if layout == "in_out":
            raise RuntimeError("out of shared memory")
        return build(layout, *args)
    monkeypatch.setattr(moe_chain, "chain", chain)
    rows = moe_chain.main(SMALL + ["--out", str(tmp_path)])
    assert rows[0]["failed"] == "RuntimeError: out of shared memory" and rows[1]["ok"]
    assert not moe_chain.succeeded(rows) and moe_chain.succeeded(rows[1:])


def test_sweep_changes_one_launch_option_at_a_time():
    plan = moe_chain.variants(sweep=True)
    assert plan[:2] == [(layout, {}, {}, {}) for layout in moe_chain.LAYOUTS]
    assert len(plan) == 2 + 2 * len(moe_chain.ROUTER_SWEEP) + len(moe_chain.GATE_UP_SWEEP) + len(moe_chain.DOWN_SWEEP)
    assert all(sum(bool(options) for options in variant[1:]) == 1 for variant in plan[2:])
    assert moe_chain.variants(sweep=False) == plan[:2]


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        moe_chain.parse_args(["--dim", "100"])
    with pytest.raises(SystemExit):
        moe_chain.parse_args(["--pool", "4"])
    with pytest.raises(ValueError, match="layout 'kn'"):
        moe_chain.experts(None, {}, None, None, "kn", {}, {}, interpret=True)
