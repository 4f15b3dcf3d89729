"""The KDA Linen block vs HF transformers' KimiLinearDeltaAttention, and its cache invariants."""

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import KimiLinearConfig
from transformers.cache_utils import DynamicCache
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention

from MaxText import hf_weights, pyconfig
from MaxText.kernels import kda as kda_kernels
from MaxText.layers import kda
from MaxText.layers.kda import KimiDeltaAttention

HIDDEN, HEADS, HEAD_DIM = 64, 2, 32
TOL = 1e-5


def our_config(**overrides):
    return pyconfig.load_config(f"{pyconfig.CONFIGS_DIR}/kimi_linear_tiny.yml", {
        "emb_dim": HIDDEN, "kda_num_heads": HEADS, "kda_head_dim": HEAD_DIM, **overrides})


@functools.lru_cache(maxsize=None)
def hf_layer(seed=0):
    """A standalone HF KDA layer initialized like a KimiLinear checkpoint (HF `_init_weights`: linears N(0, 0.02),
    A_log = log U(1, 16)), with non-trivial o_norm weights and dt_bias (perturbed away from their init)."""
    config = KimiLinearConfig(
        hidden_size=HIDDEN, num_hidden_layers=1, vocab_size=300, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        linear_attn_config={"num_heads": HEADS, "head_dim": HEAD_DIM, "short_conv_kernel_size": 4,
                            "kda_layers": [1], "full_attn_layers": []})
    torch.manual_seed(seed)
    layer = KimiLinearDeltaAttention(config, 0).float().eval()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.empty_like(p).uniform_(1.0, 16.0)))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn_like(p))
            elif name == "o_norm.weight":
                p.copy_(1.0 + 0.5 * torch.randn_like(p))
            elif name != "conv1d.weight":  # the conv keeps torch's U(-1/2, 1/2) init
                p.copy_(torch.randn_like(p) * config.initializer_range)
    return config, layer


def our_params(layer, config):
    state = {name: t.detach().numpy() for name, t in layer.state_dict().items()}
    params = hf_weights.kda_layer_params(state, "", config)
    return jax.tree.map(lambda a: jnp.asarray(a, jnp.dtype(config.weight_dtype)), params)


def hf_forward(layer, hf_config, chunks):
    """Runs HF over consecutive chunks sharing one cache (no cache for a single chunk); returns the last output."""
    cache = DynamicCache(config=hf_config) if len(chunks) > 1 else None
    with torch.no_grad():
        for chunk in chunks:
            out = layer(torch.tensor(chunk), cache_params=cache)
    return out.numpy()


@functools.lru_cache(maxsize=None)
def jitted_apply(model, mode):
    return jax.jit(functools.partial(model.apply, model_mode=mode, mutable=["cache"]))


def apply_chunks(config, params, chunks, modes):
    """Runs our layer over consecutive chunks sharing one cache; returns (outputs per chunk, final cache)."""
    model = KimiDeltaAttention(config)
    cache = model.init(jax.random.key(0), jnp.asarray(chunks[0]), model_mode="prefill")["cache"]
    outputs = []
    for chunk, mode in zip(chunks, modes):
        out, mutated = jitted_apply(model, mode)({"params": params, "cache": cache},
                                                 jnp.asarray(chunk, jnp.dtype(config.dtype)))
        cache = mutated["cache"]
        outputs.append(np.asarray(out, np.float32))
    return outputs, cache


def assert_same_cache(cache, expected):
    """Same conv window and committed recurrent state (whatever the rings' slot counts)."""
    np.testing.assert_allclose(cache["conv_state"], expected["conv_state"], atol=TOL, rtol=TOL)
    np.testing.assert_allclose(kda.committed_state(cache), kda.committed_state(expected), atol=TOL, rtol=TOL)


def random_x(seq_len, batch=2, seed=0):
    return np.random.default_rng(seed).standard_normal((batch, seq_len, HIDDEN)).astype(np.float32)


@pytest.mark.parametrize("seq_len", [1, 8, 64, 65, 128, 256, 1024])
@pytest.mark.parametrize("with_initial_state", [False, True])
def test_matches_hf(seq_len, with_initial_state):
    hf_config, layer = hf_layer()
    config = our_config()
    x = random_x(seq_len, seed=seq_len)
    chunks = [random_x(13, seed=99), x] if with_initial_state else [x]
    expected = hf_forward(layer, hf_config, chunks)
    outputs, _ = apply_chunks(config, our_params(layer, config), chunks, ["prefill"] * len(chunks))
    np.testing.assert_allclose(outputs[-1], expected, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("decode_steps", [1, 8, 16])
def test_prefill_then_decode_equals_prefill(decode_steps):
    hf_config, layer = hf_layer()
    config = our_config()
    params = our_params(layer, config)
    x = random_x(40)
    (full,), full_cache = apply_chunks(config, params, [x], ["prefill"])
    split = 40 - decode_steps
    chunks = [x[:, :split]] + [x[:, t:t + 1] for t in range(split, 40)]
    outputs, cache = apply_chunks(config, params, chunks, ["prefill"] + ["autoregressive"] * decode_steps)
    np.testing.assert_allclose(np.concatenate(outputs[1:], axis=1), full[:, split:], atol=TOL, rtol=TOL)
    assert_same_cache(cache, full_cache)


def test_two_prefill_chunks_equal_one_prefill():
    _, layer = hf_layer()
    config = our_config()
    params = our_params(layer, config)
    x = random_x(100)
    (full,), full_cache = apply_chunks(config, params, [x], ["prefill"])
    outputs, cache = apply_chunks(config, params, [x[:, :37], x[:, 37:]], ["prefill", "prefill"])
    np.testing.assert_allclose(np.concatenate(outputs, axis=1), full, atol=TOL, rtol=TOL)
    assert_same_cache(cache, full_cache)


def test_rows_are_independent_and_left_padding_is_inert():
    """A left-padded row (segment id 0 on the padding) gives the same outputs and state as the row alone."""
    _, layer = hf_layer()
    config = our_config()
    params = our_params(layer, config)
    model = KimiDeltaAttention(config)
    x = random_x(30)
    pad = 7
    x_padded = x.copy()
    x_padded[1, :pad] = 100.0  # garbage at the padding positions must not leak
    x_padded[1, pad:] = x[1, :30 - pad]
    segments = np.ones((2, 30), np.int32)
    segments[1, :pad] = 0
    cache = model.init(jax.random.key(0), jnp.asarray(x), model_mode="prefill")["cache"]
    out, mutated = model.apply({"params": params, "cache": cache}, jnp.asarray(x_padded), model_mode="prefill",
                               decoder_segment_ids=jnp.asarray(segments), mutable=["cache"])
    (alone,), alone_cache = apply_chunks(config, params, [x[1:, :30 - pad]], ["prefill"])
    np.testing.assert_allclose(np.asarray(out)[1, pad:], alone[0], atol=TOL, rtol=TOL)
    np.testing.assert_allclose(kda.committed_state(mutated["cache"])[1], kda.committed_state(alone_cache)[0],
                               atol=TOL, rtol=TOL)
    (row0,), _ = apply_chunks(config, params, [x[:1]], ["prefill"])
    np.testing.assert_allclose(np.asarray(out)[0], row0[0], atol=TOL, rtol=TOL)


def test_naive_and_chunked_kernels_agree_in_the_layer():
    _, layer = hf_layer()
    x = random_x(70)
    results = []
    for kernel in ("naive", "chunked"):
        config = our_config(kda_kernel=kernel)
        (out,), cache = apply_chunks(config, our_params(layer, config), [x], ["prefill"])
        results.append((out, kda.committed_state(cache)))
    np.testing.assert_allclose(results[0][0], results[1][0], atol=TOL, rtol=TOL)
    np.testing.assert_allclose(results[0][1], results[1][1], atol=TOL, rtol=TOL)


# bf16 params and activations (fp32 state) vs the fp32 HF output. Each bf16 rounding is <= 2^-9 relative; the
# output passes ~6 roundings in series (input, 3 projections + conv, gate projections, o_norm cast, o_proj), with
# errors partly cancelling over the D=64 / H*K=64 reductions. Measured here: 7.5e-3 max relative error (max abs
# error over max |HF output|) at T=256; we assert 3e-2, about 8 x 2^-8: room for other seeds and shapes, while a
# broken bf16 path (bf16 recurrent state or gate, a mis-cast norm) lands well above it.
BF16_BOUND = 3e-2


def test_bf16_run_against_fp32_hf():
    hf_config, layer = hf_layer()
    config = our_config(dtype="bfloat16", weight_dtype="bfloat16")
    x = random_x(256, seed=5)
    expected = hf_forward(layer, hf_config, [x])
    (out,), cache = apply_chunks(config, our_params(layer, config), [x], ["prefill"])
    assert kda.committed_state(cache).dtype == jnp.float32
    rel = float(np.abs(out - expected).max() / np.abs(expected).max())
    print(f"bf16 KDA layer vs fp32 HF: max relative error {rel:.3e} (bound {BF16_BOUND})")
    assert rel <= BF16_BOUND


def test_packed_training_row_equals_documents_alone():
    """model_mode=train with segment ids: each packed document's output equals the document run alone."""
    _, layer = hf_layer()
    config = our_config()
    params = our_params(layer, config)
    model = KimiDeltaAttention(config)
    lengths = [9, 30, 1, 24]
    x = random_x(sum(lengths), batch=1, seed=3)
    segment_ids = np.repeat(np.arange(1, len(lengths) + 1), lengths)[None].astype(np.int32)
    packed = model.apply({"params": params}, jnp.asarray(x), model_mode="train",
                         decoder_segment_ids=jnp.asarray(segment_ids))
    start = 0
    for length in lengths:
        alone = model.apply({"params": params}, jnp.asarray(x[:, start:start + length]), model_mode="train")
        np.testing.assert_allclose(np.asarray(packed)[:, start:start + length], alone, atol=TOL, rtol=TOL)
        start += length


@pytest.fixture
def interpreted_pallas(monkeypatch):
    """kda_kernel=pallas resolves on CPU and runs the Pallas kernels in the interpreter (interpret=True). Returns a
    Counter of the kernel entry points called (once per trace under jit)."""
    import collections

    from MaxText.kernels.kda import pallas_ops

    calls = collections.Counter()

    def interpreted(name):
        def run(*args, **kwargs):
            calls[name] += 1
            return getattr(pallas_ops, name)(*args, interpret=True, **kwargs)
        return run

    names = ("chunk_kda", "fused_recurrent_kda", "packed_decode_kda", "recurrent_kda_checkpoints",
             "recurrent_kda_ring_checkpoints", "project_and_decode_kda")
    monkeypatch.setattr(kda_kernels, "pallas_unavailable_reason", lambda *args: None)
    monkeypatch.setattr(kda_kernels, "load_pallas", lambda: types.SimpleNamespace(**{n: interpreted(n) for n in names}))
    return calls


def _prefill_cache(config, params, x, state_slots=1):
    """The layer's cache after a prefill of x, created with `state_slots` ring slots per row."""
    model = KimiDeltaAttention(config)
    cache = kda.zero_cache(model.init(jax.random.key(0), jnp.asarray(x), model_mode="prefill")["cache"], state_slots)
    return model.apply({"params": params, "cache": cache}, jnp.asarray(x), model_mode="prefill", mutable=["cache"])[1][
        "cache"]


def test_autoregressive_pallas_runs_the_packed_decode_kernel(interpreted_pallas):
    """kda_kernel=pallas: prefill, then 8 one-token steps on the packed in-place kernel (cache donated) == naive."""
    _, layer = hf_layer()
    x = random_x(20, seed=7)
    steps = []
    for kernel in ("naive", "pallas"):
        config = our_config(kda_kernel=kernel)
        params = our_params(layer, config)
        model = KimiDeltaAttention(config)
        cache = _prefill_cache(our_config(kda_kernel="naive"), params, x[:, :12])
        step = jax.jit(lambda cache, token, model=model, params=params: model.apply(
            {"params": params, "cache": cache}, token, model_mode="autoregressive", mutable=["cache"]),
            donate_argnums=0)
        outputs = []
        for t in range(12, 20):
            out, mutated = step(cache, jnp.asarray(x[:, t:t + 1]))
            cache = mutated["cache"]
            outputs.append(np.asarray(out))
        steps.append((np.concatenate(outputs, axis=1), jax.tree.map(np.asarray, cache)))
    assert interpreted_pallas["packed_decode_kda"] >= 1 and interpreted_pallas["fused_recurrent_kda"] == 0
    (want, want_cache), (got, got_cache) = steps
    np.testing.assert_allclose(got, want, atol=TOL, rtol=TOL)
    assert_same_cache(got_cache, want_cache)


@pytest.mark.parametrize("out_norm", [True, False])
def test_decode_out_norm_runs_in_the_packed_decode_kernel(interpreted_pallas, monkeypatch, out_norm):
    """kda_decode_out_norm (default true): the packed decode kernel gets the output gate and o_norm's scale and applies
    the norm (GatedRMSNorm's call does not run); with false GatedRMSNorm runs after it. 8 steps equal
    kda_kernel=naive's with the same params either way."""
    _, layer = hf_layer()
    x = random_x(20, seed=7)
    params = our_params(layer, our_config())
    prefilled = _prefill_cache(our_config(kda_kernel="naive"), params, x[:, :12])

    def decode_steps(config):
        model = KimiDeltaAttention(config)
        cache = prefilled
        step = jax.jit(lambda cache, token: model.apply({"params": params, "cache": cache}, token,
                                                        model_mode="autoregressive", mutable=["cache"]))
        outputs = []
        for t in range(12, 20):
            out, mutated = step(cache, jnp.asarray(x[:, t:t + 1]))
            cache = mutated["cache"]
            outputs.append(np.asarray(out))
        return np.concatenate(outputs, axis=1), jax.tree.map(np.asarray, cache)

    want, want_cache = decode_steps(our_config(kda_kernel="naive"))
    pallas = kda_kernels.load_pallas()  # the fixture's interpreted kernels
    norm_eps = []

    def packed_decode_kda(*args, **kwargs):
        norm_eps.append(kwargs.get("out_norm_eps"))
        return pallas.packed_decode_kda(*args, **kwargs)
    monkeypatch.setattr(kda_kernels, "load_pallas", lambda: types.SimpleNamespace(packed_decode_kda=packed_decode_kda))
    norm_calls = []
    norm_call = kda.GatedRMSNorm.__call__
    monkeypatch.setattr(kda.GatedRMSNorm, "__call__", lambda *args: norm_calls.append(1) or norm_call(*args))
    assert our_config().kda_decode_out_norm
    got, got_cache = decode_steps(our_config(kda_kernel="pallas", kda_decode_out_norm=out_norm))
    # One trace: the norm in the kernel's call, or GatedRMSNorm after it.
    assert norm_eps == [our_config().normalization_layer_epsilon if out_norm else None]
    assert len(norm_calls) == (0 if out_norm else 1)
    np.testing.assert_allclose(got, want, atol=TOL, rtol=TOL)
    assert_same_cache(got_cache, want_cache)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_launch_decode_equals_the_separate_kernels(interpreted_pallas, dtype):
    """kda_decode_one_launch: a KDA decoder layer's batch-1 steps after a prefill run the one-launch kernel
    (interpreted) instead of the packed decode, and equal the separate kernels' steps (float32: to 1e-5; bfloat16:
    the same roundings, other summation orders: within a few bf16 ulps); the launch's counters stay zero in the
    cache."""
    from MaxText.layers.decoder import DecoderLayer
    x = random_x(20, batch=1, seed=11).astype(dtype)

    def decode(one_launch):
        config = our_config(kda_kernel="pallas", kda_decode_one_launch=one_launch, dtype=dtype, weight_dtype=dtype)
        layer = DecoderLayer(config, layer_index=0)
        variables = layer.init(jax.random.key(0), jnp.asarray(x[:, :12]), model_mode="prefill")
        cache = jax.tree.map(jnp.zeros_like, variables["cache"])
        _, mutated = layer.apply({"params": variables["params"], "cache": cache}, jnp.asarray(x[:, :12]),
                                 model_mode="prefill", mutable=["cache"])
        step = jax.jit(lambda cache, token: layer.apply({"params": variables["params"], "cache": cache}, token,
                                                        model_mode="autoregressive", mutable=["cache"]))
        cache, outputs = mutated["cache"], []
        for t in range(12, 20):
            out, mutated = step(cache, jnp.asarray(x[:, t:t + 1]))
            cache = mutated["cache"]
            outputs.append(np.asarray(out.astype(jnp.float32)))
        return np.concatenate(outputs, axis=1), jax.tree.map(np.asarray, cache["self_attn"])

    want, want_cache = decode(False)
    assert interpreted_pallas["project_and_decode_kda"] == 0 and interpreted_pallas["packed_decode_kda"] >= 1
    got, got_cache = decode(True)
    assert interpreted_pallas["project_and_decode_kda"] >= 1
    assert not np.any(got_cache.pop("project_counts"))
    tol = TOL if dtype == "float32" else 0.05
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol)
    for name in ("conv_state", "recurrent_state"):
        np.testing.assert_allclose(got_cache[name].astype(np.float32), want_cache[name].astype(np.float32),
                                   atol=tol, rtol=tol, err_msg=name)


def test_verify_pallas_runs_the_verify_kernel(interpreted_pallas):
    """kda_kernel=pallas: 'verify' (the Pallas kernel writing the state ring) == the scan (kda_kernel=naive) in its
    outputs and its whole ring, the committed slot untouched; after a commit of different lengths per row, a one-token
    decode on the packed kernel (pool = the ring, row b at b*S + state_slot[b]) == the naive decode."""
    _, layer = hf_layer()
    x = random_x(15, seed=8)
    state_slots = kda.verify_state_slots(4)
    results = []
    for kernel in ("naive", "pallas"):
        config = our_config(kda_kernel=kernel)
        params = our_params(layer, config)
        model = KimiDeltaAttention(config)
        cache = _prefill_cache(our_config(kda_kernel="naive"), params, x[:, :10], state_slots)
        apply = jax.jit(lambda cache, x, mode, model=model, params=params: model.apply(
            {"params": params, "cache": cache}, x, model_mode=mode, mutable=["cache"]), static_argnums=2)
        out, mutated = apply(cache, jnp.asarray(x[:, 10:14]), "verify")
        verified = jax.tree.map(np.asarray, mutated["cache"])
        committed = kda.commit_verified(mutated["cache"], jnp.asarray([3, 0], jnp.int32))
        step_out, _ = apply(committed, jnp.asarray(x[:, 14:15]), "autoregressive")
        results.append((np.asarray(out), verified, np.asarray(step_out)))
    assert interpreted_pallas["recurrent_kda_ring_checkpoints"] >= 1 and interpreted_pallas["packed_decode_kda"] >= 1
    (want, want_cache, want_step), (got, got_cache, got_step) = results
    np.testing.assert_allclose(got, want, atol=TOL, rtol=TOL)
    np.testing.assert_allclose(got_cache["recurrent_state"], want_cache["recurrent_state"], atol=TOL, rtol=TOL)
    np.testing.assert_array_equal(kda.committed_state(got_cache), kda.committed_state(cache))  # verify keeps it
    np.testing.assert_allclose(got_step, want_step, atol=TOL, rtol=TOL)


def test_fused_projections_keep_params_and_output_in_fewer_dense_calls(monkeypatch, interpreted_dense_matmul):
    """fused_projections: q/k/v and f_a/g_a (and the MLPs' gate/up) go through one dense_matmul call per group. The
    params (names and random-init values) and the output are those of the unfused layer; with the Pallas dense
    kernel resolved (run by the interpreter here) the groups arrive as tuples of 3 and 2 kernels, one call each."""
    from MaxText.kernels import grouped_matmul as gmm
    from MaxText.kernels.grouped_matmul import pallas_gmm
    x = jnp.asarray(np.random.default_rng(9).normal(size=(2, 5, HIDDEN)), jnp.float32)
    plain = KimiDeltaAttention(our_config(fused_projections=False, dense_kernel_layout="in_out"))
    fused = KimiDeltaAttention(our_config(fused_projections=True, dense_kernel_layout="in_out"))
    params = plain.init(jax.random.key(3), x, model_mode="train")["params"]
    fused_params = fused.init(jax.random.key(3), x, model_mode="train")["params"]
    jax.tree.map(np.testing.assert_array_equal, params, fused_params)
    want = plain.apply({"params": params}, x, model_mode="train")
    np.testing.assert_array_equal(np.asarray(fused.apply({"params": params}, x, model_mode="train")),
                                  np.asarray(want))
    calls = interpreted_dense_matmul
    # pallas wherever the kernel supports the shape (b_proj's 2 heads are too few columns: XLA)
    monkeypatch.setattr(gmm, "resolve_dense", lambda _, dtype, contract, out, rows: (
        "xla" if pallas_gmm.unsupported_reason(dtype, contract, out) else "pallas"))
    got = fused.apply({"params": params}, x, model_mode="train")
    assert sorted(calls) == [1, 1, 1, 2, 3], calls  # f_b, g_b, o alone; f_a + g_a; q + k + v
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)
