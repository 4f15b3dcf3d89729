"""One Kimi-Linear decoder layer: x += mixer(input_layernorm(x)); x += mlp(post_attention_layernorm(x)).

Each residual add is the following norm's (`RMSNorm(x, update=...)`, one Pallas kernel with `norm_adds_residual`):
the mixer's output is added by the post-attention norm, and the MLP's (the MoE's as its terms: expert rows, router
weights, shared expert) by the next layer's input norm or the model's final norm. So a layer takes and returns the
residual stream with the previous MLP's output not yet added (vLLM's `residual` convention).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import ml_collections

from MaxText.layers.kda import KimiDeltaAttention
from MaxText.layers.linears import MLP
from MaxText.layers.mla import MultiHeadLatentAttention
from MaxText.layers.moe import MoE
from MaxText.layers.normalizations import RMSNorm

ACTIVATION_AXES = ("batch", "length", "embed")


class DecoderLayer(nn.Module):
    """Layer `layer_index` (0-indexed). `__call__(x [B, T, D], model_mode, decoder_segment_ids=None) -> [B, T, D]`."""
    config: ml_collections.FrozenConfigDict
    layer_index: int

    @nn.compact
    def __call__(self, x: jax.Array, update=None, *, model_mode: str, decoder_segment_ids: jax.Array | None = None):
        """x [B, T, D], update: the previous layer's MLP output not yet added to x (None for the first layer) ->
        (x, update) of this layer: x with the previous update and this mixer's output added, the MLP's output."""
        cfg = self.config
        mixer_kind, mlp_kind = cfg.layer_types[self.layer_index], cfg.mlp_types[self.layer_index]
        if mixer_kind == "kda":
            mixer = KimiDeltaAttention(cfg, name="self_attn")
        elif mixer_kind == "mla":
            mixer = MultiHeadLatentAttention(cfg, name="self_attn")
        else:
            raise ValueError(f"layer_types[{self.layer_index}]={mixer_kind!r}; expected 'kda' or 'mla'")
        if mlp_kind == "dense":
            mlp = MLP(cfg, cfg.mlp_dim, name="mlp")
        elif mlp_kind == "moe":
            mlp = MoE(cfg, name="mlp")
        else:
            raise ValueError(f"mlp_types[{self.layer_index}]={mlp_kind!r}; expected 'dense' or 'moe'")

        input_norm = RMSNorm(cfg, name="input_layernorm")
        if update is None:
            h = input_norm(x)
        else:
            h, x = input_norm(x, update=update)  # x += the previous MLP's output, then its norm
            x = nn.with_logical_constraint(x, ACTIVATION_AXES)
        mixed = mixer(h, model_mode=model_mode, decoder_segment_ids=decoder_segment_ids)
        h, x = RMSNorm(cfg, name="post_attention_layernorm")(x, update=mixed)  # x += mixed, then its norm
        x = nn.with_logical_constraint(x, ACTIVATION_AXES)
        return x, (mlp(h, summed=False) if mlp_kind == "moe" else mlp(h))
