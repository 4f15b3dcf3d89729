"""For the KDA kernel tests: random inputs (unit-scale q/k/v, gates with strongly negative channels, sigmoid betas)
and the closeness check relative to the output scale."""

import numpy as np


def random_kda_inputs(rng, batch, seq_len, num_heads, head_k, head_v, *, num_states=None, raw_gate=False):
    """Returns dict(q, k, v, g, beta, initial_state) as float32 numpy arrays.

    g is a log-decay in (-inf, 0] with some channels at -20 per step (the hard case for chunked forms), or, with
    raw_gate, a raw gate input for use_gate_in_kernel (then A_log and dt_bias are included too).
    """
    shape = (batch, seq_len, num_heads, head_k)
    out = dict(
        q=rng.standard_normal(shape), k=rng.standard_normal(shape),
        v=rng.standard_normal((batch, seq_len, num_heads, head_v)),
        beta=1.0 / (1.0 + np.exp(-rng.standard_normal((batch, seq_len, num_heads)))),
        initial_state=rng.standard_normal((num_states or batch, num_heads, head_k, head_v)))
    if raw_gate:
        out["g"] = 3.0 * rng.standard_normal(shape)
        out["A_log"] = np.log(rng.uniform(1.0, 16.0, num_heads))
        out["dt_bias"] = rng.standard_normal(num_heads * head_k)
    else:
        g = -np.exp(rng.standard_normal(shape)) * 0.5
        g[..., : max(1, head_k // 8)] = -20.0  # per-step decay of e^-20 on some channels
        g[:, ::7, -1] = -rng.uniform(5.0, 20.0, g[:, ::7, -1].shape)
        out["g"] = g
    return {name: np.asarray(value, np.float32) for name, value in out.items()}


def assert_close(actual, expected, tol=1e-5):
    """max |actual - expected| <= tol x max(1, max |expected|) (fp32 kernels: tol 1e-5)."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    scale = max(1.0, float(np.abs(expected).max()))
    err = float(np.abs(actual - expected).max())
    assert err <= tol * scale, f"max abs error {err:.3g} > {tol} x output scale {scale:.3g}"
