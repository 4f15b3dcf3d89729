"""Pallas (Triton lowering) MoE routing for one GPU: sigmoid, correction bias, top-k, normalization and scaling in
one kernel, one program per token (the XLA version is four to six small kernels per MoE layer: sigmoid and bias,
top-k, the gather of the chosen scores, the normalization).

    weights [N, k] f32, ids [N, k] int32 = route_logits(logits [N, E] f32, correction_bias [E], ...)

`logits` may also come as partial sums [S, N, E] (the router's product split over K into S blocks,
`pallas_gmm.vector_matrix_partials`): the kernel adds them up first, so the product needs no reduction of its own.
`product_and_route` runs the product and the routing as one launch: the product's last program for each token
routes it (`route_token`, the same code as the routing kernel's programs).

Top-k by k rounds of (max, lowest expert id holding it, masked out): the experts come out in descending order of
their choice value and ties go to the lower id, as `jax.lax.top_k` orders them (naive.route, the oracle). Ungrouped
routing only (n_groups = 1, Kimi-Linear's), E and k powers of two (Triton block shapes). Runs under
`interpret=True` on CPU (the tests do).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

F32 = jnp.float32


def unsupported_reason(num_experts: int, top_k: int, n_groups: int) -> str | None:
    """None when the kernel takes this routing."""
    if n_groups != 1:
        return f"the Pallas router does not do group-limited routing (n_routing_groups={n_groups})"
    for name, value in (("num_experts", num_experts), ("num_experts_per_tok", top_k)):
        if value < 1 or value & (value - 1):
            return f"the Pallas router needs {name} to be a power of two, got {value}"
    if top_k > num_experts:
        return f"num_experts_per_tok={top_k} exceeds num_experts={num_experts}"
    return None


def _route_kernel(logits_ref, bias_ref, weights_ref, ids_ref, **options):
    """One program per token: `route_token`."""
    route_token(pl.program_id(0), logits_ref, bias_ref, weights_ref, ids_ref, **options)


def route_token(token, logits_ref, bias_ref, weights_ref, ids_ref, *, top_k, norm_topk_prob, scaling):
    """Routes one token inside a kernel: its logits (the sum over logits_ref [S, N, E]'s parts) -> its row of
    weights_ref / ids_ref [N, k]."""
    logits = logits_ref[0, token, :]  # [E]
    for part in range(1, logits_ref.shape[0]):  # partial sums of the router's product, in order
        logits = logits + logits_ref[part, token, :]
    scores = jax.nn.sigmoid(logits)  # [E]
    choice = scores + bias_ref[...].astype(F32)  # [E], used only to choose
    num_experts = scores.shape[0]
    expert = jnp.arange(num_experts, dtype=jnp.int32)
    slot = jnp.arange(top_k, dtype=jnp.int32)
    ids, weights = jnp.zeros((top_k,), jnp.int32), jnp.zeros((top_k,), F32)
    for i in range(top_k):
        pick = jnp.min(jnp.where(choice == jnp.max(choice), expert, num_experts))  # the lowest id of the max
        chosen = expert == pick
        ids = jnp.where(slot == i, pick, ids)
        weights = jnp.where(slot == i, jnp.sum(jnp.where(chosen, scores, 0.0)), weights)
        choice = jnp.where(chosen, -jnp.inf, choice)
    if norm_topk_prob:
        weights = weights / (jnp.sum(weights) + 1e-20)
    weights_ref[token, :] = weights * scaling
    ids_ref[token, :] = ids


def _check(num_experts: int, top_k: int, correction_bias: jax.Array) -> None:
    reason = unsupported_reason(num_experts, top_k, 1)
    if reason:
        raise ValueError(reason)
    if correction_bias.shape != (num_experts,):
        raise ValueError(f"correction_bias must be [{num_experts}], got {correction_bias.shape}")


def route_logits(logits: jax.Array, correction_bias: jax.Array, *, top_k: int, norm_topk_prob: bool,
                 routed_scaling_factor: float, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """logits [N, E] (the router's x W, float32) or its partial sums [S, N, E], correction_bias [E] -> (weights
    [N, k] float32, ids [N, k] int32): naive.route(sigmoid(logits (summed over S)), correction_bias, ...) with
    n_groups = 1."""
    if logits.ndim == 2:
        logits = logits[None]  # one part
    num_tokens, num_experts = logits.shape[1:]
    _check(num_experts, top_k, correction_bias)
    kernel = functools.partial(_route_kernel, top_k=top_k, norm_topk_prob=norm_topk_prob,
                               scaling=float(routed_scaling_factor))
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((num_tokens, top_k), F32),
                   jax.ShapeDtypeStruct((num_tokens, top_k), jnp.int32)),
        grid=(num_tokens,),
        compiler_params=pltriton.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
        name="moe_route",
    )(logits.astype(F32), correction_bias.astype(F32))


def product_and_route(x: jax.Array, kernel: jax.Array, correction_bias: jax.Array, *, top_k: int,
                      norm_topk_prob: bool, routed_scaling_factor: float,
                      interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """The router's product and routing in ONE launch (config key `moe_router_one_launch`): x [N, D] (N <= 16) and
    kernel [D, E] -> (weights [N, k] float32, ids [N, k] int32), as `route_logits` of
    `pallas_gmm.vector_matrix_partials(x, kernel)` (the same partial products, summed in the same order: the same
    result), but the last product program of each token routes it (`vector_matrix_partials`' finish) instead of a
    second kernel after the product's."""
    from MaxText.kernels.grouped_matmul import pallas_gmm  # pylint: disable=import-outside-toplevel
    num_tokens, num_experts = x.shape[0], kernel.shape[-1]
    _check(num_experts, top_k, correction_bias)
    finish = functools.partial(route_token, top_k=top_k, norm_topk_prob=norm_topk_prob,
                               scaling=float(routed_scaling_factor))
    _, weights, ids = pallas_gmm.vector_matrix_partials(
        x, kernel, finish=finish, finish_inputs=(correction_bias.astype(F32),),
        finish_outputs=(jax.ShapeDtypeStruct((num_tokens, top_k), F32),
                        jax.ShapeDtypeStruct((num_tokens, top_k), jnp.int32)), interpret=interpret)
    return weights, ids
