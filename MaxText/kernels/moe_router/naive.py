"""The oracle: group-limited top-k routing in plain JAX (any backend, any expert count)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def route(scores: jax.Array, correction_bias: jax.Array, *, top_k: int, n_groups: int, top_k_groups: int,
          norm_topk_prob: bool, routed_scaling_factor: float) -> tuple[jax.Array, jax.Array]:
    """Group-limited top-k routing. scores: [N, E] float32 sigmoid scores; correction_bias: [E].

    Returns (weights [N, k] float32, expert ids [N, k] int32), the experts in descending order of their choice
    value (ties: the lower expert id first, as `jax.lax.top_k`).
    """
    num_tokens, num_experts = scores.shape
    choice = scores + correction_bias.astype(jnp.float32)[None, :]  # [N, E]
    if n_groups > 1:
        grouped = choice.reshape(num_tokens, n_groups, num_experts // n_groups)  # [N, G, E/G]
        group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [N, G]
        _, kept_groups = jax.lax.top_k(group_scores, top_k_groups)  # [N, top_k_groups]
        group_kept = jnp.zeros((num_tokens, n_groups), jnp.bool_).at[
            jnp.arange(num_tokens)[:, None], kept_groups].set(True)  # [N, G]
        choice = jnp.where(group_kept[:, :, None], grouped, -jnp.inf).reshape(num_tokens, num_experts)
    _, expert_ids = jax.lax.top_k(choice, top_k)  # [N, k]
    weights = jnp.take_along_axis(scores, expert_ids, axis=-1)  # [N, k], the scores without the bias
    if norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * routed_scaling_factor, expert_ids.astype(jnp.int32)
