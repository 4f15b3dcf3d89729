"""benchmarks/product_chain.py on CPU (the Pallas kernel through the interpreter): every implementation's chain
matches the float32 chain, the [N, K] kernels included, and the report has per-product numbers."""

import json

import pytest

from benchmarks import product_chain


def test_each_implementation_runs_the_chain_and_matches_float32(tmp_path, capsys):
    rows = product_chain.main(["--dim", "64", "--products", "3", "--repeat", "2", "--out", str(tmp_path)])
    assert [r["implementation"] for r in rows] == list(product_chain.IMPLEMENTATIONS)
    for row in rows:
        assert row["ok"] and row["rel_max_error"] < 2e-2 and row["products"] == 6 and row["us_per_product"] > 0
    saved = json.loads((tmp_path / "product_chain.json").read_text())
    assert [r["implementation"] for r in saved["rows"]] == list(product_chain.IMPLEMENTATIONS)
    assert "us per product" in capsys.readouterr().out


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        product_chain.parse_args(["--dim", "100"])
    with pytest.raises(SystemExit):
        product_chain.parse_args(["--repeat", "0"])
    with pytest.raises(ValueError, match="implementation 'cublas'"):
        product_chain.product("cublas", None, None, interpret=True)
