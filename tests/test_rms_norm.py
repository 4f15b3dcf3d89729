"""RMSNorm (MaxText/kernels/rms_norm): the Pallas kernels (the norm, and the norm with the residual stream's add)
through the interpreter on CPU against the oracle, their gradients, the dispatcher's choices and errors, and the
RMSNorm layer taking the kernels when they resolve. The Triton compile and the GPU speed are checked by
benchmarks/model_decode.py (`--decode-variants '' norm_kernel=xla norm_adds_residual=false`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText import pyconfig
from MaxText.kernels import grouped_matmul, rms_norm as norms
from MaxText.kernels.rms_norm import naive, pallas_norm
from MaxText.layers import kda, normalizations
from MaxText.layers.models import KimiLinearForCausalLM, init_cache
from MaxText.layers.normalizations import RMSNorm


def _inputs(rows, dim, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(rows, dim)) * 3.0, dtype)
    scale = jnp.asarray(rng.normal(size=(dim,)), dtype)
    return x, scale


@pytest.mark.parametrize("rows,dim", [(1, 2304), (3, 512), (5, 100)])  # 100: a row padded to 128 with masks
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_pallas_rms_norm_matches_the_oracle(rows, dim, dtype):
    x, scale = _inputs(rows, dim, dtype)
    got = pallas_norm.rms_norm(x, scale, 1e-6, True)
    want = naive.rms_norm(x, scale, 1e-6)
    assert got.shape == want.shape and got.dtype == want.dtype
    if dtype == jnp.bfloat16:  # the same float32 arithmetic, then HF's casts: equal but for a sum order's ulp
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=8e-3, atol=1e-6)
        assert np.mean(np.asarray(got) != np.asarray(want)) < 0.01
    else:
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rows,dim", [(1, 2304), (3, 100)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_pallas_add_rms_norm_matches_the_oracle(rows, dim, dtype):
    """The add in the norm's kernel: the sum is the oracle's bit for bit (x's dtype; a float32 update is cast to it
    first) and the norm is taken of that rounded sum."""
    x, scale = _inputs(rows, dim, dtype)
    update = jnp.asarray(np.random.default_rng(7).normal(size=(rows, dim)) * 2.0, jnp.float32)
    normed, summed = pallas_norm.add_rms_norm(x, update, scale, 1e-6, True)
    want_normed, want_summed = naive.add_rms_norm(x, update, scale, 1e-6)
    assert summed.dtype == normed.dtype == dtype and summed.shape == normed.shape == x.shape
    np.testing.assert_array_equal(np.asarray(summed, np.float32), np.asarray(want_summed, np.float32))
    assert not np.array_equal(np.asarray(summed, np.float32), np.asarray(x, np.float32))
    np.testing.assert_array_equal(np.asarray(normed, np.float32),
                                  np.asarray(pallas_norm.rms_norm(want_summed, scale, 1e-6, True), np.float32))
    np.testing.assert_allclose(np.asarray(normed, np.float32), np.asarray(want_normed, np.float32),
                               rtol=8e-3 if dtype == jnp.bfloat16 else 1e-6, atol=1e-6)


def test_pallas_rms_norm_gradients_are_the_oracles():
    x, scale = _inputs(2, 256, jnp.float32, seed=1)
    cotangent = jnp.asarray(np.random.default_rng(2).normal(size=x.shape), jnp.float32)

    def loss(fn):
        return lambda x, scale: jnp.sum(fn(x, scale) * cotangent)
    got = jax.grad(loss(lambda x, s: pallas_norm.rms_norm(x, s, 1e-6, True)), argnums=(0, 1))(x, scale)
    want = jax.grad(loss(lambda x, s: naive.rms_norm(x, s, 1e-6)), argnums=(0, 1))(x, scale)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)

    update = jnp.asarray(np.random.default_rng(3).normal(size=x.shape), jnp.float32)

    def add_loss(fn):  # both outputs reach the loss, as in the decoder (the norm and the residual stream)
        return lambda x, update, scale: jnp.sum((fn(x, update, scale)[0] + 0.5 * fn(x, update, scale)[1]) * cotangent)
    got = jax.grad(add_loss(lambda x, u, s: pallas_norm.add_rms_norm(x, u, s, 1e-6, True)), argnums=(0, 1, 2))(
        x, update, scale)
    want = jax.grad(add_loss(lambda x, u, s: naive.add_rms_norm(x, u, s, 1e-6)), argnums=(0, 1, 2))(x, update, scale)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


def test_limits_and_dispatcher(monkeypatch):
    x, scale = _inputs(2, 64, jnp.float32)
    with pytest.raises(ValueError, match=r"expected x \[M, D\] and scale \[D\], got \(2, 64\) and \(32,\)"):
        pallas_norm.rms_norm(x, scale[:32], 1e-6, True)
    with pytest.raises(ValueError, match="bfloat16 or float32 rows, got float16"):
        pallas_norm.rms_norm(x.astype(jnp.float16), scale, 1e-6, True)
    with pytest.raises(ValueError, match=r"expected update of x's shape \(2, 64\), got \(1, 64\)"):
        pallas_norm.add_rms_norm(x, x[:1], scale, 1e-6, True)
    with pytest.raises(ValueError, match=r"add_rms_norm: update has shape \(2, 32\), expected x's \(2, 64\)"):
        norms.add_rms_norm(x, x[:, :32], scale, epsilon=1e-6)
    assert "at most 16384" in pallas_norm.unsupported_reason(jnp.bfloat16, 20000)
    assert norms.resolve("auto", jnp.bfloat16, 2304, 1) == "xla"  # CPU
    with pytest.raises(ValueError, match="norm_kernel='cuda' is unknown"):
        norms.resolve("cuda", jnp.bfloat16, 2304, 1)
    with pytest.raises(RuntimeError, match="norm_kernel=pallas was requested, but .*NVIDIA GPU"):
        norms.resolve("pallas", jnp.bfloat16, 2304, 1)
    monkeypatch.setattr(grouped_matmul, "single_gpu_reason", lambda kernel: None)  # as on one GPU
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert norms.resolve("auto", jnp.bfloat16, 2304, 1) == "pallas"
    assert norms.resolve("auto", jnp.bfloat16, 2304, 2) == "xla"  # more rows than batch-1 decode: XLA's fusions
    assert norms.resolve("pallas", jnp.bfloat16, 2304, 64) == "pallas"
    assert norms.resolve("auto", jnp.float16, 2304, 1) == "xla"  # unsupported dtype: the fallback


def test_rms_norm_layer_takes_the_kernel_when_resolved(monkeypatch):
    """RMSNorm with norm_kernel resolved to pallas (the kernel run by the interpreter here, as on one GPU) gives the
    xla layer's output for a [B, T, D] decode input; the same param."""
    config = pyconfig.load_config(pyconfig.BASE_CONFIG_PATH, {"emb_dim": 256})
    assert config.norm_kernel == "auto"  # the default
    x = jnp.asarray(np.random.default_rng(3).normal(size=(2, 1, 256)), jnp.bfloat16)
    layer = RMSNorm(pyconfig.load_config(pyconfig.BASE_CONFIG_PATH, {"emb_dim": 256, "norm_kernel": "xla"}))
    params = layer.init(jax.random.PRNGKey(0), x)
    params = jax.tree.map(lambda p: p * 1.5 + 0.25, params)
    want = layer.apply(params, x)
    calls, kernel = [], pallas_norm.rms_norm

    def interpreted(x, scale, epsilon):
        calls.append(x.shape)
        return kernel(x, scale, epsilon, True)
    monkeypatch.setattr(norms, "resolve", lambda *a: "pallas")
    monkeypatch.setattr(pallas_norm, "rms_norm", interpreted)
    got = RMSNorm(config).apply(params, x)
    assert calls == [(2, 256)]
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=8e-3, atol=1e-6)


@pytest.mark.parametrize("adds_residual", [True, False])
def test_rms_norm_layer_adds_the_update(monkeypatch, adds_residual):
    """RMSNorm(x, update=...) returns (norm(x + update), x + update) as the xla layer does; with norm_kernel resolved
    to pallas and norm_adds_residual the add runs in the norm's kernel (one call of add_rms_norm), without it XLA
    adds and the plain kernel takes the sum."""
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.normal(size=(1, 1, 256)), jnp.bfloat16)
    update = jnp.asarray(rng.normal(size=(1, 1, 256)), jnp.bfloat16)
    layer = RMSNorm(pyconfig.load_config(pyconfig.BASE_CONFIG_PATH, {"emb_dim": 256, "norm_kernel": "xla"}))
    params = jax.tree.map(lambda p: p * 1.5 + 0.25, layer.init(jax.random.PRNGKey(0), x, update))
    want_normed, want_summed = layer.apply(params, x, update)
    np.testing.assert_array_equal(np.asarray(want_summed, np.float32), np.asarray(x + update, np.float32))
    calls, plain, added = [], pallas_norm.rms_norm, pallas_norm.add_rms_norm
    monkeypatch.setattr(norms, "resolve", lambda *a: "pallas")
    monkeypatch.setattr(pallas_norm, "rms_norm", lambda x, s, e: calls.append("rms_norm") or plain(x, s, e, True))
    monkeypatch.setattr(pallas_norm, "add_rms_norm",
                        lambda x, u, s, e: calls.append("add_rms_norm") or added(x, u, s, e, True))
    config = pyconfig.load_config(pyconfig.BASE_CONFIG_PATH, {"emb_dim": 256, "norm_adds_residual": adds_residual})
    normed, summed = RMSNorm(config).apply(params, x, update)
    assert calls == ["add_rms_norm" if adds_residual else "rms_norm"]
    np.testing.assert_array_equal(np.asarray(summed, np.float32), np.asarray(want_summed, np.float32))
    np.testing.assert_allclose(np.asarray(normed, np.float32), np.asarray(want_normed, np.float32), rtol=8e-3,
                               atol=1e-6)


@pytest.mark.parametrize("adds_residual", [True, False])
def test_decoder_post_attention_norm_adds_the_mixer_output(monkeypatch, adds_residual):
    """The tiny model decoding one row with the norms' Pallas kernels (interpreted, as on one GPU): with
    norm_adds_residual each layer's post-attention norm adds the mixer's output in its kernel (add_rms_norm), and the
    logits are the XLA norms' (rounding aside) with the same greedy tokens. (The input norms run before the mixers:
    input_norm_after_projections false.)"""
    config = pyconfig.load_config("configs/kimi_linear_tiny.yml", {"dtype": "bfloat16", "norm_kernel": "xla"})
    model = KimiLinearForCausalLM(config)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (1, 6), 0, config.vocab_size)
    params = {"params": model.init(jax.random.PRNGKey(0), tokens, model_mode="train")["params"]}
    _, variables = model.apply(params, tokens, model_mode="prefill", mutable=["cache"])

    def decode(model, steps=3):
        step_fn = jax.jit(lambda cache, token: model.apply({**params, "cache": cache}, token,
                                                           model_mode="autoregressive", mutable=["cache"]))
        cache, token, logits = variables["cache"], tokens[:, -1:], []
        for _ in range(steps):
            step, updated = step_fn(cache, token)
            cache, token = updated["cache"], jnp.argmax(step, -1).astype(jnp.int32)
            logits.append(step)
        return jnp.concatenate(logits, axis=1)

    want = decode(model)
    calls, plain, added = [], pallas_norm.rms_norm, pallas_norm.add_rms_norm
    monkeypatch.setattr(norms, "resolve", lambda implementation, dtype, dim, rows: "pallas")
    monkeypatch.setattr(pallas_norm, "rms_norm", lambda x, s, e: calls.append("rms_norm") or plain(x, s, e, True))
    monkeypatch.setattr(pallas_norm, "add_rms_norm",
                        lambda x, u, s, e: calls.append("add_rms_norm") or added(x, u, s, e, True))
    got = decode(KimiLinearForCausalLM(pyconfig.load_config("configs/kimi_linear_tiny.yml", {
        "dtype": "bfloat16", "norm_adds_residual": adds_residual, "input_norm_after_projections": False})))
    layers = config.num_decoder_layers  # one trace: input + post-attention norms, the final norm, MLA's kv_a norm
    assert calls.count("add_rms_norm") == (layers if adds_residual else 0)
    assert calls.count("rms_norm") == (layers + 2 if adds_residual else 2 * layers + 2)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0.05, atol=0.05)
    np.testing.assert_array_equal(np.argmax(np.asarray(got), -1), np.argmax(np.asarray(want), -1))


def test_rms_norm_layer_deferred_returns_the_norm_in_two_factors():
    """RMSNorm(x, deferred=True) returns (scale * x, 1 / rms(x) [..., 1] float32), whose product is the norm; an
    update with it is an error."""
    x, _ = _inputs(6, 256, jnp.float32, seed=5)
    x = x.reshape(2, 3, 256)
    layer = RMSNorm(pyconfig.load_config(pyconfig.BASE_CONFIG_PATH, {"emb_dim": 256, "norm_kernel": "xla"}))
    params = jax.tree.map(lambda p: p * 1.5 + 0.25, layer.init(jax.random.PRNGKey(0), x))
    scaled, factor = layer.apply(params, x, deferred=True)
    assert factor.shape == (2, 3, 1) and factor.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(scaled), np.asarray(x * params["params"]["scale"].value))
    np.testing.assert_allclose(np.asarray(scaled * factor), np.asarray(layer.apply(params, x)), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="deferred=True"):
        layer.apply(params, x, x, deferred=True)


@pytest.mark.parametrize("model_mode", ["autoregressive", "verify"])
@pytest.mark.parametrize("deferred", [True, False])
def test_decoder_input_norm_after_projections(monkeypatch, deferred, model_mode):
    """The tiny model (float32), two rows, decoding three steps or verifying three draft tokens: with
    input_norm_after_projections no layer computes its input norm before the mixer (the norm's kernel runs only for
    the final norm and MLA's kv_a norms), and the logits are those of the norm first."""
    def logits(input_norm_after_projections):
        config = pyconfig.load_config("configs/kimi_linear_tiny.yml", {
            "dtype": "float32", "input_norm_after_projections": input_norm_after_projections})
        model = KimiLinearForCausalLM(config)
        tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 6), 0, config.vocab_size)
        params = {"params": model.init(jax.random.PRNGKey(0), tokens, model_mode="train")["params"]}
        if model_mode == "verify":  # drafts scored from an empty cache with a state ring
            calls.clear()
            out, _ = model.apply({**params, "cache": init_cache(config, 2, kda.verify_state_slots(3))}, tokens[:, :3],
                                 model_mode="verify", mutable=["cache"])
            return out, config
        _, variables = model.apply(params, tokens, model_mode="prefill", mutable=["cache"])
        step_fn = jax.jit(lambda cache, token: model.apply({**params, "cache": cache}, token,
                                                           model_mode="autoregressive", mutable=["cache"]))
        cache, token, steps = variables["cache"], tokens[:, -1:], []
        calls.clear()
        for _ in range(3):
            step, updated = step_fn(cache, token)
            cache, token = updated["cache"], jnp.argmax(step, -1).astype(jnp.int32)
            steps.append(step)
        return jnp.concatenate(steps, axis=1), config

    calls, plain = [], normalizations.rms_norm
    monkeypatch.setattr(normalizations, "rms_norm", lambda *a, **k: calls.append(1) or plain(*a, **k))
    want, _ = logits(False)
    norms_first = len(calls)
    got, config = logits(deferred)
    assert config.input_norm_after_projections == deferred
    assert norms_first - len(calls) == (config.num_decoder_layers if deferred else 0)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_decoder_routes_in_the_post_attention_norm(interpreted_norm_and_router):
    """moe_router_in_norm (default on): the tiny model (bf16) decoding one row with the norms' and the router's
    Pallas kernels (interpreted, as on one GPU): each MoE layer's post-attention norm and routing are one
    norm_and_route launch (no add_rms_norm, router product or routing launch of their own; the dense layer keeps
    add_rms_norm), and the logits are bit for bit those of the separate launches over three steps, each launch
    taking its counters from the cache's route_counts (one per MoE layer, [1] int32) and leaving them zero."""
    assert pyconfig.load_config(pyconfig.BASE_CONFIG_PATH).moe_router_in_norm  # the default
    calls = interpreted_norm_and_router

    def decode(in_norm: bool, steps: int = 3):
        config = pyconfig.load_config("configs/kimi_linear_tiny.yml", {
            "dtype": "bfloat16", "num_experts": 16, "norm_kernel": "pallas", "moe_router_kernel": "pallas",
            "mla_kernel": "xla", "moe_router_in_norm": in_norm})
        model = KimiLinearForCausalLM(config)
        tokens = jax.random.randint(jax.random.PRNGKey(1), (1, 6), 0, config.vocab_size)
        params = {"params": model.init(jax.random.PRNGKey(0), tokens, model_mode="train")["params"]}
        _, variables = model.apply(params, tokens, model_mode="prefill", mutable=["cache"])
        step_fn = jax.jit(lambda cache, token: model.apply({**params, "cache": cache}, token,
                                                           model_mode="autoregressive", mutable=["cache"]),
                          compiler_options={"xla_allow_excess_precision": False})  # rounds as the GPU kernels
        cache, token, logits = variables["cache"], tokens[:, -1:], []
        calls.clear()
        for _ in range(steps):
            step, updated = step_fn(cache, token)
            cache, token = updated["cache"], jnp.argmax(step, -1).astype(jnp.int32)
            logits.append(step)
        return jnp.concatenate(logits, axis=1), list(calls), config, cache

    want, separate, config, separate_cache = decode(False)
    got, fused, _, cache = decode(True)
    counters = {name: layer["route_counts"] for name, layer in cache["model"].items() if "route_counts" in layer}
    assert sorted(counters) == [f"layers_{i}" for i in range(config.first_num_dense_layers,
                                                              config.num_decoder_layers)]
    assert all(c.shape == (1,) and c.dtype == jnp.int32 and not np.any(np.asarray(c)) for c in counters.values())
    assert not any("route_counts" in layer for layer in separate_cache["model"].values())
    moe_layers = config.num_decoder_layers - config.first_num_dense_layers  # one trace of the step
    assert fused.count("norm_and_route") == moe_layers and separate.count("norm_and_route") == 0
    assert (separate.count("add_rms_norm"), fused.count("add_rms_norm")) == (config.num_decoder_layers, 1)
    assert (separate.count("route_logits"), fused.count("route_logits")) == (moe_layers, 0)
    assert (separate.count("vector_matrix_partials"), fused.count("vector_matrix_partials")) == (moe_layers, 0)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
