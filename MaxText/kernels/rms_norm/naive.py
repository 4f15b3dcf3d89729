"""The oracle: HF `KimiLinearRMSNorm` in plain JAX."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def inverse_rms(x: jax.Array, epsilon: float) -> jax.Array:
    """x [..., D] -> 1 / sqrt(mean(x^2) + epsilon) [..., 1] in float32: the factor that normalizes each row."""
    x32 = x.astype(jnp.float32)
    return jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + epsilon)


def rms_norm(x: jax.Array, scale: jax.Array, epsilon: float) -> jax.Array:
    """x [..., D], scale [D] -> scale * (x / sqrt(mean(x^2) + epsilon)) [..., D] in x's dtype: normalized in float32,
    cast to x's dtype, then times scale cast to x's dtype (HF semantics)."""
    normed = x.astype(jnp.float32) * inverse_rms(x, epsilon)
    return scale.astype(x.dtype) * normed.astype(x.dtype)


def residual_add(x: jax.Array, update: jax.Array) -> jax.Array:
    """The residual stream's add: x + update, update cast to x's dtype and the sum in x's dtype (the decoder's
    `x = x + mixer(h)`)."""
    return x + update.astype(x.dtype)


def add_rms_norm(x: jax.Array, update: jax.Array, scale: jax.Array, epsilon: float) -> tuple[jax.Array, jax.Array]:
    """The residual stream's add, then its norm: returns (rms_norm(summed, scale, epsilon), summed) for
    summed = residual_add(x, update)."""
    summed = residual_add(x, update)
    return rms_norm(summed, scale, epsilon), summed
