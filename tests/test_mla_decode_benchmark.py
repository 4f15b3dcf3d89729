"""benchmarks/mla_decode.py on CPU (tiny shapes, the kernel interpreted): both implementations checked and timed."""

import json

import pytest

from benchmarks import mla_decode


def test_smoke_run_times_and_checks_both(tmp_path, capsys):
    rows = mla_decode.main(["--smoke", "--batches", "1", "2", "--chain", "2", "--out", str(tmp_path)])
    assert [(r["batch"], r["implementation"][:6]) for r in rows] == [(1, "xla (e"), (1, "pallas"), (2, "xla (e"),
                                                                      (2, "pallas")]
    assert all(r["us"] > 0 and r["max_abs_error"] <= 2e-3 for r in rows)
    assert [r["batch"] for r in json.loads((tmp_path / "mla_decode.json").read_text())["rows"]] == [1, 1, 2, 2]
    assert "| 1 | pallas (defaults) |" in capsys.readouterr().out


def test_a_wrong_result_fails_the_run(monkeypatch, tmp_path):
    monkeypatch.setattr(mla_decode.pallas_decode, "latent_attention", lambda q, *a, **k: q * 0 + 1)
    with pytest.raises(AssertionError, match="pallas .*max abs error"):
        mla_decode.main(["--smoke", "--batches", "1", "--chain", "1", "--out", str(tmp_path)])


def test_chain_over_distinct_caches(tmp_path):
    """--caches N: the timed chain's calls take N distinct caches in turn (the first the checked problem's), so that
    at 48B shapes they stream from HBM; the sweep times the whole-rows program beside the default."""
    keys = mla_decode.inputs(1, **{k: mla_decode.SMOKE[k] for k in ("heads", "rank", "rope", "cache", "context")})[2]
    caches = mla_decode.distinct_caches(keys, 3)
    assert len(caches) == 3 and caches[0] is keys and all(c.shape == keys.shape for c in caches)
    assert not any(bool((caches[i] == caches[j]).all()) for i, j in ((0, 1), (0, 2), (1, 2)))
    rows = mla_decode.main(["--smoke", "--batches", "1", "--chain", "3", "--caches", "3", "--out", str(tmp_path)])
    assert [r["implementation"][:6] for r in rows] == ["xla (e", "pallas"] and all(r["us"] > 0 for r in rows)
    labels = [label for label, _ in mla_decode.kernel_settings(True, 1, 80, heads=2)]
    assert labels[:2] == ["pallas (defaults)", "pallas all rows"]


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        mla_decode.parse_args(["--context", "5000"])
    with pytest.raises(SystemExit):
        mla_decode.parse_args(["--caches", "0"])
