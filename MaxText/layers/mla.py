"""Multi-head latent attention (MLA) as used by Kimi-Linear: NoPE (no rotary at all), optional q LoRA.

Reads like the math (DESIGN.md §3; reference: HF `KimiLinearAttention`):
    q            = x Wq                      or q_b(RMSNorm(q_a(x))) when q_lora_rank > 0      [B, T, H, nope+rope]
    c, k_rot     = split(x W_kv_a, [kv_lora_rank, rope]);   c = RMSNorm(c)                      the latent
    k_nope, v    = split(c W_kv_b);   k = [k_nope, k_rot broadcast over heads]
    o            = o_proj(softmax_causal(q k^T * (nope+rope)^-0.5) v)

Modes (the conventions' `model_mode`):
  train           full-sequence causal attention over the input; the cache is neither read nor written.
  prefill         writes the new tokens' latents at the cache's write index, then attends (expanded, as above) over
                  every cached position up to each query: several prefill calls continue each other.
  autoregressive  the same cache write, then attention in the latent space: W_kv_b's key half is absorbed into q
                  and its value half into the output, so only the cached (c, k_rot) are read (XLA's einsums or a
                  Pallas flash-decoding kernel, as `mla_kernel` picks: MaxText/kernels/mla).
  verify          (speculative decoding) like autoregressive for T draft tokens, but the write index does not move:
                  `commit_verified(layer_cache, accepted_len)` then advances each row by its accepted count and
                  invalidates the rejected drafts' positions.

Cache (`cache` collection; batch row = decode slot):
  latent     [B, max_target_length, kv_lora_rank + rope]  (c, k_rot) per token, activation dtype
  key_valid  [B, max_target_length] bool                  False for padding and never-written positions
  index      [B] int32                                    next write position per row (rows advance together in
                                                          plain decoding; speculative commits move them apart)
Positions past max_target_length are not checked inside jit (the engine checks lengths before any compute).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from MaxText.kernels import mla as mla_kernels
from MaxText.kernels.mla.naive import masked_softmax, visible_keys
from MaxText.layers.linears import Dense, DenseKernel, matmul_precision, scale_rows
from MaxText.layers.normalizations import RMSNorm

MODEL_MODES = ("train", "prefill", "autoregressive", "verify")
# Logical axes of the cache entries (MaxText/sharding.py shards the cache by them). The latent is shared by all heads,
# so only its rows are split (over the data axis).
CACHE_LOGICAL_AXES = {"latent": ("cache_batch", None, None), "key_valid": ("cache_batch", None),
                      "index": ("cache_batch",)}
HEAD_ACTIVATION_AXES = ("batch", "length", "mla_heads", None)  # q and the attention output: [B, T, H, D]
# HF builds q_a_layernorm and kv_a_layernorm with KimiLinearRMSNorm's default eps, not rms_norm_eps.
LATENT_NORM_EPSILON = 1e-6


def _attention_mask(query_positions, key_valid, segment_ids=None):
    """[B, 1, T, S] bool: key s is visible to query t when it is at or before t and is not padding
    (`mla_kernels.naive.visible_keys`).

    query_positions: [B, T] int32; key_valid: [B, S] bool. segment_ids [B, T] (train mode, where the keys are the
    queries' own tokens, S == T): a key is visible only to queries of its own segment, so documents packed into one
    row do not see each other.
    """
    mask = visible_keys(query_positions, key_valid)[:, None]
    if segment_ids is not None:
        mask &= (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]  # [B, 1, T, T]
    return mask


class MultiHeadLatentAttention(nn.Module):
    """MLA mixer. `__call__(x [B, T, D], model_mode, decoder_segment_ids=None) -> [B, T, D]` in `config.dtype`.

    `decoder_segment_ids` [B, T] int32: 0 marks a padding token, whose key no query may attend to (the cache
    remembers it in `key_valid`). In train mode, tokens attend only within their own segment (packed documents);
    a cache holds one sequence per row, so prefill / decode only distinguish padding from real tokens. Params (HF
    names): q_proj | q_a_proj, q_a_layernorm, q_b_proj; kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj
    [kv_lora_rank, H*(nope+v)], o_proj [H*v, D].
    """
    config: ml_collections.FrozenConfigDict

    @nn.compact
    def __call__(self, x: jax.Array, *, model_mode: str, decoder_segment_ids: jax.Array | None = None,
                 input_row_scale: jax.Array | None = None) -> jax.Array:
        """`input_row_scale` [B, T, 1] float32 (the input norm deferred: RMSNorm(deferred=True)): each projection of
        x is multiplied by it, as if x had been multiplied by it first."""
        cfg = self.config
        if model_mode not in MODEL_MODES:
            raise ValueError(f"model_mode={model_mode!r}; the MLA layer supports {MODEL_MODES}")
        num_heads, nope, rope = cfg.num_query_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        rank, v_dim = cfg.kv_lora_rank, cfg.v_head_dim
        dtype, precision = jnp.dtype(cfg.dtype), matmul_precision(cfg)
        batch, seq_len, _ = x.shape

        # Queries: the projection q_unscaled [B, T, H * (nope + rope)], then times q_scale (the deferred input norm).
        if cfg.q_lora_rank:
            q_a = scale_rows(Dense(cfg, cfg.q_lora_rank, ("embed", None), name="q_a_proj")(x), input_row_scale)
            q_a = RMSNorm(cfg, LATENT_NORM_EPSILON, None, name="q_a_layernorm")(q_a)
            q_unscaled = Dense(cfg, num_heads * (nope + rope), (None, "mla_heads"), name="q_b_proj")(q_a)
            q_scale = None
        else:
            q_unscaled = Dense(cfg, num_heads * (nope + rope), ("embed", "mla_heads"), name="q_proj")(x)
            q_scale = input_row_scale
        q = scale_rows(q_unscaled, q_scale)
        q = nn.with_logical_constraint(q.reshape(batch, seq_len, num_heads, nope + rope), HEAD_ACTIVATION_AXES)
        q_nope, q_rope = q[..., :nope], q[..., nope:]  # [B, T, H, nope], [B, T, H, rope]

        # The compressed latent of the new tokens: (normalized c, k_rot).
        kv_a = scale_rows(Dense(cfg, rank + rope, ("embed", "mla_latent"), name="kv_a_proj_with_mqa")(x),
                          input_row_scale)  # [B, T, R + rope]
        c = RMSNorm(cfg, LATENT_NORM_EPSILON, None, name="kv_a_layernorm")(kv_a[..., :rank])
        latent = jnp.concatenate([c, kv_a[..., rank:]], axis=-1)  # [B, T, R + rope]
        new_valid = (jnp.ones((batch, seq_len), jnp.bool_) if decoder_segment_ids is None
                     else decoder_segment_ids != 0)  # [B, T]
        kv_b_kernel = DenseKernel(cfg, (rank, num_heads * (nope + v_dim)), (None, "mla_heads"), name="kv_b_proj")()
        w_kv_b = kv_b_kernel.reshape(rank, num_heads, nope + v_dim)
        w_uk, w_uv = w_kv_b[..., :nope], w_kv_b[..., nope:]  # [R, H, nope], [R, H, v]

        # Keys: the input itself (train), or every cache position after writing the new tokens.
        if model_mode == "train":
            keys, key_valid, start = latent, new_valid, jnp.zeros((batch,), jnp.int32)
        else:
            keys, key_valid, start = self._update_cache(latent, new_valid, advance=model_mode != "verify")
        query_positions = start[:, None] + jnp.arange(seq_len, dtype=jnp.int32)  # [B, T]
        scale = (nope + rope) ** -0.5

        if model_mode in ("autoregressive", "verify"):
            # Latent space: q_nope . (c W_uk) == (q_nope W_uk^T) . c, and (p c) W_uv == p (c W_uv); the absorbed
            # query and the attention over the latent cache run as `mla_kernel` picks (MaxText/kernels/mla).
            implementation = mla_kernels.resolve(cfg.mla_kernel, dtype, rank, rope, keys.shape[1])
            if mla_kernels.absorb_in_kernel(implementation, cfg.dense_kernel_layout, nope, rope, rank,
                                            batch * seq_len):
                # kv_b_kernel.T is the param as stored: XLA reads it in place.
                q_latent, q_rope = mla_kernels.absorb_query(q_unscaled, q_scale, kv_b_kernel.T, num_heads=num_heads,
                                                            nope=nope, v_dim=v_dim)  # [B, T, H, R], [B, T, H, rope]
            else:
                q_latent = jnp.einsum("bthn,rhn->bthr", q_nope, w_uk, precision=precision)  # [B, T, H, R]
            out_latent = mla_kernels.latent_attention(q_latent, q_rope, keys, query_positions, key_valid,
                                                      scale=scale, implementation=implementation,
                                                      precision=precision)  # [B, T, H, R]
            out = jnp.einsum("bthr,rhv->bthv", out_latent, w_uv, precision=precision)  # [B, T, H, v]
        else:
            mask = _attention_mask(query_positions, key_valid,
                                   decoder_segment_ids if model_mode == "train" else None)  # [B, 1, T, S]
            keys_c, keys_rot = keys[..., :rank], keys[..., rank:]  # [B, S, R], [B, S, rope]
            k_nope = jnp.einsum("bsr,rhn->bshn", keys_c, w_uk, precision=precision)  # [B, S, H, nope]
            values = jnp.einsum("bsr,rhv->bshv", keys_c, w_uv, precision=precision)  # [B, S, H, v]
            scores = (jnp.einsum("bthn,bshn->bhts", q_nope, k_nope, precision=precision)
                      + jnp.einsum("bthp,bsp->bhts", q_rope, keys_rot, precision=precision)) * scale
            weights = masked_softmax(scores, mask, dtype)  # [B, H, T, S]
            out = jnp.einsum("bhts,bshv->bthv", weights, values, precision=precision)  # [B, T, H, v]

        out = nn.with_logical_constraint(out, HEAD_ACTIVATION_AXES).reshape(batch, seq_len, num_heads * v_dim)
        return Dense(cfg, cfg.emb_dim, ("mla_heads", "embed"), name="o_proj")(out)

    def _update_cache(self, latent, new_valid, advance: bool):
        """Writes the new tokens at each row's write index, which moves past them when `advance`.

        Returns (all cached latents [B, S, R + rope], their validity [B, S], the old write index [B]).
        """
        cfg = self.config
        batch, seq_len, width = latent.shape
        cached = self.variable("cache", "latent", jnp.zeros, (batch, cfg.max_target_length, width), latent.dtype)
        valid = self.variable("cache", "key_valid", jnp.zeros, (batch, cfg.max_target_length), jnp.bool_)
        index = self.variable("cache", "index", jnp.zeros, (batch,), jnp.int32)
        start = index.value  # [B]
        keys = jax.vmap(lambda row, new, at: jax.lax.dynamic_update_slice_in_dim(row, new, at, axis=0))(
            cached.value, latent.astype(cached.value.dtype), start)
        key_valid = jax.vmap(lambda row, new, at: jax.lax.dynamic_update_slice_in_dim(row, new, at, axis=0))(
            valid.value, new_valid, start)
        if not self.is_initializing():
            cached.value = nn.with_logical_constraint(keys, CACHE_LOGICAL_AXES["latent"])
            valid.value = nn.with_logical_constraint(key_valid, CACHE_LOGICAL_AXES["key_valid"])
            if advance:
                index.value = start + seq_len
        return keys, key_valid, start


def commit_verified(layer_cache, accepted_len):
    """The MLA cache after a 'verify' call, as if only the first `accepted_len[b]` draft tokens had been decoded.

    layer_cache: {latent, key_valid, index}; accepted_len: [B] int32 in [0, T]. Each row's write index advances by its
    accepted count and the rejected drafts' positions become invalid (their latents stay, never attended to, and are
    overwritten by the next write). Nothing is copied.
    """
    cache = dict(layer_cache)
    cache["index"] = cache["index"] + accepted_len
    positions = jnp.arange(cache["key_valid"].shape[1], dtype=jnp.int32)
    cache["key_valid"] = cache["key_valid"] & (positions[None, :] < cache["index"][:, None])
    return cache
