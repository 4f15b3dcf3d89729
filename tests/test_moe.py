"""MoE layer: parity with HF KimiLinearMoE (router, group-limited top-k, experts, shared experts), the sorted
grouped-matmul dispatch, and its cost: FLOPs grow with top-k, not with the number of experts."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from MaxText import pyconfig
from MaxText.hf_weights import params_from_hf_state_dict
from MaxText.kernels.grouped_matmul import grouped_matmul
from MaxText.layers.moe import MoE, RoutedExperts, Router, shared_rows_fit
from tests.test_model_hf_parity import CONFIG_NAMES, hf_model, hf_state_dict, our_config

TOL = 1e-5  # x max|reference|


@functools.lru_cache(maxsize=None)
def moe_setup(name: str):
    """(HF MoE module, our config, our MoE params) for the first MoE layer of HF test config `name`."""
    model = hf_model(name)
    config = our_config(model)
    layer = config.mlp_types.index("moe")
    params = params_from_hf_state_dict(hf_state_dict(model), config)["params"]["model"][f"layers_{layer}"]["mlp"]
    return model.model.layers[layer].mlp, config, params


def _tokens(config, batch=2, length=33, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(batch, length, config.emb_dim)).astype(np.float32)


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_router_matches_hf(name):
    hf_moe, config, params = moe_setup(name)
    x = _tokens(config).reshape(-1, config.emb_dim)
    with torch.no_grad():
        _, hf_weights, hf_ids = hf_moe.gate(torch.tensor(x))
    weights, ids = jax.jit(Router(config).apply)({"params": params["gate"]}, x)
    # HF's top-k is unsorted: compare each token's (expert, weight) pairs sorted by expert id.
    hf_order, our_order = np.argsort(hf_ids.numpy(), -1), np.argsort(np.asarray(ids), -1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(ids), our_order, -1),
                                  np.take_along_axis(hf_ids.numpy(), hf_order, -1))
    np.testing.assert_allclose(np.take_along_axis(np.asarray(weights), our_order, -1),
                               np.take_along_axis(hf_weights.numpy(), hf_order, -1), rtol=1e-6, atol=1e-7)
    if config.n_routing_groups > 1:  # every chosen expert lies in one of the topk_routing_group kept groups
        groups = np.asarray(ids) // (config.num_experts // config.n_routing_groups)
        assert max(len(set(row)) for row in groups.tolist()) <= config.topk_routing_group


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_moe_matches_hf(name):
    hf_moe, config, params = moe_setup(name)
    x = _tokens(config, seed=1)
    with torch.no_grad():
        want = hf_moe(torch.tensor(x)).numpy()
    got = np.asarray(jax.jit(MoE(config).apply)({"params": params}, x))
    err, scale = np.abs(got - want).max(), np.abs(want).max()
    assert err <= TOL * scale, (err, scale)


def _with(config, **overrides):
    """`config` with some keys replaced (re-validated through pyconfig)."""
    def thaw(value):
        return [thaw(v) for v in value] if isinstance(value, tuple) else value
    keys = {k: thaw(v) for k, v in config.items() if k not in pyconfig.DERIVED_KEYS}
    return pyconfig.load_config(pyconfig.BASE_CONFIG_PATH, {**keys, **overrides})


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_ragged_dot_and_gather_dispatch_agree(name):
    _, config, params = moe_setup(name)
    x = _tokens(config, seed=2)
    outs = [np.asarray(jax.jit(MoE(_with(config, moe_grouped_matmul=impl)).apply)({"params": params}, x))
            for impl in ("ragged_dot", "gather")]
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("implementation", ["ragged_dot", "gather"])
def test_grouped_matmul_uses_each_rows_own_expert(implementation):
    rng = np.random.default_rng(3)
    group_sizes = np.array([3, 0, 5, 1, 0, 2], np.int32)  # empty groups included
    row_groups = np.repeat(np.arange(len(group_sizes)), group_sizes).astype(np.int32)
    rows = rng.normal(size=(group_sizes.sum(), 4)).astype(np.float32)
    weights = rng.normal(size=(len(group_sizes), 4, 3)).astype(np.float32)
    got = grouped_matmul(jnp.asarray(rows), jnp.asarray(weights), jnp.asarray(group_sizes), jnp.asarray(row_groups),
                         implementation=implementation, precision=jax.lax.Precision.HIGHEST)
    want = np.einsum("mk,mkn->mn", rows, weights[row_groups])
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


def _primitives(jaxpr) -> set[str]:
    """Every primitive name in a (closed) jaxpr, nested jaxprs included."""
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    names |= _primitives(inner)
    return names


@pytest.mark.parametrize("implementation,num_tokens,sorted_rows", [
    ("gather", 300, False), ("ragged_dot", 2, True), ("pallas", 2, False), ("pallas", 3, True)])
def test_rows_are_sorted_only_for_implementations_that_need_it(implementation, num_tokens, sorted_rows, monkeypatch):
    """gather and the Pallas `rows` grid (<= 16 rows: 2 tokens x top-8) take rows in token order, so the MoE skips
    the sort and the unsort; ragged_dot and the Pallas `tiles` grid (3 tokens: 24 rows) get sorted rows. Every
    case gives the einsum oracle (the Pallas kernel in interpret mode)."""
    from MaxText.kernels import grouped_matmul as gmm
    config = pyconfig.load_config(pyconfig.BASE_CONFIG_PATH, dict(
        emb_dim=32, moe_mlp_dim=16, num_experts=16, num_experts_per_tok=8, n_routing_groups=1, topk_routing_group=1,
        moe_grouped_matmul=implementation, num_decoder_layers=1, kda_layers=[1], mla_layers=[]))
    if implementation == "pallas":  # as on one GPU, the kernel in interpret mode
        from MaxText.kernels.grouped_matmul import pallas_gmm
        monkeypatch.setattr(gmm, "resolve", lambda *a: "pallas")
        monkeypatch.setattr(pallas_gmm, "grouped_matmul", functools.partial(pallas_gmm.grouped_matmul, interpret=True))
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(num_tokens, 32)), jnp.float32)
    ids = jnp.asarray(np.stack([rng.choice(16, 8, replace=False) for _ in range(num_tokens)]), jnp.int32)
    weights = jnp.asarray(rng.uniform(size=(num_tokens, 8)), jnp.float32)
    experts = RoutedExperts(config)
    params = experts.init(jax.random.PRNGKey(0), x, weights, ids)
    assert gmm.rows_must_be_sorted(implementation, jnp.float32, 32, 16, num_tokens * 8) == sorted_rows
    assert ("sort" in _primitives(jax.make_jaxpr(experts.apply)(params, x, weights, ids).jaxpr)) == sorted_rows
    with jax.default_matmul_precision("highest"):
        got = experts.apply(params, x, weights, ids)
        w = nn.unbox(params)["params"]
        hidden = jax.nn.silu(jnp.einsum("nd,nkdi->nki", x, w["gate_proj"][ids])) * jnp.einsum(
            "nd,nkdi->nki", x, w["up_proj"][ids])
        want = jnp.einsum("nk,nki,nkid->nd", weights, hidden, w["down_proj"][ids])
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def dispatch_flops(num_experts: int, top_k: int, implementation: str = "auto", num_tokens: int = 256) -> float:
    """FLOPs XLA counts for the compiled routed-expert dispatch (sort, grouped matmuls, unsort, weighted sum; the
    router is excluded) of `num_tokens` tokens, emb_dim 64, expert width 32."""
    config = pyconfig.load_config(pyconfig.BASE_CONFIG_PATH, dict(
        emb_dim=64, moe_mlp_dim=32, num_experts=num_experts, num_experts_per_tok=top_k, n_routing_groups=1,
        topk_routing_group=1, moe_grouped_matmul=implementation, num_decoder_layers=1, kda_layers=[1],
        mla_layers=[]))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(num_tokens, 64)), jnp.float32)
    ids = jnp.asarray(np.stack([rng.choice(num_experts, top_k, replace=False) for _ in range(num_tokens)]), jnp.int32)
    weights = jnp.full((num_tokens, top_k), 1.0 / top_k, jnp.float32)
    experts = RoutedExperts(config)
    params = experts.init(jax.random.PRNGKey(0), x, weights, ids)
    cost = jax.jit(experts.apply).lower(params, x, weights, ids).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost["flops"])


def test_dispatch_flops_grow_with_top_k_not_with_expert_count():
    flops = {(e, k): dispatch_flops(e, k) for e, k in ((8, 2), (256, 2), (8, 4))}
    print(f"MoE dispatch FLOPs on {jax.default_backend()} (moe_grouped_matmul=auto), 256 tokens: "
          + ", ".join(f"E={e} top-{k}: {f:.3e}" for (e, k), f in flops.items()))
    assert flops[(256, 2)] <= 2.0 * flops[(8, 2)], flops
    assert 1.6 <= flops[(8, 4)] / flops[(8, 2)] <= 2.4, flops  # the work is proportional to top-k



@pytest.mark.parametrize("layout", ["in_out", "out_in"])
@pytest.mark.parametrize("num_tokens,merged", [(3, True), (4, False)])
def test_shared_expert_as_rows_of_the_routed_kernels(num_tokens, merged, layout, monkeypatch):
    """moe_shared_in_routed: where the Pallas rows grid takes all N*(k+1) rows (3 tokens x (top-4 + 1) = 15 <= 16),
    the shared expert runs as one more row per token in the routed launches (both carry extra weights: its kernels
    as stored, [out, in] ones read transposed) and the MoE's output is unchanged; 4 tokens (20 rows) keep the
    separate shared MLP. Same params either way."""
    from MaxText.kernels import grouped_matmul as gmm
    from MaxText.kernels.grouped_matmul import pallas_gmm
    options = dict(emb_dim=32, moe_mlp_dim=16, num_experts=16, num_experts_per_tok=4, n_routing_groups=1,
                   topk_routing_group=1, shared_experts=1, moe_grouped_matmul="pallas", num_decoder_layers=1,
                   kda_layers=[1], mla_layers=[], dense_kernel_layout=layout)
    plain = pyconfig.load_config(pyconfig.BASE_CONFIG_PATH, {**options, "moe_shared_in_routed": False})
    assert pyconfig.load_config(pyconfig.BASE_CONFIG_PATH).moe_shared_in_routed  # the default
    rows_config = pyconfig.load_config(pyconfig.BASE_CONFIG_PATH, {**options, "moe_shared_in_routed": True})
    monkeypatch.setattr(gmm, "resolve", lambda *a: "pallas")  # as on one GPU, the kernel in interpret mode
    assert shared_rows_fit(rows_config, 3) and not shared_rows_fit(plain, 3)
    interpreted, extras = functools.partial(pallas_gmm.grouped_matmul, interpret=True), []

    def recorded(*args, **kwargs):  # the extra weights' shapes and layout in each launch
        extra = kwargs.get("extra_weights")
        shapes = None if extra is None else tuple(w.shape for w in gmm.as_tuple(extra)[0])
        extras.append(shapes and (shapes, kwargs["extra_out_in"]))
        return interpreted(*args, **kwargs)
    monkeypatch.setattr(pallas_gmm, "grouped_matmul", recorded)
    x = jnp.asarray(np.random.default_rng(4).normal(size=(1, num_tokens, 32)), jnp.float32)
    params = MoE(plain).init(jax.random.PRNGKey(0), x)
    with jax.default_matmul_precision("highest"):
        want = MoE(plain).apply(params, x)
        extras.clear()
        got = MoE(rows_config).apply(params, x)
    assert gmm.extra_groups_supported("pallas", jnp.float32, 32, 16, num_tokens * 5) == merged
    gate_up, down = ((1, 32, 16), (1, 32, 16)), ((1, 16, 32),)  # [1, D, I] / [1, I, D] as stored in_out
    if layout == "out_in":
        gate_up, down = ((1, 16, 32), (1, 16, 32)), ((1, 32, 16),)
    out_in = layout == "out_in"
    assert extras == ([(gate_up, out_in), (down, out_in)] if merged else [None, None])  # gate + up, down launches
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shared_in_routed", [True, False])
def test_moe_rows_fused_inputs_reach_the_rows_grid(shared_in_routed, monkeypatch):
    """moe_rows_fused_inputs (default on): the rows grid gets the tokens (rows_per_token = top-k; with the shared
    expert as routed rows, row ids for the routed rows only) and the down product the gate / up launches'
    PartialRows; off: the repeated rows, the ids and the activation made first. The same output either way."""
    from MaxText.kernels import grouped_matmul as gmm
    from MaxText.kernels.grouped_matmul import pallas_gmm
    options = dict(emb_dim=32, moe_mlp_dim=16, num_experts=16, num_experts_per_tok=4, n_routing_groups=1,
                   topk_routing_group=1, shared_experts=1, moe_grouped_matmul="pallas", num_decoder_layers=1,
                   kda_layers=[1], mla_layers=[], moe_shared_in_routed=shared_in_routed,
                   dense_kernel_layout="in_out")
    assert pyconfig.load_config(pyconfig.BASE_CONFIG_PATH).moe_rows_fused_inputs  # the default
    monkeypatch.setattr(gmm, "resolve", lambda *a: "pallas")  # as on one GPU, the kernel in interpret mode
    kernel, seen = pallas_gmm.grouped_matmul, []

    def recorded(rows, weights, group_sizes, row_groups, **kwargs):
        seen.append((isinstance(rows, gmm.PartialRows), rows.shape[0], kwargs["rows_per_token"], row_groups.shape[0]))
        return kernel(rows, weights, group_sizes, row_groups, interpret=True, **kwargs)
    monkeypatch.setattr(pallas_gmm, "grouped_matmul", recorded)
    x = jnp.asarray(np.random.default_rng(7).normal(size=(1, 3, 32)), jnp.float32)
    outputs = {}
    for fused in (True, False):
        config = pyconfig.load_config(pyconfig.BASE_CONFIG_PATH, {**options, "moe_rows_fused_inputs": fused})
        params = MoE(config).init(jax.random.PRNGKey(0), x)
        seen.clear()
        with jax.default_matmul_precision("highest"):
            outputs[fused] = np.asarray(MoE(config).apply(params, x))
        rows = 15 if shared_in_routed else 12  # 3 tokens x (top-4 (+ the shared row))
        if fused:
            want = [(False, 3, 4, 12), (True, rows, 0, 12)]  # the tokens, then the gate / up partials
        else:
            want = [(False, rows, 0, rows), (False, rows, 0, rows)]
        assert seen == want
    np.testing.assert_allclose(outputs[True], outputs[False], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("product, mma", [("auto", None), ("tensor_cores", True), ("fma", False)])
def test_moe_rows_product_reaches_the_rows_grid(product, mma, monkeypatch):
    """moe_rows_product picks how the Pallas rows grid multiplies (auto: the kernel's default by dtype)."""
    from MaxText.kernels import grouped_matmul as gmm
    from MaxText.kernels.grouped_matmul import pallas_gmm
    config = pyconfig.load_config(pyconfig.BASE_CONFIG_PATH, dict(
        emb_dim=32, moe_mlp_dim=16, num_experts=8, num_experts_per_tok=2, n_routing_groups=1, topk_routing_group=1,
        moe_grouped_matmul="pallas", num_decoder_layers=1, kda_layers=[1], mla_layers=[], moe_rows_product=product))
    monkeypatch.setattr(gmm, "resolve", lambda *a: "pallas")  # as on one GPU, the kernel in interpret mode
    seen, kernel = [], pallas_gmm.grouped_matmul

    def recorded(*args, **kwargs):
        seen.append(kwargs["rows_mma"])
        return kernel(*args, interpret=True, **kwargs)
    monkeypatch.setattr(pallas_gmm, "grouped_matmul", recorded)
    x = jnp.asarray(np.random.default_rng(5).normal(size=(1, 2, 32)), jnp.float32)
    MoE(config).apply(MoE(config).init(jax.random.PRNGKey(0), x), x)
    assert seen and all(value is mma for value in seen), seen


def test_moe_gate_up_one_launch_reaches_the_gate_up_call(monkeypatch):
    """moe_gate_up_one_launch: the gate and up products (glu: the MoE takes SiLU(gate) * up from the kernel) run
    in one rows-grid launch or one per array, with the same output; the down product is one array as before."""
    from MaxText.kernels import grouped_matmul as gmm
    from MaxText.kernels.grouped_matmul import pallas_gmm
    options = dict(emb_dim=32, moe_mlp_dim=16, num_experts=8, num_experts_per_tok=2, n_routing_groups=1,
                   topk_routing_group=1, moe_grouped_matmul="pallas", num_decoder_layers=1, kda_layers=[1],
                   mla_layers=[])
    assert not pyconfig.load_config(pyconfig.BASE_CONFIG_PATH).moe_gate_up_one_launch  # the default
    monkeypatch.setattr(gmm, "resolve", lambda *a: "pallas")  # as on one GPU, the kernel in interpret mode
    seen, kernel = [], pallas_gmm.grouped_matmul

    def recorded(*args, **kwargs):
        seen.append((kwargs["glu"], kwargs["rows_one_launch"]))
        return kernel(*args, interpret=True, **kwargs)
    monkeypatch.setattr(pallas_gmm, "grouped_matmul", recorded)
    x = jnp.asarray(np.random.default_rng(6).normal(size=(1, 3, 32)), jnp.float32)
    outputs = []
    for one_launch in (True, False):
        config = pyconfig.load_config(pyconfig.BASE_CONFIG_PATH, {**options, "moe_gate_up_one_launch": one_launch})
        params = MoE(config).init(jax.random.PRNGKey(0), x)
        seen.clear()
        with jax.default_matmul_precision("highest"):
            outputs.append(np.asarray(MoE(config).apply(params, x)))
        assert seen == [(True, one_launch), (False, False)]  # gate + up (SiLU(gate) * up), then down
    np.testing.assert_allclose(outputs[0], outputs[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dense_layout", ["out_in", "in_out"])
@pytest.mark.parametrize("num_tokens,kernel_calls", [(3, 2), (5, 0)])
def test_experts_stored_out_in_give_the_same_moe(num_tokens, kernel_calls, dense_layout, monkeypatch):
    """expert_kernel_layout out_in: the routed experts' params are [E, I, D] / [E, D, I]; with the same matrices the
    MoE's output is the in_out layout's. 3 tokens (15 rows with the shared expert's): gate / up and down by
    pallas_rows_out_in (as on one GPU, interpreted); 5 tokens (20 routed rows): the Pallas tiles grid reading them
    as stored."""
    from MaxText.kernels import grouped_matmul as gmm
    from MaxText.kernels.grouped_matmul import pallas_gmm, pallas_rows_out_in
    options = dict(emb_dim=32, moe_mlp_dim=16, num_experts=16, num_experts_per_tok=4, n_routing_groups=1,
                   topk_routing_group=1, shared_experts=1, moe_grouped_matmul="pallas", num_decoder_layers=1,
                   kda_layers=[1], mla_layers=[], dense_kernel_layout=dense_layout)
    assert pyconfig.load_config(pyconfig.BASE_CONFIG_PATH).expert_kernel_layout == "in_out"  # the default
    in_out, out_in = (pyconfig.load_config(pyconfig.BASE_CONFIG_PATH, {**options, "expert_kernel_layout": layout})
                      for layout in ("in_out", "out_in"))
    monkeypatch.setattr(gmm, "resolve", lambda *a: "pallas")
    monkeypatch.setattr(pallas_gmm, "grouped_matmul", functools.partial(pallas_gmm.grouped_matmul, interpret=True))
    kernel, calls = pallas_rows_out_in.grouped_matmul_out_in, []

    def recorded(*args, **kwargs):
        calls.append(kwargs["glu"])
        return kernel(*args, **kwargs, interpret=True)
    monkeypatch.setattr(pallas_rows_out_in, "grouped_matmul_out_in", recorded)
    x = jnp.asarray(np.random.default_rng(5).normal(size=(1, num_tokens, 32)), jnp.float32)
    params = nn.unbox(MoE(in_out).init(jax.random.PRNGKey(0), x))
    experts = params["params"]["experts"]
    stored = {name: jnp.swapaxes(w, 1, 2) for name, w in experts.items()}
    shapes = nn.unbox(jax.eval_shape(MoE(out_in).init, jax.random.PRNGKey(0), x))["params"]["experts"]
    assert {name: w.shape for name, w in shapes.items()} == {name: w.shape for name, w in stored.items()} == {
        "gate_proj": (16, 16, 32), "up_proj": (16, 16, 32), "down_proj": (16, 32, 16)}
    calls.clear()  # (the shapes' trace ran the forward too)
    with jax.default_matmul_precision("highest"):
        want = MoE(in_out).apply(params, x)
        got = MoE(out_in).apply({"params": {**params["params"], "experts": stored}}, x)
    assert calls == [True, False][:kernel_calls]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
