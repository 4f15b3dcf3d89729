"""Pallas KDA kernels on CPU through the Pallas interpreter (`interpret=True`), against the naive oracle.

Covered in interpret mode: the chunked prefill kernels (pallas_chunk.intra + recurrence, via pallas_ops.chunk_kda:
fp32 and bf16, l2norm and gate in kernel, initial / final state, T not a multiple of 64, cu_seqlens packs), the
packed in-place decode kernel (pallas_decode, via pallas_ops.packed_decode_kda and fused_recurrent_kda) with
padding rows. Interpret mode checks the kernels' semantics; the Triton compilation and the GPU numerics (bf16 tensor
cores, 3-pass tf32) are checked by benchmarks/kda_kernels.py on the GPU.
"""

import logging

import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.kernels import kda as kda_kernels
from MaxText.kernels.kda import pallas_ops
from MaxText.kernels.kda.naive import naive_recurrent_kda
from MaxText.kernels.kda.packed_decode import packed_decode_kda_reference
from tests.kda_inputs import random_kda_inputs

TOL = 1e-5


def assert_close(actual, expected, tol=TOL):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    scale = max(1.0, float(np.abs(expected).max()))
    err = float(np.abs(actual - expected).max())
    assert err <= tol * scale, f"max abs error {err:.3g} > {tol} x output scale {scale:.3g}"


@pytest.mark.parametrize("batch,seq_len,raw_gate,with_state", [(2, 70, False, True), (1, 100, True, False)])
def test_chunk_kda_interpret_matches_naive(batch, seq_len, raw_gate, with_state):
    x = random_kda_inputs(np.random.default_rng(seq_len), batch, seq_len, 2, 32, 32, raw_gate=raw_gate)
    if not with_state:
        x.pop("initial_state")
    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=raw_gate, output_final_state=True)
    o_ref, s_ref = naive_recurrent_kda(**x, **kw)
    o, s = pallas_ops.chunk_kda(**x, **kw, interpret=True)
    assert o.shape == o_ref.shape and o.dtype == o_ref.dtype
    assert_close(o, o_ref)
    assert_close(s, s_ref)


def test_chunk_kda_interpret_packed_sequences():
    cu = np.array([0, 5, 70, 70, 130])  # includes an empty sequence and a chunk-straddling one
    x = random_kda_inputs(np.random.default_rng(1), 1, 130, 2, 32, 32, raw_gate=True, num_states=4)
    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, output_final_state=True, cu_seqlens=cu)
    o_ref, s_ref = naive_recurrent_kda(**x, **kw)
    o, s = pallas_ops.chunk_kda(**x, **kw, interpret=True)
    assert_close(o, o_ref)
    assert_close(s, s_ref)


def test_chunk_kda_interpret_bf16():
    x = random_kda_inputs(np.random.default_rng(2), 1, 128, 2, 32, 32)
    bf = {n: (jnp.asarray(v, jnp.bfloat16) if n in ("q", "k", "v", "beta") else jnp.asarray(v)) for n, v in x.items()}
    o_ref, _ = naive_recurrent_kda(**{n: jnp.asarray(v, jnp.float32) for n, v in bf.items()},
                                   use_qk_l2norm_in_kernel=True)
    o, _ = pallas_ops.chunk_kda(**bf, use_qk_l2norm_in_kernel=True, interpret=True)
    o, o_ref = np.asarray(o, np.float64), np.asarray(o_ref, np.float64)
    rel = np.linalg.norm(o - o_ref) / np.linalg.norm(o_ref)
    assert o.dtype == np.float64 and rel <= 5e-3, f"bf16 relative L2 error {rel:.3g} > 5e-3"


def _decode_inputs(rng, batch, H, K, V, S):
    f32 = np.float32
    return dict(mixed_qkv=jnp.asarray(rng.standard_normal((batch, 2 * H * K + H * V)), f32),
                a=jnp.asarray(3.0 * rng.standard_normal((batch, H * K)), f32),
                b=jnp.asarray(rng.standard_normal((batch, H)), f32),
                A_log=jnp.asarray(np.log(rng.uniform(1.0, 16.0, H)), f32),
                dt_bias=jnp.asarray(rng.standard_normal(H * K), f32),
                state_pool=jnp.asarray(rng.standard_normal((S, H, K, V)), f32))


def test_packed_decode_interpret_matches_reference_and_keeps_padding_rows():
    H, K, V, S = 2, 32, 32, 7
    rng = np.random.default_rng(3)
    slots = jnp.asarray([4, -1, 0, 6, -1], jnp.int32)
    pool0 = None
    for step in range(3):  # a few steps, carrying both pools
        x = _decode_inputs(rng, 5, H, K, V, S)
        if pool0 is None:
            pool0 = np.asarray(x["state_pool"])
            ref_pool, our_pool = x["state_pool"], jnp.array(x["state_pool"], copy=True)
        x.pop("state_pool")
        o_ref, ref_pool = packed_decode_kda_reference(**x, state_pool=ref_pool, slot_indices=slots, num_heads=H,
                                                      head_dim=K)
        o, our_pool = pallas_ops.packed_decode_kda(**x, state_pool=our_pool, slot_indices=slots, num_heads=H,
                                                   head_dim=K, interpret=True, block_v=16)
        assert_close(o, o_ref)
        assert np.all(np.asarray(o)[[1, 4]] == 0.0), "padding rows must output zeros"
    assert_close(our_pool, ref_pool)
    untouched = [1, 2, 3, 5]
    assert np.array_equal(np.asarray(our_pool)[untouched], pool0[untouched]), "padding rows touched the pool"


def test_packed_decode_reference_matches_naive_step():
    H, K, V, S = 2, 32, 32, 3
    x = _decode_inputs(np.random.default_rng(4), 2, H, K, V, S)
    slots = jnp.asarray([2, 0], jnp.int32)
    o, pool = packed_decode_kda_reference(**x, slot_indices=slots, num_heads=H, head_dim=K)
    hk = H * K
    q = x["mixed_qkv"][:, None, :hk].reshape(2, 1, H, K)
    k = x["mixed_qkv"][:, None, hk:2 * hk].reshape(2, 1, H, K)
    v = x["mixed_qkv"][:, None, 2 * hk:].reshape(2, 1, H, V)
    beta = 1.0 / (1.0 + jnp.exp(-x["b"][:, None]))
    o_n, s_n = naive_recurrent_kda(q, k, v, x["a"].reshape(2, 1, H, K), beta, initial_state=x["state_pool"][slots],
                                   output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                   A_log=x["A_log"], dt_bias=x["dt_bias"])
    assert_close(o, o_n[:, 0])
    assert_close(pool[slots], s_n)


def test_fused_recurrent_interpret_matches_naive():
    x = random_kda_inputs(np.random.default_rng(5), 2, 3, 2, 32, 32, raw_gate=True)
    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, output_final_state=True)
    o_ref, s_ref = naive_recurrent_kda(**x, **kw)
    o, s = pallas_ops.fused_recurrent_kda(**x, **kw, interpret=True)
    assert_close(o, o_ref)
    assert_close(s, s_ref)


def test_auto_falls_back_on_cpu_and_logs_once(caplog):
    assert pallas_ops.unsupported_reason("prefill", 128, 128) is not None
    kda_kernels._logged.clear()
    with caplog.at_level(logging.INFO, logger="MaxText.kernels.kda"):
        assert kda_kernels.resolve("auto", "prefill", 128, 128) == "chunked"
        assert kda_kernels.resolve("auto", "prefill", 128, 128) == "chunked"
        assert kda_kernels.resolve("auto", "decode", 128, 128) == "naive"
    lines = [r.getMessage() for r in caplog.records if "kda_kernel=auto" in r.getMessage()]
    assert len(lines) == 2 and all("GPU" in line for line in lines), lines


def test_pallas_on_cpu_is_a_clear_error():
    with pytest.raises(RuntimeError, match="kda_kernel=pallas was requested.*GPU"):
        kda_kernels.resolve("pallas", "prefill", 128, 128)


def test_packed_decode_rejects_bad_shapes():
    x = _decode_inputs(np.random.default_rng(6), 2, 2, 32, 32, 3)
    with pytest.raises(ValueError, match="slot_indices must have shape"):
        pallas_ops.packed_decode_kda(**x, slot_indices=jnp.zeros((3,), jnp.int32), num_heads=2, head_dim=32)
