"""Token embedding table (`embed_tokens`)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from MaxText.layers.linears import kernel_init


class Embed(nn.Module):
    """tokens [B, T] int32 -> [B, T, D] in config.dtype. Param: `embedding` [vocab_size, emb_dim].

    Token ids must lie in [0, vocab_size); the engine checks this before any compute (inside jit an out-of-range id
    would be clamped silently).
    """
    config: ml_collections.FrozenConfigDict

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg = self.config
        embedding = self.param("embedding", nn.with_logical_partitioning(kernel_init(cfg), ("vocab", "embed")),
                               (cfg.vocab_size, cfg.emb_dim), jnp.dtype(cfg.weight_dtype))
        return jnp.take(embedding, tokens, axis=0).astype(cfg.dtype)  # [B, T, D]
