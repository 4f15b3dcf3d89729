"""The oracle: MLA's attention in the latent space (decode / verify) in plain JAX, and the masked softmax that
every MLA mode uses."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def visible_keys(query_positions: jax.Array, key_valid: jax.Array) -> jax.Array:
    """[B, T, S] bool: cache position s is visible to query t when it is at or before the query's position and
    holds a real token. query_positions [B, T] int32; key_valid [B, S] bool."""
    key_positions = jnp.arange(key_valid.shape[1], dtype=jnp.int32)
    return (key_positions[None, None, :] <= query_positions[:, :, None]) & key_valid[:, None, :]


def masked_softmax(scores: jax.Array, mask: jax.Array, dtype) -> jax.Array:
    """Softmax over the last axis in float32 with masked keys at exactly zero weight; result cast to `dtype`.

    A query that sees no key at all (a padding query in a left-padded row) gets zero weights, not NaN.
    """
    scores = jnp.where(mask, scores.astype(jnp.float32), -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    weights = jnp.exp(scores - jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    weights = weights / jnp.maximum(jnp.sum(weights, axis=-1, keepdims=True), jnp.finfo(jnp.float32).tiny)
    return weights.astype(dtype)


def latent_attention(q_latent: jax.Array, q_rope: jax.Array, keys: jax.Array, query_positions: jax.Array,
                     key_valid: jax.Array, *, scale: float, precision=None) -> jax.Array:
    """softmax(q_latent . c + q_rope . k_rot) c over the visible cache positions (`visible_keys`).

    q_latent [B, T, H, R] (q_nope with W_kv_b's key half absorbed), q_rope [B, T, H, P], keys [B, S, R + P] (the
    cache: normalized latent c, then k_rot) -> out_latent [B, T, H, R] in q_latent's dtype (W_kv_b's value half is
    applied by the caller). Products in the inputs' dtype (XLA's einsums at `precision`), softmax in float32.
    """
    rank = q_latent.shape[-1]
    keys_c, keys_rot = keys[..., :rank], keys[..., rank:]  # [B, S, R], [B, S, P]
    scores = (jnp.einsum("bthr,bsr->bhts", q_latent, keys_c, precision=precision)
              + jnp.einsum("bthp,bsp->bhts", q_rope, keys_rot, precision=precision)) * scale
    weights = masked_softmax(scores, visible_keys(query_positions, key_valid)[:, None], q_latent.dtype)  # [B,H,T,S]
    return jnp.einsum("bhts,bsr->bthr", weights, keys_c, precision=precision)
