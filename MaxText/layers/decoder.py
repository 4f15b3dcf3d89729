"""One Kimi-Linear decoder layer: x += mixer(input_layernorm(x)); x += mlp(post_attention_layernorm(x)).

When decoding (model_mode 'autoregressive' or 'verify') with `input_norm_after_projections` the input norm is
deferred: the mixer projects input_layernorm.scale * x and multiplies each projection by 1 / rms(x)
(RMSNorm(deferred=True)); speculative verify and one-token decode round alike.

The first residual add is the post-attention norm's (`RMSNorm(x, update=...)`: one kernel with `norm_adds_residual`);
both adds round as `residual_add` defines. With `moe_router_in_norm` (one-token decode where the norm's and the
router's Pallas kernels run: `moe.routes_in_post_norm`) that launch also routes the MoE's tokens; its per-token
program counters live in the layer's decode cache (`route_counts` [B] int32, created with the cache where the key
is set), which the launch leaves zeroed for the next step.

The mixer is KDA or MLA and the MLP dense SwiGLU or MoE, as `config.layer_types[i]` / `config.mlp_types[i]` say.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from MaxText.kernels.rms_norm.naive import residual_add
from MaxText.layers.kda import KimiDeltaAttention
from MaxText.layers.linears import MLP
from MaxText.layers.mla import MultiHeadLatentAttention
from MaxText.layers.moe import MoE, routes_in_post_norm
from MaxText.layers.normalizations import RMSNorm

ACTIVATION_AXES = ("batch", "length", "embed")
DEFERRED_NORM_MODES = ("autoregressive", "verify")  # where input_norm_after_projections applies
CACHE_LOGICAL_AXES = {"route_counts": ("cache_batch",)}  # MaxText/sharding.py shards the cache by them


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
        parts = {}
        if deferred and mixer_kind == "kda" and cfg.kda_decode_one_launch and not self.is_initializing():
            # the residual row and the norm's scale, for KDA's one-launch decode (which then drops h and row_scale)
            parts = {"input_norm_parts": (x, nn.meta.unbox(self.variables["params"])["input_layernorm"]["scale"])}
        mixed = mixer(h, model_mode=model_mode, decoder_segment_ids=decoder_segment_ids, input_row_scale=row_scale,
                      **parts)
        post_attention_norm = RMSNorm(cfg, name="post_attention_layernorm")
        route_counts = (self.variable("cache", "route_counts", jnp.zeros, (x.shape[0],), jnp.int32)
                        if mlp_kind == "moe" and cfg.moe_router_in_norm and model_mode != "train" else None)
        if (route_counts is not None and model_mode == "autoregressive" and not self.is_initializing()
                and routes_in_post_norm(cfg, math.prod(x.shape[:-1]), x.shape[-1], x.dtype)):
            h, x, routing = self._norm_and_route(x, mixed, route_counts)  # x += mixed, its norm, routing: 1 launch
        else:
            (h, x), routing = post_attention_norm(x, update=mixed), None  # x += mixed, then its norm
        x = nn.with_logical_constraint(x, ACTIVATION_AXES)
        x = residual_add(x, mlp(h) if routing is None else mlp(h, routing=routing))
        return nn.with_logical_constraint(x, ACTIVATION_AXES)

    def _norm_and_route(self, x: jax.Array, update: jax.Array, route_counts):
        """`moe_router_in_norm` (where `routes_in_post_norm`): the post-attention norm of x + update and the MoE's
        routing of it in one launch (`pallas_route.norm_and_route`), with the norm's scale and the router's params
        read from this layer's params (post_attention_layernorm/scale, mlp/gate/*: their modules are not called),
        and its counters from the cache variable `route_counts` (one token per row; zeros made for the call where
        a row has several). Returns (normed, summed [B, T, D], (weights, expert ids [B*T, k]))."""
        from MaxText.kernels.moe_router import pallas_route  # pylint: disable=import-outside-toplevel
        cfg = self.config
        params = nn.meta.unbox(self.variables["params"])
        gate = params["mlp"]["gate"]
        rows = x.reshape(-1, x.shape[-1])  # [N, D]
        one_per_row = rows.shape[0] == x.shape[0]
        normed, summed, weights, ids, *counts = pallas_route.norm_and_route(
            rows, update.reshape(rows.shape), params["post_attention_layernorm"]["scale"], gate["kernel"],
            gate["e_score_correction_bias"], epsilon=cfg.normalization_layer_epsilon, top_k=cfg.num_experts_per_tok,
            norm_topk_prob=cfg.norm_topk_prob, routed_scaling_factor=cfg.routed_scaling_factor,
            counts=route_counts.value if one_per_row else None)
        if one_per_row:
            route_counts.value = counts[0]  # zero again, the same buffer (aliased: donate the cache to the step)
        return normed.reshape(x.shape), summed.reshape(x.shape), (weights, ids)
