"""MoE routing kernels (MaxText/kernels/moe_router): the Pallas router (interpret mode) against the plain-JAX
oracle, its limits, the dispatcher, and the Router layer wired to it."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText import pyconfig
from MaxText.kernels import grouped_matmul, moe_router
from MaxText.kernels.moe_router import pallas_route, route


def _logits(rng, tokens, experts):
    """Random logits with exact ties (some values repeated within a row) and a correction bias."""
    logits = rng.standard_normal((tokens, experts)).astype(np.float32)
    logits[:, 1::7] = logits[:, :1]  # every 7th expert ties with expert 0
    bias = (0.1 * rng.standard_normal(experts)).astype(np.float32)
    bias[1::7] = bias[0]
    return jnp.asarray(logits), jnp.asarray(bias)


@pytest.mark.parametrize("experts,top_k,norm", [(256, 8, True), (8, 2, False), (64, 4, True)])
def test_pallas_router_matches_the_oracle(experts, top_k, norm):
    """Same experts in the same order (descending choice, ties to the lower id, as lax.top_k) and the same weights;
    the ties are exact (the same logit and bias), so a kernel that broke them differently would be caught."""
    logits, bias = _logits(np.random.default_rng(experts), 37, experts)
    kw = dict(top_k=top_k, norm_topk_prob=norm, routed_scaling_factor=2.446)
    weights, ids = pallas_route.route_logits(logits, bias, interpret=True, **kw)
    want_weights, want_ids = route(jax.nn.sigmoid(logits), bias, n_groups=1, top_k_groups=1, **kw)
    assert ids.dtype == jnp.int32 and weights.dtype == jnp.float32 and ids.shape == (37, top_k)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
    np.testing.assert_allclose(np.asarray(weights), np.asarray(want_weights), rtol=1e-6, atol=1e-7)


def test_pallas_router_sums_partial_logits_first():
    """Logits given as partial sums [S, N, E] (the router's product split over D) route as their sum does, ties
    included (the parts repeat the tied columns, so the sums tie exactly)."""
    rng = np.random.default_rng(5)
    logits, bias = _logits(rng, 9, 64)
    split = np.asarray(rng.standard_normal((3, 9, 64)), np.float32)
    split[:, :, 1::7] = split[:, :, :1]
    parts = jnp.stack([logits - split[0] - split[1], jnp.asarray(split[0]), jnp.asarray(split[1])])  # [3, N, E]
    kw = dict(top_k=4, norm_topk_prob=True, routed_scaling_factor=2.446)
    weights, ids = pallas_route.route_logits(parts, bias, interpret=True, **kw)
    want_weights, want_ids = route(jax.nn.sigmoid(parts[0] + parts[1] + parts[2]), bias, n_groups=1, top_k_groups=1,
                                   **kw)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
    np.testing.assert_allclose(np.asarray(weights), np.asarray(want_weights), rtol=1e-6, atol=1e-7)


def test_pallas_router_limits():
    assert pallas_route.unsupported_reason(256, 8, 1) is None
    assert "group-limited" in pallas_route.unsupported_reason(256, 8, 4)
    assert "num_experts to be a power of two, got 96" in pallas_route.unsupported_reason(96, 8, 1)
    assert "num_experts_per_tok to be a power of two, got 6" in pallas_route.unsupported_reason(64, 6, 1)
    with pytest.raises(ValueError, match=r"correction_bias must be \[16\]"):
        pallas_route.route_logits(jnp.zeros((2, 16)), jnp.zeros((8,)), top_k=2, norm_topk_prob=True,
                                  routed_scaling_factor=1.0, interpret=True)


def test_dispatcher_choices_and_errors(monkeypatch):
    assert moe_router.resolve("auto", 256, 8, 1) == "xla"  # CPU
    assert moe_router.resolve("xla", 256, 8, 1) == "xla"
    with pytest.raises(RuntimeError, match="moe_router_kernel=pallas was requested, but .*NVIDIA GPU"):
        moe_router.resolve("pallas", 256, 8, 1)
    with pytest.raises(ValueError, match="moe_router_kernel='cuda' is unknown"):
        moe_router.resolve("cuda", 256, 8, 1)
    monkeypatch.setattr(grouped_matmul, "single_gpu_reason", lambda kernel: None)  # as on one GPU
    assert moe_router.resolve("auto", 256, 8, 1) == "pallas"
    assert moe_router.resolve("auto", 256, 8, 4) == "xla"  # group-limited routing: the oracle
    with pytest.raises(RuntimeError, match="does not do group-limited routing"):
        moe_router.resolve("pallas", 256, 8, 4)


@pytest.mark.parametrize("tokens,parts", [(10, 2), (17, None)])  # decode sizes: the product in Pallas too
def test_router_layer_takes_the_pallas_kernels_when_resolved(monkeypatch, tokens, parts):
    """moe.Router with moe_router_kernel=pallas routes through the kernels (run by the interpreter here, as if on one
    GPU) and chooses what the plain-JAX routing chooses. Up to 16 tokens the product is the Pallas vector-matrix
    kernel (emb_dim 256: two partial sums of 128 channels, added by the routing kernel); above, XLA's."""
    from MaxText.kernels.grouped_matmul import pallas_gmm
    from MaxText.layers.moe import Router
    overrides = ["num_experts=16", "num_experts_per_tok=4", "emb_dim=256"]
    config = pyconfig.load_config(pyconfig.BASE_CONFIG_PATH, overrides)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((tokens, 256)), jnp.float32)
    router = Router(config)
    params = nn.meta.unbox(router.init(jax.random.PRNGKey(0), x))
    params["params"]["e_score_correction_bias"] = jnp.linspace(-0.1, 0.1, 16)
    want = router.apply(params, x)
    calls = []

    def interpreted(name, fn):
        def call(*args, **kwargs):
            calls.append((name, args[0].shape))
            return fn(*args, interpret=True, **kwargs)
        return call
    monkeypatch.setattr(grouped_matmul, "single_gpu_reason", lambda kernel: None)
    monkeypatch.setattr(pallas_route, "route_logits", interpreted("route", pallas_route.route_logits))
    monkeypatch.setattr(pallas_gmm, "vector_matrix_partials", interpreted("product", pallas_gmm.vector_matrix_partials))
    got = Router(pyconfig.load_config(pyconfig.BASE_CONFIG_PATH, overrides + ["moe_router_kernel=pallas"])).apply(
        params, x)
    if parts:
        assert calls == [("product", (tokens, 256)), ("route", (parts, tokens, 16))]
    else:
        assert calls == [("route", (tokens, 16))]
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-5)


def test_pallas_router_reads_bf16_tokens_as_they_are(monkeypatch):
    """A bf16 x reaches the Pallas product uncast (no float32 copy made before the launch) and routes exactly as
    its float32 copy does: the kernel multiplies in float32 either way (bf16 -> fp32 is exact)."""
    from MaxText.kernels.grouped_matmul import pallas_gmm
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((2, 256)), jnp.bfloat16)
    kernel = jnp.asarray(rng.standard_normal((256, 16)) / 16, jnp.bfloat16)
    bias = jnp.linspace(-0.1, 0.1, 16)
    seen, kernel_product = [], pallas_gmm.vector_matrix_partials

    def product(rows, w):
        seen.append(rows.dtype)
        return kernel_product(rows, w, interpret=True)
    monkeypatch.setattr(grouped_matmul, "single_gpu_reason", lambda kernel: None)
    monkeypatch.setattr(pallas_route, "route_logits", functools.partial(pallas_route.route_logits, interpret=True))
    monkeypatch.setattr(pallas_gmm, "vector_matrix_partials", product)
    route = functools.partial(moe_router.route_tokens, top_k=4, n_groups=1, top_k_groups=1, norm_topk_prob=True,
                              routed_scaling_factor=2.5, implementation="pallas")
    got, want = route(x, kernel, bias), route(x.astype(jnp.float32), kernel, bias)
    assert seen == [jnp.bfloat16, jnp.float32]
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("tokens", [1, 5])
def test_product_and_route_in_one_launch_equals_the_two_launches(tokens):
    """pallas_route.product_and_route: the router's product and routing in one pallas_call (the last product
    program of each token routes it) gives the two launches' result exactly: the same partial products, summed in
    the same order. bf16 tokens and kernel, 256 experts, top-8, D = 512 (4 partial sums), exact ties."""
    from MaxText.kernels.grouped_matmul import pallas_gmm
    rng = np.random.default_rng(tokens)
    x = jnp.asarray(rng.standard_normal((tokens, 512)), jnp.bfloat16)
    kernel = np.asarray(rng.standard_normal((512, 256)) / 16, np.float32)
    kernel[:, 1::7] = kernel[:, :1]  # every 7th expert ties with expert 0
    kernel = jnp.asarray(kernel, jnp.bfloat16)
    _, bias = _logits(rng, tokens, 256)
    kw = dict(top_k=8, norm_topk_prob=True, routed_scaling_factor=2.446)

    def one_launch(x):
        return pallas_route.product_and_route(x, kernel, bias, interpret=True, **kw)

    weights, ids = one_launch(x)
    want_weights, want_ids = pallas_route.route_logits(
        pallas_gmm.vector_matrix_partials(x, kernel, interpret=True), bias, interpret=True, **kw)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
    np.testing.assert_array_equal(np.asarray(weights), np.asarray(want_weights))
    assert [e.primitive.name for e in jax.make_jaxpr(one_launch)(x).jaxpr.eqns].count("pallas_call") == 1
    with pytest.raises(ValueError, match=r"correction_bias must be \[256\]"):
        pallas_route.product_and_route(x, kernel, bias[:8], interpret=True, **kw)


@pytest.mark.parametrize("one_launch", [False, True])
def test_router_layer_takes_one_launch_when_configured(monkeypatch, one_launch):
    """moe_router_one_launch (default off): the Router's Pallas product and routing as one product_and_route call
    instead of vector_matrix_partials then route_logits; the same experts and weights."""
    from MaxText.kernels.grouped_matmul import pallas_gmm
    from MaxText.layers.moe import Router
    overrides = ["num_experts=16", "num_experts_per_tok=4", "emb_dim=256", "moe_router_kernel=pallas",
                 f"moe_router_one_launch={str(one_launch).lower()}"]
    assert not pyconfig.load_config(pyconfig.BASE_CONFIG_PATH).moe_router_one_launch  # the default
    config = pyconfig.load_config(pyconfig.BASE_CONFIG_PATH, overrides)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((3, 256)), jnp.float32)
    calls = []

    def interpreted(name, fn):
        def call(*args, **kwargs):
            calls.append(name)
            return fn(*args, **{**kwargs, "interpret": True})
        return call
    monkeypatch.setattr(grouped_matmul, "single_gpu_reason", lambda kernel: None)
    for name, module, attr in (("route", pallas_route, "route_logits"), ("product", pallas_gmm,
                                                                        "vector_matrix_partials"),
                               ("one launch", pallas_route, "product_and_route")):
        monkeypatch.setattr(module, attr, interpreted(name, getattr(module, attr)))
    params = nn.meta.unbox(Router(config).init(jax.random.PRNGKey(0), x))
    calls.clear()
    got = Router(config).apply(params, x)
    want = route(jax.nn.sigmoid(x @ params["params"]["kernel"]), params["params"]["e_score_correction_bias"],
                 n_groups=1, top_k_groups=1, top_k=4, norm_topk_prob=config.norm_topk_prob,
                 routed_scaling_factor=config.routed_scaling_factor)
    # (one launch: product_and_route's launch is vector_matrix_partials' with its `finish`)
    assert calls == (["one launch", "product"] if one_launch else ["product", "route"])
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-5)


# XLA's CPU compiler may keep a value rounded to bf16 inside an interpreted kernel in float32 when it feeds a float32
# product (excess precision); the Triton compile rounds it. Without the excess the interpreter rounds as the GPU.
EXACT = {"xla_allow_excess_precision": False}


@pytest.mark.parametrize("tokens", [1, 3])
def test_norm_and_route_equals_the_norm_and_router_launches(tokens):
    """pallas_route.norm_and_route (`moe_router_in_norm`): the residual add, the RMSNorm, the router's product and
    the routing in one pallas_call give the three launches' results bit for bit (add_rms_norm's normed and summed
    rows; vector_matrix_partials of the normed rows, routed by route_logits): bf16 rows, a float32 update, D = 512
    (4 partial sums), 256 experts, top-8, exact ties among the router's columns."""
    from MaxText.kernels.grouped_matmul import pallas_gmm
    from MaxText.kernels.rms_norm import pallas_norm
    rng = np.random.default_rng(tokens)
    x = jnp.asarray(rng.standard_normal((tokens, 512)) * 2, jnp.bfloat16)
    update = jnp.asarray(rng.standard_normal((tokens, 512)), jnp.float32)
    scale = jnp.asarray(1 + 0.1 * rng.standard_normal(512), jnp.bfloat16)
    kernel = np.asarray(rng.standard_normal((512, 256)) / 16, np.float32)
    kernel[:, 1::7] = kernel[:, :1]  # every 7th expert ties with expert 0
    kernel = jnp.asarray(kernel, jnp.bfloat16)
    _, bias = _logits(rng, tokens, 256)
    kw = dict(top_k=8, norm_topk_prob=True, routed_scaling_factor=2.446)

    def one_launch(x, update):
        return pallas_route.norm_and_route(x, update, scale, kernel, bias, epsilon=1e-5, interpret=True, **kw)

    def three_launches(x, update):
        normed, summed = pallas_norm.add_rms_norm(x, update, scale, 1e-5, True)
        parts = pallas_gmm.vector_matrix_partials(normed, kernel, interpret=True)
        return (normed, summed, *pallas_route.route_logits(parts, bias, interpret=True, **kw))

    got = jax.jit(one_launch, compiler_options=EXACT)(x, update)
    want = jax.jit(three_launches, compiler_options=EXACT)(x, update)
    for name, g, w in zip(("normed", "summed", "weights", "ids"), got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32), err_msg=name)
    assert [e.primitive.name for e in jax.make_jaxpr(one_launch)(x, update).jaxpr.eqns].count("pallas_call") == 1
    with pytest.raises(ValueError, match=r"expected x and update \[N, D\] and norm_scale \[D\]"):
        pallas_route.norm_and_route(x, update[:, :256], scale, kernel, bias, epsilon=1e-5, interpret=True, **kw)
    with pytest.raises(ValueError, match=r"expected the router's kernel \[512, E\]"):
        pallas_route.norm_and_route(x, update, scale, kernel[:256], bias, epsilon=1e-5, interpret=True, **kw)


def test_norm_and_route_leaves_its_counters_zeroed():
    """norm_and_route with `counts` (the decode cache's route_counts) returns them zeroed again beside the same four
    results, so that the next call can take them as they are: three calls chained through the returned counters
    all route as one call with fresh zeros (without the reset the second call's token would never see its last
    count and would not route). A wrong counters shape names what is expected."""
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((2, 256)), jnp.bfloat16)
    update = jnp.asarray(rng.standard_normal((2, 256)), jnp.bfloat16)
    scale = jnp.ones((256,), jnp.bfloat16)
    kernel = jnp.asarray(rng.standard_normal((256, 64)) / 16, jnp.bfloat16)
    _, bias = _logits(rng, 2, 64)
    kw = dict(epsilon=1e-5, top_k=4, norm_topk_prob=True, routed_scaling_factor=2.0, interpret=True)
    route = jax.jit(lambda counts: pallas_route.norm_and_route(x, update, scale, kernel, bias, counts=counts, **kw),
                    compiler_options=EXACT)
    want = pallas_route.norm_and_route(x, update, scale, kernel, bias, **kw)
    counts = jnp.zeros((2,), jnp.int32)
    for _ in range(3):
        *got, counts = route(counts)
        np.testing.assert_array_equal(np.asarray(counts), np.zeros(2, np.int32))
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    with pytest.raises(ValueError, match=r"counts must be int32 \[2\] \(one per token\)"):
        pallas_route.norm_and_route(x, update, scale, kernel, bias, counts=jnp.zeros((3,), jnp.int32), **kw)