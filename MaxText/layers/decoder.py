"""One Kimi-Linear decoder layer: x += mixer(input_layernorm(x)); x += mlp(post_attention_layernorm(x)).

When decoding (model_mode 'autoregressive' or 'verify') with `input_norm_after_projections` the input norm is
deferred: the mixer projects input_layernorm.scale * x and multiplies each projection by 1 / rms(x)
(RMSNorm(deferred=True)); speculative verify and one-token decode round alike.

The first residual add is the post-attention norm's (`RMSNorm(x, update=...)`: one kernel with `norm_adds_residual`);
both adds round as `residual_add` defines.

The mixer is KDA or MLA and the MLP dense SwiGLU or MoE, as `config.layer_types[i]` / `config.mlp_types[i]` say.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import ml_collections

from MaxText.kernels.rms_norm.naive import residual_add
from MaxText.layers.kda import KimiDeltaAttention
from MaxText.layers.linears import MLP
from MaxText.layers.mla import MultiHeadLatentAttention
from MaxText.layers.moe import MoE
from MaxText.layers.normalizations import RMSNorm

ACTIVATION_AXES = ("batch", "length", "embed")
DEFERRED_NORM_MODES = ("autoregressive", "verify")  # where input_norm_after_projections applies


class DecoderLayer(nn.Module):
    """Layer `layer_index` (0-indexed). `__call__(x [B, T, D], model_mode, decoder_segment_ids=None) -> [B, T, D]`."""
    config: ml_collections.FrozenConfigDict
    layer_index: int

    @nn.compact
    def __call__(self, x: jax.Array, *, model_mode: str, decoder_segment_ids: jax.Array | None = None) -> jax.Array:
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

        # With input_norm_after_projections (decoding) the mixer's projections take scale * x and multiply their
        # outputs by the norm's 1/rms, so that they do not wait for the norm's reduction.
        deferred = cfg.input_norm_after_projections and model_mode in DEFERRED_NORM_MODES
        input_norm = RMSNorm(cfg, name="input_layernorm")
        h, row_scale = input_norm(x, deferred=True) if deferred else (input_norm(x), None)
        mixed = mixer(h, model_mode=model_mode, decoder_segment_ids=decoder_segment_ids, input_row_scale=row_scale)
        h, x = RMSNorm(cfg, name="post_attention_layernorm")(x, update=mixed)  # x += mixed, then its norm
        x = nn.with_logical_constraint(x, ACTIVATION_AXES)
        x = residual_add(x, mlp(h))
        return nn.with_logical_constraint(x, ACTIVATION_AXES)
