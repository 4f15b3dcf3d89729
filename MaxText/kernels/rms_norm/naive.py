"""The oracle: HF `KimiLinearRMSNorm` in plain JAX."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, scale: jax.Array, epsilon: float) -> jax.Array:
    """x [..., D], scale [D] -> scale * (x / sqrt(mean(x^2) + epsilon)) [..., D] in x's dtype: normalized in float32,
    cast to x's dtype, then times scale cast to x's dtype (HF semantics)."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + epsilon)
    return scale.astype(x.dtype) * normed.astype(x.dtype)


def as_terms(update) -> tuple:
    """An update as a tuple of terms (rows, weights): an array [..., D] is one term (update, None)."""
    return ((update, None),) if isinstance(update, jax.Array) else tuple(update)


def combine_terms(update, dtype) -> jax.Array:
    """The residual update [..., D] in `dtype` that `update` stands for: an array, or terms (rows, weights), each
    rows [..., D] (weights None) or weighted rows [..., R, D] with weights [..., R] summed in float32 (the MoE's
    experts). Each term is rounded to `dtype`, then the terms are added in order in `dtype` (the MoE's routed sum,
    then its shared expert)."""
    total = None
    for rows, weights in as_terms(update):
        if weights is None:
            term = rows.astype(dtype)
        else:
            term = jnp.einsum("...rd,...r->...d", rows.astype(jnp.float32), weights.astype(jnp.float32),
                              precision=jax.lax.Precision.HIGHEST).astype(dtype)
        total = term if total is None else total + term
    return total


def add_rms_norm(x: jax.Array, update, scale: jax.Array, epsilon: float) -> tuple[jax.Array, jax.Array]:
    """The residual stream's add, then its norm: summed = x + combine_terms(update) in x's dtype (as the decoder's
    `x = x + block(h)`), returns (rms_norm(summed, scale, epsilon), summed). update: an array [..., D] or terms."""
    summed = x + combine_terms(update, x.dtype)
    return rms_norm(summed, scale, epsilon), summed
