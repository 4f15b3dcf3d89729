"""Pallas KDA kernels on CPU through the Pallas interpreter (`interpret=True`), against the naive oracle.

Covered in interpret mode: the chunked prefill kernels (pallas_chunk.intra + recurrence, via pallas_ops.chunk_kda:
fp32 and bf16, l2norm and gate in kernel, initial / final state, T not a multiple of 64, cu_seqlens packs), the
packed in-place decode kernels with padding rows (pallas_decode, via pallas_ops.packed_decode_kda and
fused_recurrent_kda; mosaic_decode in Mosaic GPU's interpreter, which writes a fresh pool there, and its GPU path
lowered for CUDA with the pool aliased in place), the speculative verify kernel (pallas_verify, via
pallas_ops.recurrent_kda_checkpoints) with fp32 and bf16 checkpoints and writing a state ring in place
(recurrent_kda_ring_checkpoints), and the serving kernels under shard_map on a 4-device CPU mesh (a subprocess).
Interpret mode checks the kernels' semantics; the Triton / Mosaic GPU compilation, the Mosaic kernel's in-place update
and the GPU numerics (bf16 tensor cores, 3-pass tf32) are checked by benchmarks/kda_kernels.py and
benchmarks/kda_verify.py on the GPU.
"""

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.kernels import kda as kda_kernels
from MaxText.kernels.kda import mosaic_decode, pallas_ops
from MaxText.kernels.kda.naive import naive_recurrent_kda
from MaxText.kernels.kda.packed_decode import apply_output_norm, packed_decode_kda_reference
from MaxText.kernels.kda.verify import recurrent_kda_checkpoints, recurrent_kda_ring_checkpoints
from tests.kda_inputs import assert_close, random_kda_inputs


@pytest.mark.parametrize("batch,seq_len,raw_gate,with_state,l2norm", [(2, 70, False, True, True),
                                                                      (1, 100, True, False, True),
                                                                      (1, 64, False, True, False)])
def test_chunk_kda_interpret_matches_naive(batch, seq_len, raw_gate, with_state, l2norm):
    """Without l2norm in the kernel the keys have norm 0.7 (a stable delta rule) and the queries 2: a kernel that
    normalized them anyway would be off."""
    x = random_kda_inputs(np.random.default_rng(seq_len), batch, seq_len, 2, 32, 32, raw_gate=raw_gate)
    if not with_state:
        x.pop("initial_state")
    if not l2norm:
        for name, length in (("q", 2.0), ("k", 0.7)):
            x[name] = length * x[name] / np.linalg.norm(x[name], axis=-1, keepdims=True)
    kw = dict(use_qk_l2norm_in_kernel=l2norm, use_gate_in_kernel=raw_gate, output_final_state=True)
    o_ref, s_ref = naive_recurrent_kda(**x, **kw)
    o, s = pallas_ops.chunk_kda(**x, **kw, interpret=True)
    assert o.shape == o_ref.shape and o.dtype == o_ref.dtype
    assert_close(o, o_ref)
    assert_close(s, s_ref)


@pytest.mark.parametrize("aligned_keys,block_k,programs", [(False, 32, "chunk"), (True, 32, "chunk"),
                                                          (False, 16, "chunk"), (True, 16, "chunk"),
                                                          (False, 16, "halves"), (False, 16, "rows")])
def test_scores_and_wy_inverse_kernels_give_each_chunks_scores_and_inverse(aligned_keys, block_k, programs):
    """`diag` + `scores` give every chunk's A_qk = scale q k^T e^{G_i - G_j} (j <= i) and A_kk, and `wy_inverse`
    (diagonal 16x16 blocks by block size doubling, then the off-diagonal blocks) (I + diag(beta) A_kk)^-1, both
    computed here in float64 from the kernels' own qn, kn, G. Random strong gates make the entries span several
    orders of magnitude; nearly parallel keys without decay and beta ~ 1 make A_kk close to all-ones below the
    diagonal (where a Neumann product of powers loses 5e-4). block_k = 16 of K = 32: the pair products accumulated
    over two channel blocks; 32: one; every split of `scores` into programs. NaN where `diag` leaves its blocks unset:
    `scores` must mask them."""
    from MaxText.kernels.kda import pallas_chunk
    x = random_kda_inputs(np.random.default_rng(11), 1, 128, 2, 32, 32, raw_gate=True)
    if aligned_keys:
        x["k"] = x["k"][:, :1] + 0.05 * x["k"]  # [1, T, H, K] one direction plus a little noise
        x["g"] = np.full_like(x["g"], -30.0)  # softplus(-30 + dt_bias) ~ 0: no decay
        x["beta"] = np.full_like(x["beta"], 0.99)
    q, k, g, beta = (jnp.asarray(x[name][0]) for name in ("q", "k", "g", "beta"))  # [T = 2 chunks, H, ...]
    qn, kn, G = pallas_chunk.prepare(q, k, g, jnp.asarray(x["A_log"]), jnp.asarray(x["dt_bias"]), l2norm=True,
                                     gate=True, interpret=True)
    scale = 32 ** -0.5
    diag_blocks = pallas_chunk.diag(qn, kn, G, scale=scale, interpret=True)
    # `diag` leaves the entries above its diagonal unset (and akk's diagonal not zero): garbage there must reach
    # neither A_qk nor the inverse
    s_of_t = np.arange(128)[:, None] % 16  # [T, 1] position of token t in its sub-chunk
    diag_blocks = (jnp.where(np.arange(16) > s_of_t, jnp.nan, diag_blocks[0]),
                   jnp.where(np.arange(16) >= s_of_t, jnp.nan, diag_blocks[1]))
    aqk, akk = pallas_chunk.scores(qn, kn, G, diag_blocks, scale=scale, block_k=block_k, programs=programs,
                                   interpret=True)
    inverse = pallas_chunk.wy_inverse(akk, beta, dtype=jnp.float32, interpret=True)  # [H, T, 64]
    qn, kn, G = (np.asarray(a, np.float64) for a in (qn, kn, G))
    for h in range(2):
        for c in range(2):
            rows = slice(64 * c, 64 * c + 64)
            decay = np.exp(np.minimum(G[rows, h][:, None, :] - G[rows, h][None, :, :], 0.0))  # [64, 64, K], j <= i
            below = np.tril(np.ones((64, 64)), -1)
            a_qk = np.tril(np.einsum("ic,jc,ijc->ij", qn[rows, h], kn[rows, h], decay)) * scale
            a_kk = np.einsum("ic,jc,ijc->ij", kn[rows, h], kn[rows, h], decay) * below
            want = np.linalg.inv(np.eye(64) + np.asarray(beta[rows, h], np.float64)[:, None] * a_kk)
            np.testing.assert_allclose(np.asarray(aqk[h, rows]), a_qk, rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(np.asarray(inverse[h, rows]), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("head_k,head_v", [(128, 128), (64, 128)])
@pytest.mark.parametrize("dtype,tol", [(jnp.bfloat16, 1e-2), (jnp.float32, 1e-5)])
def test_wu_kernel_gives_w_u_and_gated_keys(head_k, head_v, dtype, tol):
    """`wu` (one program per (chunk, head) looping over 64-column blocks) gives w = T (beta k e^G), u = T (beta v),
    qg = scale q e^G, kg = k e^{G_last - G} and G_last, computed here in float64 from the same inputs (T in the
    inputs' dtype, as `wy_inverse` stores it). bf16: bf16 outputs and operands, 1e-2 relative L2; fp32: 1e-5. Three
    chunks and two column blocks per side (K = V = 128): a swapped index or a skipped block would show; K < V, where
    the key and value blocks differ. G enters in the kernels' default units: base 2 with bf16 (`base2`), natural with
    fp32; G_last comes back in the same units."""
    from MaxText.kernels.kda import pallas_chunk
    rng = np.random.default_rng(21)
    T, H, C = 192, 2, pallas_chunk.CHUNK
    qn, kn = (jnp.asarray(rng.standard_normal((T, H, head_k)) / 8, dtype) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((T, H, head_v)), dtype)
    units = pallas_chunk.pallas_exp.LOG2E if dtype == jnp.bfloat16 else 1.0  # what `prepare` writes for this dtype
    G_in = jnp.asarray(np.cumsum(-rng.uniform(0, 0.2, (T // C, C, H, head_k)), axis=1).reshape(T, H, head_k)
                       * units, jnp.float32)
    beta = jnp.asarray(rng.uniform(0.1, 1.0, (T, H)), dtype)
    inverse = jnp.asarray(np.tril(rng.standard_normal((H, T // C, C, C)) / 4, -1) + np.eye(C),
                          dtype).reshape(H, T, C)
    outputs = pallas_chunk.wu(qn, kn, G_in, v, beta, inverse, scale=0.25, interpret=True)
    q64, k64, v64, G64, b64 = (np.asarray(x, np.float64) for x in (qn, kn, v, G_in, beta))
    G64 = G64 / units  # natural log-decay for the reference
    chunks = lambda x: x.reshape(T // C, C, H, -1).transpose(2, 0, 1, 3)  # noqa: E731  [T, H, D] -> [H, N, C, D]
    T64 = np.asarray(inverse, np.float64).reshape(H, T // C, C, C)
    b = b64.T.reshape(H, T // C, C, 1)
    g_last = chunks(G64)[:, :, -1:]  # [H, N, 1, K]
    want = (chunks(q64) * np.exp(chunks(G64)) * 0.25, chunks(k64) * np.exp(g_last - chunks(G64)),
            T64 @ (b * chunks(k64) * np.exp(chunks(G64))), T64 @ (b * chunks(v64)))
    for got, expected in zip(outputs[:4], want):  # qg, kg, w [H, T, K]; u [H, T, V]
        assert got.dtype == dtype
        got = np.asarray(got, np.float64).reshape(expected.shape)
        assert np.linalg.norm(got - expected) <= tol * np.linalg.norm(expected)
    g_last_in = chunks(np.asarray(G_in))[:, :, -1]  # [H, N, K], in the units G entered in
    np.testing.assert_array_equal(np.asarray(outputs[4]), g_last_in)


def test_recurrence_narrows_value_blocks_for_few_sequences():
    """One sequence of 32 heads (64 programs at 64 columns) takes 32-column blocks (measured faster on an H200); eight
    sequences keep 64. Every width (16 is timed by kda_kernels.py --tune) gives the naive result."""
    from MaxText.kernels.kda import pallas_chunk
    assert pallas_chunk.recurrence_block_v(1, 32, 128) == 32
    assert pallas_chunk.recurrence_block_v(8, 32, 128) == 64
    x = random_kda_inputs(np.random.default_rng(5), 1, 70, 2, 32, 128)
    kw = dict(use_qk_l2norm_in_kernel=True, output_final_state=True)
    o_ref, s_ref = naive_recurrent_kda(**x, **kw)
    for block_v in (16, 32, 64):
        o, s = pallas_ops.chunk_kda(**x, **kw, block_v=block_v, interpret=True)
        assert_close(o, o_ref)
        assert_close(s, s_ref)


@pytest.mark.parametrize("head_k,head_v", [(64, 128), (128, 64)])
def test_chunk_kda_interpret_unequal_head_dims(head_k, head_v):
    """K != V, both above one 64-column block of the `wu` kernel: its key-column and value-column programs differ.
    The final state's tolerance is 5e-5: the XLA chunked kernel differs from the naive recurrence by the same
    1.0e-5 - 1.1e-5 here (fp32 rounding over 64 decayed steps); a wrong column block errs by O(state)."""
    x = random_kda_inputs(np.random.default_rng(head_k), 1, 64, 1, head_k, head_v, raw_gate=True)
    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, output_final_state=True)
    o_ref, s_ref = naive_recurrent_kda(**x, **kw)
    o, s = pallas_ops.chunk_kda(**x, **kw, interpret=True)
    assert_close(o, o_ref)
    assert_close(s, s_ref, tol=5e-5)


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


@pytest.mark.parametrize("columns_fastest", [False, True])
def test_packed_decode_interpret_matches_reference_and_keeps_padding_rows(columns_fastest):
    """columns_fastest: the launch grid in either order."""
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
                                                   head_dim=K, interpret=True, block_v=16,
                                                   columns_fastest=columns_fastest)
        assert_close(o, o_ref)
        assert np.all(np.asarray(o)[[1, 4]] == 0.0), "padding rows must output zeros"
    assert_close(our_pool, ref_pool)
    untouched = [1, 2, 3, 5]
    assert np.array_equal(np.asarray(our_pool)[untouched], pool0[untouched]), "padding rows touched the pool"


@pytest.mark.parametrize("batch, grid", [(2, (2, 2, 4)), (8, (8, 2, 1)), (32, (2, 2, 32))])
def test_packed_decode_default_tile_by_batch(batch, grid):
    """decode_tile: 32 value columns a program, rows fastest, below 4 rows; a head's 128 columns in one program from
    4 rows; from 32 rows 64 columns launched with a head's value blocks side by side (grid (value blocks, heads,
    rows))."""
    H, K, V, S = 2, 32, 128, batch
    x = _decode_inputs(np.random.default_rng(5), batch, H, K, V, S)
    slots = jnp.arange(batch, dtype=jnp.int32)
    jaxpr = str(jax.make_jaxpr(functools.partial(pallas_ops.packed_decode_kda, num_heads=H, head_dim=K,
                                                 interpret=True))(**x, slot_indices=slots))
    assert f"grid=({', '.join(map(str, grid))})" in jaxpr


@pytest.mark.parametrize("in_dtype, out_dtype, tol", [(jnp.float32, None, 1e-5), (jnp.bfloat16, jnp.float32, 1e-5)])
def test_mosaic_decode_interpret_matches_reference_and_keeps_padding_rows(in_dtype, out_dtype, tol):
    """The Mosaic GPU kernel (kernel="mosaic", Mosaic GPU's interpreter): 3 rows x 2 heads on 2 persistent programs
    with 2 shared-memory stages (each program refills a stage), a padding row, over 3 steps."""
    H, K, V, S = 2, 128, 128, 5
    rng = np.random.default_rng(11)
    slots = jnp.asarray([4, -1, 1], jnp.int32)
    x = _decode_inputs(rng, 3, H, K, V, S)
    pool0 = np.asarray(x["state_pool"])
    ref_pool, our_pool = x.pop("state_pool"), jnp.asarray(pool0)
    for _ in range(3):
        x = {name: value.astype(in_dtype) if name in ("mixed_qkv", "a", "b") else value
             for name, value in _decode_inputs(rng, 3, H, K, V, S).items() if name != "state_pool"}
        o_ref, ref_pool = packed_decode_kda_reference(**x, state_pool=ref_pool, slot_indices=slots, num_heads=H,
                                                      head_dim=K, out_dtype=out_dtype)
        o, our_pool = mosaic_decode.decode_call(**x, state_pool=our_pool, slot_indices=slots, num_heads=H,
                                                head_dim=K, scale=K ** -0.5, out_dtype=out_dtype, stages=2,
                                                interpret=True)
        assert o.dtype == o_ref.dtype
        np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(o_ref, np.float32), atol=tol, rtol=tol)
        assert np.all(np.asarray(o)[1] == 0.0), "the padding row must output zeros"
    np.testing.assert_allclose(our_pool, ref_pool, atol=tol, rtol=tol)
    untouched = [0, 2, 3]
    assert np.array_equal(np.asarray(our_pool)[untouched], pool0[untouched]), "rows outside the batch changed"


def test_mosaic_decode_lowers_for_cuda_updating_the_donated_pool_in_place():
    """The GPU path (no interpreter), lowered for CUDA on this CPU machine: one Mosaic GPU kernel whose pool operand
    (the JAX Ref over the donated pool) is aliased to the pool it returns, so the step writes no second pool."""
    H, K, B, S = 2, 128, 3, 5
    x = _decode_inputs(np.random.default_rng(14), B, H, K, K, S)
    slots = jnp.asarray([4, -1, 1], jnp.int32)
    lowered = mosaic_decode.decode_step.trace(**x, slot_indices=slots, num_heads=H, head_dim=K, scale=K ** -0.5,
                                              programs=4).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 1
    # operands: the 6 inputs, then the pool (index 6); results: o, then the pool (index 1)
    assert "output_operand_alias<output_tuple_indices = [1], operand_index = 6," in text
    assert "tensor<5x2x128x128xf32> {tf.aliasing_output = 1 : i32}" in text  # the donated pool is the output buffer


def test_packed_decode_takes_the_mosaic_kernel_when_asked(monkeypatch):
    """pallas_ops.packed_decode_kda(kernel="mosaic") runs mosaic_decode (interpreted here) with the dispatcher's
    scale (and XLA's output norm after it when asked); on CPU the default stays the Triton kernel (decode_kernel
    needs a Hopper GPU); other dims, an unknown kernel and the Triton kernel's tile options are errors."""
    H, K, V, S = 2, 128, 128, 3
    x = _decode_inputs(np.random.default_rng(12), 2, H, K, V, S)
    slots = jnp.asarray([2, 0], jnp.int32)
    assert pallas_ops.decode_kernel(256, K, V) == "triton"  # no GPU here
    calls = []
    monkeypatch.setattr(mosaic_decode, "decode_step",
                        lambda *args, **kwargs: calls.append(kwargs) or mosaic_decode.decode_call(*args, **kwargs))
    o, pool = pallas_ops.packed_decode_kda(**x, slot_indices=slots, num_heads=H, head_dim=K, kernel="mosaic",
                                           interpret=True)
    o_ref, pool_ref = packed_decode_kda_reference(**x, slot_indices=slots, num_heads=H, head_dim=K)
    assert len(calls) == 1 and calls[0]["scale"] == K ** -0.5
    assert_close(o, o_ref)
    assert_close(pool, pool_ref)
    norm = dict(out_gate=jnp.asarray(np.random.default_rng(14).standard_normal((2, H * V)), jnp.float32),
                out_norm_scale=jnp.full((V,), 1.5, jnp.float32), out_norm_eps=1e-6)  # the output norm after it
    o, _ = pallas_ops.packed_decode_kda(**x, slot_indices=slots, num_heads=H, head_dim=K, kernel="mosaic",
                                        interpret=True, **norm)
    assert_close(o, packed_decode_kda_reference(**x, slot_indices=slots, num_heads=H, head_dim=K, **norm)[0])
    with pytest.raises(ValueError, match="block_v: options of the Triton decode kernel"):
        pallas_ops.packed_decode_kda(**x, slot_indices=slots, num_heads=H, head_dim=K, kernel="mosaic", block_v=64)
    with pytest.raises(ValueError, match="kernel must be one of"):
        pallas_ops.packed_decode_kda(**x, slot_indices=slots, num_heads=H, head_dim=K, kernel="cuda")
    small = _decode_inputs(np.random.default_rng(13), 2, H, 32, 32, S)
    with pytest.raises(ValueError, match="needs K = V = 128"):
        pallas_ops.packed_decode_kda(**small, slot_indices=slots, num_heads=H, head_dim=32, kernel="mosaic",
                                     interpret=True)


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


@pytest.mark.parametrize("seq_len", [1, 3, 5])
def test_verify_interpret_matches_scan(seq_len):
    """The Pallas verify kernel == verify.recurrent_kda_checkpoints (o and every token's post-state), for fp32 and
    bf16 checkpoints; the committed state is only read."""
    x = random_kda_inputs(np.random.default_rng(10 + seq_len), 2, seq_len, 2, 32, 32, raw_gate=True)
    committed = np.array(x["initial_state"], copy=True)
    for checkpoint_dtype in (jnp.float32, jnp.bfloat16):
        kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, checkpoint_dtype=checkpoint_dtype)
        o_ref, ckpt_ref = recurrent_kda_checkpoints(**x, **kw)
        o, ckpt = pallas_ops.recurrent_kda_checkpoints(**x, **kw, interpret=True, block_v=16)
        assert o.shape == (2, seq_len, 2, 32) and o.dtype == jnp.float32
        assert ckpt.shape == (2, seq_len, 2, 32, 32) and ckpt.dtype == checkpoint_dtype
        assert_close(o, o_ref)
        if checkpoint_dtype == jnp.float32:
            assert_close(ckpt, ckpt_ref)
        else:  # both round (nearly) the same fp32 state to bf16: at most one bf16 ulp apart
            assert_close(ckpt, ckpt_ref, tol=2.0 ** -7)
    assert np.array_equal(x["initial_state"], committed)


def _ring_inputs(rng, batch, seq_len, num_slots, H=2, K=32, V=32):
    """Verify inputs with a random state ring [B, S, H, K, V] and committed slots that wrap around the ring."""
    x = random_kda_inputs(rng, batch, seq_len, H, K, V, raw_gate=True)
    x.pop("initial_state")
    x["state_ring"] = rng.standard_normal((batch, num_slots, H, K, V)).astype(np.float32)
    x["state_slot"] = (np.arange(batch, dtype=np.int32) * 3 + num_slots - 2) % num_slots
    return x


def _all_eqns(jaxpr):
    """The equations of a jaxpr and of every jaxpr nested in their params (jit, pallas_call, ...)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)  # a ClosedJaxpr wraps a Jaxpr
            if hasattr(inner, "eqns"):
                yield from _all_eqns(inner)


def test_ring_verify_interpret_matches_scan_in_place():
    """The Pallas verify kernel writing the state ring in place (the ring aliased to its output) == the scan: o, the
    fp32 checkpoints in slots (s + 1 + t) mod S, every other slot (the committed one included) unchanged."""
    import jax

    seq_len, num_slots = 3, 5
    x = _ring_inputs(np.random.default_rng(13), 3, seq_len, num_slots)
    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True)
    o_ref, ring_ref = recurrent_kda_ring_checkpoints(**x, **kw)
    o, ring = pallas_ops.recurrent_kda_ring_checkpoints(**x, **kw, interpret=True, block_v=16)
    assert_close(o, o_ref)
    assert_close(ring, ring_ref)
    initial = x["state_ring"][np.arange(3), x["state_slot"]]
    _, checkpoints = recurrent_kda_checkpoints(**{n: x[n] for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias")},
                                               initial_state=initial, **kw)
    written = np.zeros((3, num_slots), bool)
    for row, slot in enumerate(x["state_slot"]):
        for t in range(seq_len):
            target = (slot + 1 + t) % num_slots
            written[row, target] = True
            assert_close(np.asarray(ring)[row, target], checkpoints[row, t])
    np.testing.assert_array_equal(np.asarray(ring)[~written], x["state_ring"][~written])
    jaxpr = jax.make_jaxpr(lambda x: pallas_ops.recurrent_kda_ring_checkpoints(**x, **kw, interpret=True))(x)
    calls = [eqn for eqn in _all_eqns(jaxpr.jaxpr) if eqn.primitive.name == "pallas_call"]
    assert [tuple(eqn.params["input_output_aliases"]) for eqn in calls] == [((8, 1),)]  # the ring, in place
    with pytest.raises(ValueError, match=r"S=4 slots per row; verifying T=4 tokens needs S >= T \+ 1 = 5"):
        pallas_ops.recurrent_kda_ring_checkpoints(**_ring_inputs(np.random.default_rng(0), 1, 4, 4), **kw,
                                                  interpret=True)


def test_packed_decode_out_dtype():
    """bf16 inputs with out_dtype=float32: the fp32 output the benchmark compares against the reference."""
    H, K, V, S = 2, 32, 32, 2
    x = _decode_inputs(np.random.default_rng(7), 2, H, K, V, S)
    x["mixed_qkv"] = x["mixed_qkv"].astype(jnp.bfloat16)
    slots = jnp.asarray([1, 0], jnp.int32)
    o_ref, _ = packed_decode_kda_reference(**x, slot_indices=slots, num_heads=H, head_dim=K, out_dtype=jnp.float32)
    o, _ = pallas_ops.packed_decode_kda(**x, slot_indices=slots, num_heads=H, head_dim=K, out_dtype=jnp.float32,
                                        interpret=True)
    assert o.dtype == o_ref.dtype == jnp.float32
    assert_close(o, o_ref)


@pytest.mark.parametrize("block_v", [16, 32])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_packed_decode_output_norm_in_the_launch(block_v, dtype):
    """out_norm_eps: the kernel's output is the KDA output norm of its o (`apply_output_norm`), in one launch; with
    a head split over value blocks (16) the head's last block computes it after a count of its finished blocks.
    Padding rows stay zero; the pool is the plain kernel's. (The Mosaic kernel's path:
    test_packed_decode_takes_the_mosaic_kernel_when_asked.)"""
    H, K, V, S = 2, 32, 32, 7
    rng = np.random.default_rng(21)
    x = _decode_inputs(rng, 5, H, K, V, S)
    x["mixed_qkv"] = x["mixed_qkv"].astype(dtype)
    slots = jnp.asarray([4, -1, 0, 6, -1], jnp.int32)
    norm = dict(out_gate=jnp.asarray(rng.standard_normal((5, H * V)), jnp.float32),
                out_norm_scale=jnp.asarray(1.0 + 0.3 * rng.standard_normal(V), jnp.float32), out_norm_eps=1e-6)
    o_ref, pool_ref = packed_decode_kda_reference(**x, slot_indices=slots, num_heads=H, head_dim=K, **norm)
    plain, _ = packed_decode_kda_reference(**x, slot_indices=slots, num_heads=H, head_dim=K)
    np.testing.assert_array_equal(o_ref, apply_output_norm(plain, **norm))
    jaxpr = jax.make_jaxpr(functools.partial(pallas_ops.packed_decode_kda, num_heads=H, head_dim=K, interpret=True,
                                             block_v=block_v, **norm))(*x.values(), slots)
    assert len([e for e in _all_eqns(jaxpr.jaxpr) if e.primitive.name == "pallas_call"]) == 1
    o, pool = pallas_ops.packed_decode_kda(**x, slot_indices=slots, num_heads=H, head_dim=K, interpret=True,
                                           block_v=block_v, **norm)
    assert o.dtype == o_ref.dtype == dtype
    assert_close(o, o_ref)
    assert_close(pool, pool_ref)
    assert np.all(np.asarray(o, np.float32)[[1, 4]] == 0.0), "padding rows must output zeros"
    with pytest.raises(ValueError, match="out_norm_eps needs out_gate"):
        pallas_ops.packed_decode_kda(**x, slot_indices=slots, num_heads=H, head_dim=K, interpret=True,
                                     out_norm_eps=1e-6)


@pytest.mark.parametrize("block_v", [16, 32])
def test_packed_decode_leaves_the_norm_counters_zeroed(block_v):
    """norm_counts (the KDA decode cache's): given, the output-normed decode returns them as a third result, zero
    again, beside the same o and pool, so that steps can chain them: three steps through the returned counters
    equal three with fresh zeros (a head split over value blocks (16) counts on them; without the kernel's reset
    the second step's heads would never see their last count and stay unnormed). Whole heads (32) and the
    dispatcher's paths without the kernel's count pass them through; a wrong shape names what is expected."""
    H, K, V, S = 2, 32, 32, 4
    rng = np.random.default_rng(22)
    x = _decode_inputs(rng, 3, H, K, V, S)
    slots = jnp.asarray([2, -1, 0], jnp.int32)
    norm = dict(out_gate=jnp.asarray(rng.standard_normal((3, H * V)), jnp.float32),
                out_norm_scale=jnp.ones((V,), jnp.float32), out_norm_eps=1e-6)
    step = jax.jit(functools.partial(pallas_ops.packed_decode_kda, num_heads=H, head_dim=K, interpret=True,
                                     block_v=block_v, **norm))
    inputs = {name: value for name, value in x.items() if name != "state_pool"}
    want_pool = got_pool = x["state_pool"]
    counts = jnp.zeros((3, H), jnp.int32)
    for _ in range(3):
        want_o, want_pool = step(**inputs, state_pool=want_pool, slot_indices=slots)
        got_o, got_pool, counts = step(**inputs, state_pool=got_pool, slot_indices=slots, norm_counts=counts)
        np.testing.assert_array_equal(np.asarray(counts), np.zeros((3, H), np.int32))
        np.testing.assert_array_equal(np.asarray(got_o), np.asarray(want_o))
        np.testing.assert_array_equal(np.asarray(got_pool), np.asarray(want_pool))
    sentinel = jnp.full((3, H), 7, jnp.int32)  # passed on untouched where nothing counts
    passed_on = kda_kernels.packed_decode_kda(**x, slot_indices=slots, num_heads=H, head_dim=K,
                                              implementation="naive", norm_counts=sentinel, **norm)[2]
    assert np.all(np.asarray(passed_on) == 7)
    with pytest.raises(ValueError, match=r"norm_counts must be int32 \[3, 2\] \(rows, heads\)"):
        step(**x, slot_indices=slots, norm_counts=jnp.zeros((3,), jnp.int32))


def test_packed_decode_and_verify_dispatch_to_plain_jax_off_gpu():
    H, K, V, S = 2, 32, 32, 2
    x = _decode_inputs(np.random.default_rng(8), 2, H, K, V, S)
    slots = jnp.asarray([1, 0], jnp.int32)
    got = kda_kernels.packed_decode_kda(**x, slot_indices=slots, num_heads=H, head_dim=K, implementation="auto")
    want = packed_decode_kda_reference(**x, slot_indices=slots, num_heads=H, head_dim=K)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    v = random_kda_inputs(np.random.default_rng(9), 1, 2, H, K, V)
    got = kda_kernels.recurrent_kda_checkpoints(**v, implementation="chunked")
    for a, b in zip(got, recurrent_kda_checkpoints(**v)):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(RuntimeError, match="kda_kernel=pallas was requested for decode"):
        kda_kernels.recurrent_kda_checkpoints(**v, implementation="pallas")


def sharded_serving_kernels_report() -> dict:
    """Run in a 4-device subprocess: the packed decode and verify Pallas kernels (interpreted) under `partitioned`
    on a data=2 x tensor=2 mesh vs their unsharded plain-JAX versions (and the dispatcher's packed decode with the
    output norm, which XLA applies after the sharded kernel there). Returns max abs differences."""
    import functools
    import types

    import flax.linen as nn
    import jax

    from MaxText.kernels.kda.packed_decode import shard_map_packed_decode
    from MaxText.kernels.kda.verify import shard_map_verify

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "tensor"))
    rules = (("batch", "data"), ("cache_batch", "data"), ("kda_heads", "tensor"))
    H, K, V, B = 2, 32, 32, 4
    x = _decode_inputs(np.random.default_rng(11), B, H, K, V, B)
    slots = jnp.asarray([1, -1, 3, 2], jnp.int32)  # each row's slot in its own row shard; a padding row
    o_ref, pool_ref = packed_decode_kda_reference(**x, slot_indices=slots, num_heads=H, head_dim=K)
    norm = dict(out_gate=jnp.asarray(np.random.default_rng(14).standard_normal((B, H * V)), jnp.float32),
                out_norm_scale=jnp.full((V,), 0.5, jnp.float32), out_norm_eps=1e-6)
    o_normed_ref, _ = packed_decode_kda_reference(**x, slot_indices=slots, num_heads=H, head_dim=K, **norm)
    v = random_kda_inputs(np.random.default_rng(12), B, 3, H, K, V, raw_gate=True)
    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True)
    o_v_ref, ckpt_ref = recurrent_kda_checkpoints(**v, **kw)
    r = _ring_inputs(np.random.default_rng(13), B, 3, 5, H, K, V)
    o_r_ref, ring_ref = recurrent_kda_ring_checkpoints(**r, **kw)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        decode = kda_kernels.partitioned(functools.partial(pallas_ops.packed_decode_kda, interpret=True),
                                         shard_map_packed_decode, rows="cache_batch")
        o, pool = jax.jit(lambda x, s: decode(**x, slot_indices=s, num_heads=H, head_dim=K))(x, slots)
        kda_kernels.pallas_unavailable_reason = lambda *args: None  # (a subprocess of its own: no restore needed)
        kda_kernels.load_pallas = lambda: types.SimpleNamespace(
            packed_decode_kda=functools.partial(pallas_ops.packed_decode_kda, interpret=True))
        o_normed, _ = jax.jit(lambda x, s, n: kda_kernels.packed_decode_kda(
            **x, slot_indices=s, num_heads=H, head_dim=K, implementation="pallas", **n, out_norm_eps=1e-6))(
                x, slots, {k: norm[k] for k in ("out_gate", "out_norm_scale")})
        verify = kda_kernels.partitioned(functools.partial(pallas_ops.recurrent_kda_checkpoints, interpret=True),
                                         shard_map_verify)
        o_v, ckpt = jax.jit(lambda v: verify(**v, **kw))(v)
        ring_verify = kda_kernels.partitioned(functools.partial(pallas_ops.recurrent_kda_ring_checkpoints,
                                                                interpret=True), shard_map_verify, rows="cache_batch")
        o_r, ring = jax.jit(lambda r: ring_verify(**r, **kw))(r)
    diff = lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max())  # noqa: E731
    return {"decode_o": diff(o, o_ref), "decode_pool": diff(pool, pool_ref),
            "decode_normed_o": diff(o_normed, o_normed_ref), "verify_o": diff(o_v, o_v_ref),
            "verify_checkpoints": diff(ckpt, ckpt_ref), "ring_verify_o": diff(o_r, o_r_ref),
            "ring_verify_ring": diff(ring, ring_ref), "pool_spec": list(pool.sharding.spec),
            "ring_spec": list(ring.sharding.spec)}


def test_packed_decode_and_verify_under_shard_map():
    import json
    import os
    import subprocess
    import sys
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    code = "import json; from tests.test_pallas_kda import sharded_serving_kernels_report as r; print(json.dumps(r()))"
    result = subprocess.run([sys.executable, "-c", code], cwd=repo, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report.pop("pool_spec") == ["data", "tensor"], report  # the pool stays where the cache lies
    assert report.pop("ring_spec") == ["data", None, "tensor"], report  # so does the verify's state ring
    assert max(report.values()) <= 1e-5, report
