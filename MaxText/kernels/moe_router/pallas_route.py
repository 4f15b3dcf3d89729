"""Pallas (Triton lowering) MoE routing for one GPU: sigmoid, correction bias, top-k, normalization and scaling in
one kernel, one program per token (the XLA version is four to six small kernels per MoE layer: sigmoid and bias,
top-k, the gather of the chosen scores, the normalization).

    weights [N, k] f32, ids [N, k] int32 = route_logits(logits [N, E] f32, correction_bias [E], ...)

`logits` may also come as partial sums [S, N, E] (the router's product split over K into S blocks,
`pallas_gmm.vector_matrix_partials`): the kernel adds them up first, so the product needs no reduction of its own.
`product_and_route` runs the product and the routing as one launch: the product's last program for each token
routes it (`route_token`, the same code as the routing kernel's programs).

`norm_and_route` runs the decoder layer's post-attention norm (the residual add too), the product and the routing
as one launch (config key `moe_router_in_norm`): each product program recomputes its token's norm.

Top-k by k rounds of (argmax: the max and the lowest expert id holding it, in one reduction; masked out), then the
chosen scores in one reduction over [k, E]: the experts come out in descending order of their choice value and ties
go to the lower id, as `jax.lax.top_k` orders them (naive.route, the oracle). Ungrouped routing only (n_groups = 1,
Kimi-Linear's), E and k powers of two (Triton block shapes). Runs under `interpret=True` on CPU (the tests do).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from MaxText.kernels import pallas_counts
from MaxText.kernels.grouped_matmul import pallas_gmm
from MaxText.kernels.rms_norm import pallas_norm

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
    ids = jnp.zeros((top_k,), jnp.int32)
    for i in range(top_k):  # one (value, index) reduction a round
        pick = jnp.argmax(choice).astype(jnp.int32)  # the lowest id of the max
        ids = jnp.where(slot == i, pick, ids)
        choice = jnp.where(expert == pick, -jnp.inf, choice)
    weights = jnp.sum(jnp.where(ids[:, None] == expert[None, :], scores[None, :], 0.0), axis=1)  # [k], one reduction
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
    num_tokens, num_experts = x.shape[0], kernel.shape[-1]
    _check(num_experts, top_k, correction_bias)
    finish = functools.partial(route_token, top_k=top_k, norm_topk_prob=norm_topk_prob,
                               scaling=float(routed_scaling_factor))
    _, weights, ids = pallas_gmm.vector_matrix_partials(
        x, kernel, finish=finish, finish_inputs=(correction_bias.astype(F32),),
        finish_outputs=(jax.ShapeDtypeStruct((num_tokens, top_k), F32),
                        jax.ShapeDtypeStruct((num_tokens, top_k), jnp.int32)), interpret=interpret)
    return weights, ids


def _norm_route_kernel(x_ref, update_ref, scale_ref, kernel_ref, bias_ref, _, normed_ref, summed_ref, parts_ref,
                       weights_ref, ids_ref, counts_ref, *, dim, block, epsilon, block_k, block_n, programs_per_row,
                       route_options, interpret):
    """Program (token, column block, K block) of `norm_and_route`: its token's residual sum and 1 / rms over the
    whole row (program (token, 0, 0) stores the sum and the norm), its K block of the norm times the router's
    [block_k, block_n] kernel block (a partial product; the block is read before the rows: 6.1-6.2 µs a launch vs
    6.4-6.5 with it read after the norm, benchmarks/RESULTS.md), then a count; the token's last program routes it."""
    token, col_block, k_block = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    ks = pl.ds(pl.multiple_of(k_block * block_k, block_k), block_k)
    cols = pl.ds(col_block * block_n, block_n)
    weights_block = kernel_ref[ks, cols]  # [BK, BN]: read first, in flight while the rows load and reduce
    summed = pallas_norm.residual_sum(pallas_norm.load_row(x_ref, token, dim, block),
                                      pallas_norm.load_row(update_ref, token, dim, block))  # [block]
    inv = pallas_norm.inverse_rms(summed.astype(F32), dim, epsilon)

    @pl.when((col_block == 0) & (k_block == 0))
    def _store_row():
        inside = jnp.arange(block) < dim
        scale = pltriton.load(scale_ref.at[pl.ds(0, block)], mask=inside, other=0)
        pltriton.store(summed_ref.at[token, pl.ds(0, block)], summed, mask=inside)
        pltriton.store(normed_ref.at[token, pl.ds(0, block)],
                       pallas_norm.scaled_norm(summed.astype(F32), inv, scale, normed_ref.dtype), mask=inside)

    summed_k = pallas_norm.residual_sum(x_ref[token, ks], update_ref[token, ks])  # [BK], as `summed`'s
    normed_k = pallas_norm.scaled_norm(summed_k.astype(F32), inv, scale_ref[ks], normed_ref.dtype)
    parts_ref[k_block, token, cols] = pallas_gmm.block_product(normed_k, weights_block)  # [BN]
    pallas_counts.count_then_finish(
        counts_ref, token, programs_per_row,
        functools.partial(route_token, token, parts_ref, bias_ref, weights_ref, ids_ref, **route_options), interpret)


def norm_and_route(x: jax.Array, update: jax.Array, norm_scale: jax.Array, kernel: jax.Array,
                   correction_bias: jax.Array, *, epsilon: float, top_k: int, norm_topk_prob: bool,
                   routed_scaling_factor: float, counts: jax.Array | None = None, block_k: int = 128,
                   block_n: int = 64, num_warps: int = 4, interpret: bool = False) -> tuple[jax.Array, ...]:
    """The post-attention norm and the router in ONE launch (config key `moe_router_in_norm`): x, update [N, D]
    (N <= 16), norm_scale [D], the router's kernel [D, E] -> (normed [N, D], summed [N, D], weights [N, k] float32,
    ids [N, k] int32): `rms_norm.pallas_norm.add_rms_norm(x, update, norm_scale, epsilon)` and
    `route_logits(pallas_gmm.vector_matrix_partials(normed, kernel), correction_bias, ...)` (the same partial
    products, summed in the same order), with no launch boundary between the norm and the router's product or
    between that product and the routing: each of the product's programs recomputes its token's 1 / rms (a 2 x D
    read) and the norm of its K block, and the token's last program to finish routes it (`route_token`).
    counts [N] int32 zeros: the per-token program counters, left zeroed by the launch (`pallas_counts`) and
    then returned as a fifth result, so that a buffer kept between calls (the decode cache's `route_counts`) serves
    every call with no zeros made and copied before it; default: zeros made for this call. block_k, block_n: the
    product's blocks (as `vector_matrix_partials` picks them); num_warps: each program's (benchmarks/moe_chain.py)."""
    if x.ndim != 2 or update.shape != x.shape or norm_scale.shape != (x.shape[1],):
        raise ValueError(f"expected x and update [N, D] and norm_scale [D], got {x.shape}, {update.shape} and "
                         f"{norm_scale.shape}")
    num_tokens, dim = x.shape
    num_experts = kernel.shape[-1]
    if kernel.shape != (dim, num_experts):
        raise ValueError(f"expected the router's kernel [{dim}, E], got {kernel.shape}")
    _check(num_experts, top_k, correction_bias)
    reason = pallas_gmm.unsupported_reason(x.dtype, dim, num_experts)
    if reason:
        raise ValueError(reason)
    # the product's blocks, as vector_matrix_partials picks them
    block_k, block_n = pallas_gmm.block_for(dim, block_k), pallas_gmm.block_for(num_experts, block_n)
    grid = (num_tokens, num_experts // block_n, dim // block_k)
    given, counts = counts is not None, pallas_counts.counters(counts, (num_tokens,), "counts", "one per token")
    route_options = dict(top_k=top_k, norm_topk_prob=norm_topk_prob, scaling=float(routed_scaling_factor))
    row_type = jax.ShapeDtypeStruct(x.shape, x.dtype)
    normed, summed, _, weights, ids, counts = pl.pallas_call(
        functools.partial(_norm_route_kernel, dim=dim, block=1 << (dim - 1).bit_length(), epsilon=epsilon,
                          block_k=block_k, block_n=block_n, programs_per_row=grid[1] * grid[2],
                          route_options=route_options, interpret=interpret),
        out_shape=(row_type, row_type, jax.ShapeDtypeStruct((grid[2], num_tokens, num_experts), F32),
                   jax.ShapeDtypeStruct((num_tokens, top_k), F32),
                   jax.ShapeDtypeStruct((num_tokens, top_k), jnp.int32), jax.ShapeDtypeStruct(counts.shape, jnp.int32)),
        grid=grid, input_output_aliases={5: 5},
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret, name="norm_and_route",
    )(x, update, norm_scale, kernel, correction_bias.astype(F32), counts)
    return (normed, summed, weights, ids, counts) if given else (normed, summed, weights, ids)
