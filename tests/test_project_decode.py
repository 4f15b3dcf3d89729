"""The one-launch KDA decode (kernels/kda/pallas_project_decode.py) against its oracle (project_decode.py), in the
Pallas interpreter at small shapes: the output, the pool in place (other rows and padding untouched), the new conv
window, the counters left zero; and its input checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.kernels import kda as kda_kernels
from MaxText.kernels.kda import pallas_project_decode, project_decode

D, H, K, V, W, SLOTS = 64, 2, 32, 32, 4, 3
KW = dict(num_heads=H, head_dim=K, norm_eps=1e-5, out_norm_eps=1e-5)


def problem(dtype, seed=0):
    keys = iter(jax.random.split(jax.random.key(seed), 20))

    def normal(shape, scale=1.0):
        return (scale * jax.random.normal(next(keys), shape)).astype(dtype)

    weights = project_decode.ProjectionWeights(
        q=normal((H * K, D), D ** -0.5), k=normal((H * K, D), D ** -0.5), v=normal((H * V, D), D ** -0.5),
        f_a=normal((K, D), D ** -0.5), g_a=normal((K, D), D ** -0.5), b=normal((H, D), D ** -0.5),
        f_b=normal((H * K, K), K ** -0.5), g_b=normal((H * V, K), K ** -0.5), q_conv=normal((W, H * K), 0.5),
        k_conv=normal((W, H * K), 0.5), v_conv=normal((W, H * V), 0.5))
    return dict(x=normal((1, D)), norm_scale=(1 + 0.1 * jax.random.normal(next(keys), (D,))).astype(dtype),
                weights=weights, window=normal((1, W - 1, 2 * H * K + H * V)),
                A_log=jnp.log(jax.random.uniform(next(keys), (H,), minval=1, maxval=16)),
                dt_bias=0.1 * jax.random.normal(next(keys), (H * K,)),
                state_pool=0.1 * jax.random.normal(next(keys), (SLOTS, H, K, V)),
                out_norm_scale=1 + 0.1 * jax.random.normal(next(keys), (V,)))


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 0.05)])
@pytest.mark.parametrize("block_v, chunks_ahead, chunk, gate_rows", [(16, 1, 16, 64), (32, 2, 16, 16), (16, 0, 32, 64),
                                                                    (32, 9, 16, 64)])
def test_one_launch_matches_the_oracle(dtype, tol, block_v, chunks_ahead, chunk, gate_rows, monkeypatch):
    """o, the pool row of the slot and the conv window equal the oracle's (float32: to 1e-5; bfloat16: other summation
    orders of the same roundings) with the weights' chunks (4 or 2 of D) loaded one or two ahead, in Triton's
    pipelined loop or all at once, and one or two gate programs per head and gate; the other pool rows are
    bit-identical; the counters come back zero."""
    monkeypatch.setattr(pallas_project_decode, "CHUNK", chunk)
    monkeypatch.setattr(pallas_project_decode, "GATE_ROWS", gate_rows)
    inputs = problem(dtype)
    slots = jnp.array([1], jnp.int32)
    want = project_decode.project_and_decode_reference(**inputs, slot_indices=slots, **KW)
    o, pool, window, counts = pallas_project_decode.project_and_decode(**inputs, slot_indices=slots, block_v=block_v,
                                                                       chunks_ahead=chunks_ahead, interpret=True,
                                                                       **KW)
    for name, got, expected in zip(("o", "pool", "window"), (o, pool, window), want):
        assert got.shape == expected.shape and got.dtype == expected.dtype, name
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(expected, np.float32), atol=tol, rtol=tol,
                                   err_msg=name)
    untouched = np.asarray(inputs["state_pool"])
    np.testing.assert_array_equal(np.asarray(pool)[[0, 2]], untouched[[0, 2]])
    assert counts.shape == pallas_project_decode.counters_shape(H) and not np.any(np.asarray(counts))


def test_one_launch_padding_row_outputs_zeros_and_keeps_the_pool():
    inputs = problem(jnp.float32, seed=1)
    o, pool, _, _ = pallas_project_decode.project_and_decode(**inputs, slot_indices=jnp.array([-1], jnp.int32),
                                                             interpret=True, **KW)
    assert not np.any(np.asarray(o))
    np.testing.assert_array_equal(np.asarray(pool), np.asarray(inputs["state_pool"]))


def test_one_launch_input_checks_name_the_value():
    inputs = problem(jnp.float32)
    slots = jnp.array([0], jnp.int32)
    with pytest.raises(ValueError, match=r"f_b must have shape \(64, 32\)"):
        bad = inputs["weights"]._replace(f_b=inputs["weights"].f_b[:, :16])
        pallas_project_decode.project_and_decode(**{**inputs, "weights": bad}, slot_indices=slots, interpret=True,
                                                 **KW)
    with pytest.raises(ValueError, match="chunks_ahead must be >= 0, got -1"):
        pallas_project_decode.project_and_decode(**inputs, slot_indices=slots, chunks_ahead=-1, interpret=True, **KW)
    assert "one row" in pallas_project_decode.unsupported_reason(2, D, H, K, V)
    assert "D=96" in pallas_project_decode.unsupported_reason(1, 96, H, K, V)
    assert pallas_project_decode.unsupported_reason(1, 2304, 32, 128, 128) is None
    # On this CPU the dispatcher's decode does not resolve to the Pallas kernels: the layer keeps its separate ones.
    assert "does not resolve" in kda_kernels.one_launch_decode_reason("auto", 1, 2304, 32, 128, 128)
