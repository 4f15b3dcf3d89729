"""MoE routing (config key `moe_router_kernel`): tokens and the router's kernel -> each token's top-k experts and
weights.

    weights, ids = route_tokens(x, kernel, correction_bias, top_k=8, n_groups=1, top_k_groups=1,
                                norm_topk_prob=True, routed_scaling_factor=2.446, implementation="xla")
    x [N, D], kernel [D, E] (any float dtype; multiplied in float32), correction_bias [E]
        ->  weights [N, k] float32, ids [N, k] int32

    logits = x W (float32); scores = sigmoid(logits); choice = scores + correction_bias (chooses only); top-k of
    choice (within the kept groups); weights = the chosen scores, normalized (norm_topk_prob) and times
    routed_scaling_factor.

Implementations:
  xla     `jnp.dot` at HIGHEST precision, then naive.route, the oracle: plain JAX, any backend, group-limited routing
          (on a GPU: the kernel's float32 copy, the product, and 4-6 small routing kernels per MoE layer).
  pallas  pallas_route.py: one Triton kernel for the routing, one program per token (NVIDIA GPU, no multi-device
          mesh; n_groups = 1, E and k powers of two). For at most ROWWISE_MAX_ROWS (16) tokens (decode) the
          product is one Pallas launch too (`pallas_gmm.vector_matrix_partials`: float32 products of the kernel as
          stored, one partial sum per block of D, which the routing kernel adds up): two kernels per MoE layer, or
          one with `one_launch` (config key `moe_router_one_launch`: the product's last program per token routes
          it, `pallas_route.product_and_route`).
          H200, Kimi-Linear-48B batch-1 decode: 3.675 vs 3.831 ms per token with the routing kernel alone.
  auto    pallas where it runs, else xla (one log line); the default.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from MaxText.kernels.grouped_matmul import ROWWISE_MAX_ROWS, pallas_kernel_reason, pallas_or_fallback
from MaxText.kernels.moe_router.naive import route

CHOICES = ("auto", "xla", "pallas")


def pallas_unavailable_reason(num_experts: int, top_k: int, n_groups: int) -> str | None:
    """Why the Pallas router cannot run here (None when it can)."""
    return pallas_kernel_reason("Pallas router", "MaxText.kernels.moe_router.pallas_route", num_experts, top_k,
                                n_groups)


def resolve(implementation: str, num_experts: int, top_k: int, n_groups: int) -> str:
    """Maps a `moe_router_kernel` value to 'xla' | 'pallas' for this routing."""
    if implementation not in CHOICES:
        raise ValueError(f"moe_router_kernel={implementation!r} is unknown; choose one of {CHOICES}")
    if implementation == "xla":
        return "xla"
    return pallas_or_fallback("moe_router_kernel", implementation,
                              pallas_unavailable_reason(num_experts, top_k, n_groups), "xla", "auto or xla")


def route_tokens(x: jax.Array, kernel: jax.Array, correction_bias: jax.Array, *, top_k: int, n_groups: int,
                 top_k_groups: int, norm_topk_prob: bool, routed_scaling_factor: float,
                 implementation: str = "xla", one_launch: bool = False) -> tuple[jax.Array, jax.Array]:
    """See the module docstring. one_launch: the Pallas product and routing of at most ROWWISE_MAX_ROWS tokens in
    one launch (`pallas_route.product_and_route`; config key `moe_router_one_launch`)."""
    num_tokens, dim = x.shape
    options = dict(top_k=top_k, norm_topk_prob=norm_topk_prob, routed_scaling_factor=routed_scaling_factor)
    if resolve(implementation, kernel.shape[-1], top_k, n_groups) == "pallas":
        # pylint: disable=import-outside-toplevel
        from MaxText.kernels.grouped_matmul import pallas_gmm
        from MaxText.kernels.moe_router import pallas_route
        rows_grid = num_tokens <= ROWWISE_MAX_ROWS and pallas_gmm.unsupported_reason(x.dtype, dim,
                                                                                      kernel.shape[-1]) is None
        if rows_grid and one_launch:
            return pallas_route.product_and_route(x, kernel, correction_bias, **options)
        if rows_grid:
            # [D / 128, N, E] partial sums of float32 products of x and the kernel as stored: a bf16 x is read as it
            # is (no float32 copy of it made before the launch)
            logits = pallas_gmm.vector_matrix_partials(x, kernel)
        else:
            logits = _logits(x, kernel)
        return pallas_route.route_logits(logits, correction_bias, **options)
    return route(jax.nn.sigmoid(_logits(x, kernel)), correction_bias, n_groups=n_groups, top_k_groups=top_k_groups,
                 **options)


def _logits(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """x [N, D] @ kernel [D, E] in float32 (HIGHEST: no bf16 / tf32 passes) -> [N, E]."""
    return jnp.dot(x.astype(jnp.float32), kernel.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
