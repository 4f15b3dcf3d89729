"""MoE routing (config key `moe_router_kernel`): the router's logits -> each token's top-k experts and weights.

    weights, ids = route_logits(logits, correction_bias, top_k=8, n_groups=1, top_k_groups=1, norm_topk_prob=True,
                                routed_scaling_factor=2.446, implementation="xla")
    logits [N, E] float32 (x W_router), correction_bias [E]  ->  weights [N, k] float32, ids [N, k] int32

    scores = sigmoid(logits); choice = scores + correction_bias (chooses only); top-k of choice (within the kept
    groups); weights = the chosen scores, normalized (norm_topk_prob) and times routed_scaling_factor.

Implementations:
  xla     naive.route, the oracle: plain JAX, any backend, group-limited routing.
  pallas  pallas_route.py: one Triton kernel for all of it, one program per token (NVIDIA GPU, no multi-device mesh;
          n_groups = 1, E and k powers of two). H200, Kimi-Linear-48B batch-1 decode: 3.675 vs 3.831 ms per token.
  auto    pallas where it runs, else xla (one log line); the default.
"""

from __future__ import annotations

import jax

from MaxText.kernels.grouped_matmul import pallas_kernel_reason, pallas_or_fallback
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


def route_logits(logits: jax.Array, correction_bias: jax.Array, *, top_k: int, n_groups: int, top_k_groups: int,
                 norm_topk_prob: bool, routed_scaling_factor: float,
                 implementation: str = "xla") -> tuple[jax.Array, jax.Array]:
    """See the module docstring."""
    if resolve(implementation, logits.shape[-1], top_k, n_groups) == "pallas":
        from MaxText.kernels.moe_router import pallas_route  # pylint: disable=import-outside-toplevel
        return pallas_route.route_logits(logits, correction_bias, top_k=top_k, norm_topk_prob=norm_topk_prob,
                                         routed_scaling_factor=routed_scaling_factor)
    return route(jax.nn.sigmoid(logits), correction_bias, top_k=top_k, n_groups=n_groups, top_k_groups=top_k_groups,
                 norm_topk_prob=norm_topk_prob, routed_scaling_factor=routed_scaling_factor)
