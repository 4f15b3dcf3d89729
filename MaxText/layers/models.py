"""The full Kimi-Linear causal LM: embed_tokens -> decoder layers -> final norm -> untied lm_head."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from MaxText.layers import kda, mla
from MaxText.layers.decoder import ACTIVATION_AXES, DecoderLayer
from MaxText.layers.embeddings import Embed
from MaxText.layers.linears import Dense
from MaxText.layers.normalizations import RMSNorm


class KimiLinearModel(nn.Module):
    """The decoder stack (HF `model.*`): tokens [B, T] int32 -> final-normed hidden states [B, T, D]."""
    config: ml_collections.FrozenConfigDict

    @nn.compact
    def __call__(self, tokens: jax.Array, *, model_mode: str, decoder_segment_ids: jax.Array | None = None):
        cfg = self.config
        x = nn.with_logical_constraint(Embed(cfg, name="embed_tokens")(tokens), ACTIVATION_AXES)  # [B, T, D]
        for i in range(cfg.num_decoder_layers):
            x = DecoderLayer(cfg, i, name=f"layers_{i}")(x, model_mode=model_mode,
                                                          decoder_segment_ids=decoder_segment_ids)
        return RMSNorm(cfg, name="norm")(x)


class KimiLinearForCausalLM(nn.Module):
    """Params: model/{embed_tokens, layers_i, norm}, lm_head (see the conventions for the full tree).

    `__call__(tokens [B, T] int32, *, model_mode, decoder_segment_ids=None, logits_to_keep=0)
        -> logits [B, T, vocab] float32` ([B, logits_to_keep, vocab] when logits_to_keep > 0: only the last positions
        go through lm_head, as HF's `logits_to_keep`).
    model_mode: 'train' (no cache) | 'prefill' | 'autoregressive' (read and write the `cache` collection, which must
    be mutable) | 'verify' (score T draft tokens without committing them: follow with `commit_verified_cache`).
    decoder_segment_ids [B, T]: 0 marks a (left-)padding token, > 0 a real one.
    """
    config: ml_collections.FrozenConfigDict

    @nn.compact
    def __call__(self, tokens: jax.Array, *, model_mode: str, decoder_segment_ids: jax.Array | None = None,
                 logits_to_keep: int = 0):
        cfg = self.config
        hidden = KimiLinearModel(cfg, name="model")(tokens, model_mode=model_mode,
                                                     decoder_segment_ids=decoder_segment_ids)
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        logits = Dense(cfg, cfg.vocab_size, ("embed", "vocab"), name="lm_head")(hidden)  # [B, T, V]
        return logits.astype(jnp.float32)


def init_cache(config: ml_collections.FrozenConfigDict, batch: int, state_slots: int = 1):
    """The zero decode cache (`cache` collection) for `batch` rows, as a prefill from no cache would create it, with
    `state_slots` KDA state-ring slots per row: 1 for plain decoding, `kda.verify_state_slots(T)` = T + 1 for
    speculative decoding that verifies T tokens per 'verify' call (every state slot is zero, state_slot 0).

    Usable inside jit (shapes are computed abstractly; only the zeros are materialized).
    """
    if isinstance(state_slots, bool) or not isinstance(state_slots, int) or state_slots < 1:
        raise ValueError(f"state_slots={state_slots!r}; it must be an int >= 1")
    model = KimiLinearForCausalLM(config)
    abstract = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((batch, 1), jnp.int32),
                                                 model_mode="prefill")["cache"])
    return kda.zero_cache(abstract, state_slots)


def commit_verified_cache(config: ml_collections.FrozenConfigDict, cache, accepted_len: jax.Array):
    """The model's cache after a model_mode='verify' call, committed to the first `accepted_len[b]` verified tokens.

    cache: the `cache` collection the 'verify' call returned; accepted_len: [B] int32 in [0, T] (0 leaves a row as it
    was before the call). A pure function: the result equals the cache of decoding only the accepted tokens (KDA: the
    row's committed ring slot moves to the accepted token's checkpoint, no state is copied; MLA: per-row write index
    and validity), with the verify-only entries removed, so it has the structure of a prefill / autoregressive cache.
    """
    commit = {"kda": kda.commit_verified, "mla": mla.commit_verified}
    return _map_attention_caches(config, cache, lambda kind, name, attn: commit[kind](attn, accepted_len))


def rewind_cache(config: ml_collections.FrozenConfigDict, advanced, committed):
    """The cache `committed`, assembled without copying its large buffers from `advanced`: the same cache after at
    most S - 1 one-token 'verify' + `commit_verified_cache` steps (a scratch continuation, e.g. a draft model's
    proposal, S = the KDA ring's slots). Those steps wrote KDA states only into ring slots after each row's committed
    slot, and MLA latents only at or past each row's write index (positions the next 'verify' rewrites before it
    reads them), so the KDA rings and MLA latents are taken from `advanced` and every row's position (conv window,
    ring slot, MLA index and validity) from `committed`.
    """
    advanced_buffer = {"kda": "recurrent_state", "mla": "latent"}

    def take_buffer(kind, name, attn):
        buffer = advanced_buffer[kind]
        return {**attn, buffer: advanced["model"][name]["self_attn"][buffer]}

    return _map_attention_caches(config, committed, take_buffer)


def _map_attention_caches(config: ml_collections.FrozenConfigDict, cache, fn):
    """`cache` with each layer's attention cache replaced by fn(layer kind 'kda' | 'mla', 'layers_i', that cache)."""
    layers = dict(cache["model"])
    for i, kind in enumerate(config.layer_types):
        name = f"layers_{i}"
        layers[name] = {**layers[name], "self_attn": fn(kind, name, layers[name]["self_attn"])}
    return {**cache, "model": layers}
