"""MLA decode kernels (MaxText/kernels/mla): the Pallas latent attention (interpret mode) against the plain-JAX
oracle, its limits, the dispatcher, and the MLA layer wired to it."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText import pyconfig
from MaxText.kernels import grouped_matmul, mla as mla_kernels
from MaxText.kernels.mla import naive, pallas_absorb, pallas_decode


def _problem(batch, tokens, heads, rank, rope, num_keys, dtype, seed=0):
    """Random queries and cache, some cache positions invalid (left padding, holes), and the last tokens' positions."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    q_latent = jax.random.normal(ks[0], (batch, tokens, heads, rank), dtype)
    q_rope = jax.random.normal(ks[1], (batch, tokens, heads, rope), dtype)
    keys = jax.random.normal(ks[2], (batch, num_keys, rank + rope), dtype)
    key_valid = jax.random.bernoulli(ks[3], 0.8, (batch, num_keys)).at[:, :3].set(False)
    last = jnp.array([num_keys - 1 - 7 * b for b in range(batch)], jnp.int32)  # rows at different positions
    query_positions = last[:, None] - jnp.arange(tokens - 1, -1, -1, dtype=jnp.int32)[None, :]  # [B, T]
    return q_latent, q_rope, keys, query_positions, key_valid


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize("batch,tokens,heads,num_keys,block_s,runs", [
    (2, 1, 16, 150, 32, None),  # S not a multiple of the block: the last block read from S - block_s
    (1, 1, 32, 64, 16, 1),      # one run over every block
    (3, 3, 2, 100, 16, 3),      # verify-sized T, rows padded from 6 to 16
    (2, 1, 4, 20, None, 2),     # a cache shorter than 32: block of 16
])
def test_pallas_latent_attention_matches_the_oracle(dtype, tol, batch, tokens, heads, num_keys, block_s, runs):
    args = _problem(batch, tokens, heads, 32, 16, num_keys, dtype)
    want = naive.latent_attention(*args, scale=0.2, precision=jax.lax.Precision.HIGHEST)
    got = pallas_decode.latent_attention(*args, scale=0.2, block_s=block_s, runs=runs, interpret=True)
    assert got.shape == want.shape and got.dtype == dtype
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.abs(got - want).max() <= tol * np.abs(want).max(), np.abs(got - want).max()


def test_pallas_latent_attention_rows_split_over_programs():
    """block_h: the query rows in groups of 16 over programs (each run's blocks read by every group) give the same
    result as all rows in one program; 24 rows padded to 32, two groups."""
    args = _problem(2, 3, 8, 32, 16, 150, jnp.float32)
    whole = pallas_decode.latent_attention(*args, scale=0.2, block_s=16, runs=3, interpret=True)
    split = pallas_decode.latent_attention(*args, scale=0.2, block_s=16, runs=3, block_h=16, interpret=True)
    np.testing.assert_array_equal(np.asarray(split), np.asarray(whole))
    jaxpr = str(jax.make_jaxpr(functools.partial(pallas_decode.latent_attention, scale=0.2, block_s=16, runs=3,
                                                 block_h=16, interpret=True))(*args))
    assert "grid=(2, 2, 3)" in jaxpr  # (row groups, batch rows, runs)
    with pytest.raises(ValueError, match="block_h=8 must be a power of two >= 16"):
        pallas_decode.latent_attention(*args, scale=0.2, block_h=8, interpret=True)


def test_default_rows_per_program_split_one_token_of_one_batch_row():
    """default_block_h: 16 rows per program for one batch row of <= 32 query rows (batch-1 decode of the 48B model's
    32 heads: two programs per run), else every row of a batch row in one program; the split default gives the
    whole-rows result bit for bit."""
    assert pallas_decode.default_block_h(1, 32) == 16 and pallas_decode.default_block_h(1, 8) == 16
    assert pallas_decode.default_block_h(2, 32) == 32 and pallas_decode.default_block_h(1, 96) == 128
    args = _problem(1, 1, 32, 32, 16, 150, jnp.float32)
    run = functools.partial(pallas_decode.latent_attention, scale=0.2, block_s=16, runs=3, interpret=True)
    assert "grid=(2, 1, 3)" in str(jax.make_jaxpr(run)(*args))  # (row groups, batch rows, runs)
    np.testing.assert_array_equal(np.asarray(run(*args)), np.asarray(run(*args, block_h=32)))
    args = _problem(2, 1, 32, 32, 16, 150, jnp.float32)
    assert "grid=(1, 2, 3)" in str(jax.make_jaxpr(run)(*args))


def test_pallas_latent_attention_edge_rows():
    """A row that sees no key gets zeros (as the oracle's softmax); a run past the query's position reads nothing."""
    q_latent, q_rope, keys, _, key_valid = _problem(2, 1, 16, 32, 16, 96, jnp.float32)
    key_valid = key_valid.at[0].set(False)  # row 0: no valid key at all
    query_positions = jnp.array([[50], [20]], jnp.int32)  # row 1: runs of blocks past position 20 never read
    args = (q_latent, q_rope, keys, query_positions, key_valid)
    got = pallas_decode.latent_attention(*args, scale=0.2, block_s=16, runs=6, interpret=True)
    want = naive.latent_attention(*args, scale=0.2, precision=jax.lax.Precision.HIGHEST)
    assert not np.asarray(got[0]).any()
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6)
    # NaN keys past the query's position change nothing: those blocks are skipped, not read and masked.
    poisoned = keys.at[1, 32:].set(jnp.nan)
    again = pallas_decode.latent_attention(q_latent, q_rope, poisoned, query_positions, key_valid, scale=0.2,
                                           block_s=16, runs=6, interpret=True)
    np.testing.assert_array_equal(np.asarray(again[1]), np.asarray(got[1]))


def test_pallas_latent_attention_limits():
    assert pallas_decode.unsupported_reason(jnp.bfloat16, 512, 64, 4213) is None
    assert "kv_lora_rank to be a power of two >= 16, got 96" in pallas_decode.unsupported_reason(jnp.bfloat16, 96,
                                                                                                   64, 4096)
    assert "qk_rope_head_dim to be a power of two >= 16, got 8" in pallas_decode.unsupported_reason(jnp.bfloat16,
                                                                                                      32, 8, 4096)
    assert "at least 16 positions, got 12" in pallas_decode.unsupported_reason(jnp.float32, 32, 16, 12)
    assert "float16" in pallas_decode.unsupported_reason(jnp.float16, 32, 16, 64)
    assert pallas_decode.default_block(4213) == 32 and pallas_decode.default_block(20) == 16
    assert pallas_decode.default_runs(1, 132) == 66 and pallas_decode.default_runs(64, 132) == 4
    args = _problem(1, 1, 2, 32, 16, 64, jnp.float32)
    with pytest.raises(ValueError, match="block_s=48 must be a power of two"):
        pallas_decode.latent_attention(*args, scale=1.0, block_s=48, interpret=True)
    with pytest.raises(ValueError, match=r"expected query_positions \[B, T\]"):
        pallas_decode.latent_attention(*args[:3], args[3][:, :0], args[4], scale=1.0, interpret=True)


def test_dispatcher_choices_and_errors(monkeypatch):
    shapes = (jnp.bfloat16, 512, 64, 4213)
    assert mla_kernels.resolve("auto", *shapes) == "xla"  # CPU
    assert mla_kernels.resolve("xla", *shapes) == "xla"
    with pytest.raises(RuntimeError, match="mla_kernel=pallas was requested, but .*NVIDIA GPU"):
        mla_kernels.resolve("pallas", *shapes)
    with pytest.raises(ValueError, match="mla_kernel='flash' is unknown"):
        mla_kernels.resolve("flash", *shapes)
    monkeypatch.setattr(grouped_matmul, "single_gpu_reason", lambda kernel: None)  # as on one GPU
    assert mla_kernels.resolve("auto", *shapes) == "pallas"
    assert mla_kernels.resolve("auto", jnp.bfloat16, 512, 8, 4213) == "xla"  # rope 8: the oracle
    with pytest.raises(RuntimeError, match="qk_rope_head_dim to be a power of two"):
        mla_kernels.resolve("pallas", jnp.bfloat16, 512, 8, 4213)


def test_mla_layer_decodes_through_the_pallas_kernel(monkeypatch):
    """The MLA layer with mla_kernel=pallas (the kernel run by the interpreter, as if on one GPU) decodes what the
    XLA path decodes, for a prefill then single-token steps and a 3-token verify."""
    from MaxText.layers.mla import MultiHeadLatentAttention
    overrides = ["emb_dim=64", "num_query_heads=4", "kv_lora_rank=32", "qk_nope_head_dim=16", "qk_rope_head_dim=16",
                 "v_head_dim=16", "max_target_length=40", "dtype=float32", "weight_dtype=float32"]
    configs = {kernel: pyconfig.load_config(pyconfig.BASE_CONFIG_PATH, overrides + [f"mla_kernel={kernel}"])
               for kernel in ("xla", "pallas")}
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 12, 64)), jnp.float32)
    segments = jnp.ones((2, 8), jnp.int32).at[1, :3].set(0)  # row 1 left-padded
    layer = MultiHeadLatentAttention(configs["xla"])
    params = layer.init(jax.random.PRNGKey(0), x[:, :8], model_mode="train")["params"]
    calls, kernel, absorbed, absorb = [], pallas_decode.latent_attention, [], pallas_absorb.absorb_query

    def interpreted(*args, **kwargs):
        calls.append(args[0].shape)
        return kernel(*args, interpret=True, **kwargs)

    def interpreted_absorb(*args, **kwargs):
        absorbed.append(args[0].shape)
        return absorb(*args, interpret=True, **kwargs)
    monkeypatch.setattr(grouped_matmul, "single_gpu_reason", lambda kernel: None)
    monkeypatch.setattr(pallas_decode, "latent_attention", interpreted)
    monkeypatch.setattr(pallas_absorb, "absorb_query", interpreted_absorb)
    monkeypatch.setattr(mla_kernels, "ABSORB_MAX_ROWS", 6)  # (default 1) the kernel for these 2 and 6 token rows

    def decode(config):
        mla = MultiHeadLatentAttention(config)
        _, cache = mla.apply({"params": params}, x[:, :8], model_mode="prefill", decoder_segment_ids=segments,
                             mutable=["cache"])
        outs = []
        for t in range(8, 11):
            out, cache = mla.apply({"params": params, **cache}, x[:, t:t + 1], model_mode="autoregressive",
                                   mutable=["cache"])
            outs.append(out)
        verified, _ = mla.apply({"params": params, **cache}, x[:, 9:12], model_mode="verify", mutable=["cache"])
        return jnp.concatenate(outs + [verified], axis=1)

    want = decode(configs["xla"])
    assert calls == [] and absorbed == []
    got = decode(configs["pallas"])
    assert calls == [(2, 1, 4, 32)] * 3 + [(2, 3, 4, 32)]
    assert absorbed == [(2, 4 * 32)] * 3 + [(6, 4 * 32)]  # q [B * T, H * (nope + rope)], the absorption in its kernel
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    # Kernels stored in_out: the einsum absorbs (the kernel reads kv_b_proj's W_uk rows as stored out_in).
    in_out = pyconfig.load_config(pyconfig.BASE_CONFIG_PATH,
                                  overrides + ["mla_kernel=pallas", "dense_kernel_layout=in_out"])
    absorbed.clear()
    layer = MultiHeadLatentAttention(in_out)
    variables = layer.init(jax.random.PRNGKey(0), x[:, :8], model_mode="prefill")  # params and an empty cache
    layer.apply(variables, x[:, 8:9], model_mode="autoregressive", mutable=["cache"])
    assert absorbed == [] and len(calls) == 5  # the latent attention in its kernel, the absorption by XLA


def _absorb_problem(rows, heads, nope, rope, v_dim, rank, dtype, seed=0):
    """q [M, H * (nope + rope)], kv_b_proj as stored [H * (nope + v), R], a row scale [M, 1] (float32)."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(ks[0], (rows, heads * (nope + rope)), dtype)
    kv_b = jax.random.normal(ks[1], (heads * (nope + v_dim), rank), dtype)
    return q, kv_b, jax.random.uniform(ks[2], (rows, 1), jnp.float32, 0.5, 2.0)


def _absorb_reference(q, kv_b, row_scale, heads, nope, v_dim):
    """The layer's XLA path: scale_rows, then q_nope times each head's W_uk rows (float32, HIGHEST)."""
    rows = q.shape[0]
    q = (q.astype(jnp.float32) * row_scale).astype(q.dtype) if row_scale is not None else q
    q = q.reshape(rows, heads, -1).astype(jnp.float32)
    w_uk = kv_b.reshape(heads, nope + v_dim, -1)[:, :nope].astype(jnp.float32)  # [H, nope, R]
    latent = jnp.einsum("mhn,hnr->mhr", q[..., :nope], w_uk, precision=jax.lax.Precision.HIGHEST)
    return latent, q[..., nope:]


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 1e-2)])
@pytest.mark.parametrize("scaled", [True, False])
@pytest.mark.parametrize("block_r", [16, 64])
def test_absorbed_query_kernel_matches_the_einsum(dtype, tol, scaled, block_r):
    """pallas_absorb.absorb_query: q_nope times W_uk read from kv_b_proj's stored rows, q_rope passed through, both
    after the row scale (rounded to q's dtype first, as scale_rows); block_r = R is one program per head."""
    q, kv_b, row_scale = _absorb_problem(3, 4, 16, 8, 32, 64, dtype)
    row_scale = row_scale if scaled else None
    latent, q_rope = pallas_absorb.absorb_query(q, kv_b, row_scale, num_heads=4, nope=16, v_dim=32,
                                                block_r=block_r, interpret=True)
    want_latent, want_rope = _absorb_reference(q, kv_b, row_scale, 4, 16, 32)
    assert latent.shape == (3, 4, 64) and q_rope.shape == (3, 4, 8) and latent.dtype == q_rope.dtype == dtype
    np.testing.assert_array_equal(np.asarray(q_rope, np.float32), np.asarray(want_rope))
    got, want = np.asarray(latent, np.float32), np.asarray(want_latent)
    assert np.abs(got - want).max() <= tol * np.abs(want).max(), np.abs(got - want).max()


def test_absorbed_query_limits():
    assert pallas_absorb.unsupported_reason(128, 64, 512) is None
    assert "qk_nope_head_dim to be a power of two, got 96" in pallas_absorb.unsupported_reason(96, 64, 512)
    assert "kv_lora_rank to be a power of two, got 96" in pallas_absorb.unsupported_reason(128, 64, 96)
    q, kv_b, row_scale = _absorb_problem(2, 4, 16, 8, 32, 64, jnp.float32)
    with pytest.raises(ValueError, match="block_r=48 must be a power of two"):
        pallas_absorb.absorb_query(q, kv_b, None, num_heads=4, nope=16, v_dim=32, block_r=48, interpret=True)
    with pytest.raises(ValueError, match=r"expected q \[M, H \* \(nope \+ rope\)\] and kv_b"):
        pallas_absorb.absorb_query(q, kv_b[:-1], None, num_heads=4, nope=16, v_dim=32, interpret=True)
    with pytest.raises(ValueError, match=r"expected row_scale \[M, 1\] = \(2, 1\), got \(1, 1\)"):
        pallas_absorb.absorb_query(q, kv_b, row_scale[:1], num_heads=4, nope=16, v_dim=32, interpret=True)
    assert mla_kernels.absorb_in_kernel("pallas", "out_in", 128, 64, 512, 1)
    assert not mla_kernels.absorb_in_kernel("pallas", "out_in", 128, 64, 512, 2)  # batch 2: XLA's einsum
    assert not mla_kernels.absorb_in_kernel("xla", "out_in", 128, 64, 512, 1)
    assert not mla_kernels.absorb_in_kernel("pallas", "in_out", 128, 64, 512, 1)
    assert not mla_kernels.absorb_in_kernel("pallas", "out_in", 96, 64, 512, 1)


def test_combine_reads_only_the_written_runs():
    """The state arrays' run axis is a power of two (Triton's block shapes): runs past `runs` are never written, and
    the combine masks them (NaN there changes nothing); the result is the softmax over all runs' keys."""
    rng = np.random.default_rng(1)
    run_max = jnp.asarray(rng.normal(size=(2, 4, 16)), jnp.float32).at[:, 3].set(jnp.nan)
    run_max = run_max.at[1, 1].set(-jnp.inf)  # a run that saw nothing
    run_sum = jnp.asarray(rng.uniform(1, 2, size=(2, 4, 16)), jnp.float32).at[:, 3].set(jnp.nan).at[1, 1].set(0.0)
    run_acc = jnp.asarray(rng.normal(size=(2, 4, 16, 256)), jnp.float32).at[:, 3].set(jnp.nan).at[1, 1].set(0.0)
    got = pallas_decode.combine_runs(run_max, run_sum, run_acc, 3, jnp.float32, interpret=True)
    weight = jnp.exp(run_max[:, :3] - jnp.max(run_max[:, :3], axis=1, keepdims=True))
    want = jnp.sum(weight[..., None] * run_acc[:, :3], axis=1) / jnp.sum(weight * run_sum[:, :3], axis=1)[..., None]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
