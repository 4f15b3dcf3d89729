"""DeepSeek-V3-style mixture of experts (DESIGN.md §3; reference: HF `KimiLinearMoE`).

    s        = sigmoid(x Wr)                                       float32 router scores [N, E]
    choice   = s + e_score_correction_bias                         used only to CHOOSE the experts
    groups   : keep the topk_routing_group groups (of n_routing_groups) with the largest sum of their top-2 choices
    experts  = top-k(choice restricted to the kept groups)
    weights  = s[experts] / (sum + 1e-20) if norm_topk_prob, times routed_scaling_factor
    y        = sum_k weights_k * SwiGLU_{expert_k}(x) + shared_experts(x)

The router's product and routing run as `moe_router_kernel` picks (MaxText/kernels/moe_router: plain JAX, or
Pallas kernels on a GPU).

Dispatch is dropless and sorted: the N*k (token, expert) pairs are sorted by expert, the expert SwiGLUs run as grouped
matmuls over the sorted rows (each row meets only its own expert's weights; `moe_grouped_matmul` picks the
implementation: MaxText/kernels/grouped_matmul), and the rows are unsorted, weighted and summed. Where the
implementation multiplies rows in any order (gather; Pallas at decode sizes), the pairs stay in token order: no sort.
With `moe_shared_in_routed` and the Pallas `rows` grid (N*(k+1) <= 16 rows: decode at batch 1), the shared expert
(shared_experts 1: the routed experts' shape) is one more row per token in the routed experts' launches, with weight
1 in the sum: no kernels of its own. With `moe_rows_fused_inputs` the rows grid reads each token in place of its
repeated rows and computes the down product's SiLU(gate) * up from the gate / up products as it loads them.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from MaxText.kernels import moe_router, rms_norm
from MaxText.kernels.grouped_matmul import (ROWWISE_MAX_ROWS, extra_groups_supported, grouped_matmul,
                                            pallas_unavailable_reason, rows_must_be_sorted)
from MaxText.kernels.moe_router import route_tokens
from MaxText.layers.linears import MLP, kernel_init, matmul_precision

# `moe_rows_product` -> the Pallas rows grid's `rows_mma` (None: the kernel's default by dtype).
ROWS_MMA = {"auto": None, "tensor_cores": True, "fma": False}


class Router(nn.Module):
    """The `gate`: kernel [D, E] and e_score_correction_bias [E] (float32, used only for the choice)."""
    config: ml_collections.FrozenConfigDict

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x: [N, D] -> (weights [N, k] float32, expert ids [N, k] int32)."""
        cfg = self.config
        kernel = self.param("kernel", nn.with_logical_partitioning(kernel_init(cfg), ("embed", None)),
                            (x.shape[-1], cfg.num_experts), jnp.dtype(cfg.weight_dtype))
        bias = self.param("e_score_correction_bias", nn.with_logical_partitioning(nn.initializers.zeros, (None,)),
                          (cfg.num_experts,), jnp.float32)
        return route_tokens(x, kernel, bias, top_k=cfg.num_experts_per_tok, n_groups=cfg.n_routing_groups,
                            top_k_groups=cfg.topk_routing_group, norm_topk_prob=cfg.norm_topk_prob,
                            routed_scaling_factor=cfg.routed_scaling_factor, implementation=cfg.moe_router_kernel,
                            one_launch=cfg.moe_router_one_launch)


class RoutedExperts(nn.Module):
    """The routed SwiGLU experts: gate_proj, up_proj [E, D, I], down_proj [E, I, D] (`expert_kernel_layout` out_in:
    [E, I, D], [E, D, I], each expert's matrices as torch's Linear.weight), with sorted dispatch (rows in token order
    where the grouped matmul allows it: `grouped_matmul.rows_must_be_sorted`)."""
    config: ml_collections.FrozenConfigDict

    @nn.compact
    def __call__(self, x: jax.Array, weights: jax.Array, expert_ids: jax.Array, shared_kernels=None) -> jax.Array:
        """x: [N, D]; weights, expert_ids: [N, k] -> sum_k weights * expert(x), [N, D] in config.dtype.
        shared_kernels: a shared expert's (gate [D, I], up [D, I], down [I, D]), added to the sum as one more row per
        token (weight 1) in the same launches: only where `shared_rows_fit`."""
        cfg = self.config
        num_experts, dim, inner = cfg.num_experts, x.shape[-1], cfg.moe_mlp_dim
        dtype, precision = jnp.dtype(cfg.dtype), matmul_precision(cfg)
        num_tokens, top_k = expert_ids.shape

        def expert_param(name, shape, axes):
            param = self.param(name, nn.with_logical_partitioning(kernel_init(cfg), axes), shape,
                               jnp.dtype(cfg.weight_dtype))
            return param.astype(dtype)

        experts_out_in = cfg.expert_kernel_layout == "out_in"  # stored [E, out, in], else [E, in, out]
        gate_up_shape, gate_up_axes = (inner, dim), ("mlp", "embed")  # [out, in]
        down_shape, down_axes = (dim, inner), ("embed", "mlp")
        if not experts_out_in:
            gate_up_shape, gate_up_axes, down_shape, down_axes = down_shape, down_axes, gate_up_shape, gate_up_axes
        w_gate = expert_param("gate_proj", (num_experts, *gate_up_shape), ("exp", *gate_up_axes))
        w_up = expert_param("up_proj", (num_experts, *gate_up_shape), ("exp", *gate_up_axes))
        w_down = expert_param("down_proj", (num_experts, *down_shape), ("exp", *down_axes))

        pair_experts = expert_ids.reshape(-1)  # [N*k], token-major
        group_sizes = jnp.bincount(pair_experts, length=num_experts).astype(jnp.int32)  # [E]
        sort = rows_must_be_sorted(cfg.moe_grouped_matmul, dtype, dim, inner, num_tokens * top_k)
        # Token order with `moe_rows_fused_inputs`: the grouped matmul reads each token for its k rows (and its
        # shared-expert row, of group E, left out of row_experts) and takes the gate / up products unsummed.
        fused_inputs = cfg.moe_rows_fused_inputs and not sort
        if sort:  # the (token, expert) pairs sorted by expert
            order = jnp.argsort(pair_experts, stable=True)  # [N*k] pair index of each sorted row
            row_experts = pair_experts[order]  # [N*k], non-decreasing
            rows = x.astype(dtype)[order // top_k]  # [N*k, D]
        else:  # in token order: each row meets its own expert's weights whatever the order
            row_experts = pair_experts
            rows = x.astype(dtype) if fused_inputs else jnp.repeat(x.astype(dtype), top_k, axis=0)  # [N or N*k, D]
        extra, out_in = None, cfg.dense_kernel_layout == "out_in"
        if shared_kernels is not None:  # the shared expert: group E, rows N*k ... N*k + N - 1 (one per token)
            if not fused_inputs:
                rows = jnp.concatenate([rows, x.astype(dtype)])  # [N*(k+1), D]
                row_experts = jnp.concatenate([row_experts, jnp.full((num_tokens,), num_experts, row_experts.dtype)])
            # as stored: [1, D, I], [1, D, I], [1, I, D], or out_in [1, I, D], [1, I, D], [1, D, I] (.T undoes
            # create_kernel's: the kernel reads the params in place, transposed)
            extra = tuple((kernel.T if out_in else kernel)[None] for kernel in shared_kernels)

        def matmul(lhs, w, extra_weights, **options):
            return grouped_matmul(lhs, w, group_sizes, row_experts, implementation=cfg.moe_grouped_matmul,
                                  precision=precision, extra_weights=extra_weights, extra_out_in=out_in,
                                  rows_mma=ROWS_MMA[cfg.moe_rows_product], weights_out_in=experts_out_in, **options)

        # SiLU(rows Wg) * rows Wu [rows, I] (Pallas: in the gate and up kernel where one program holds both products;
        # with fused_inputs, where K is split, in the down kernel as it loads its rows)
        hidden = matmul(rows, (w_gate, w_up), extra[:2] if extra else None, glu=True,
                        rows_one_launch=cfg.moe_gate_up_one_launch, rows_per_token=top_k if fused_inputs else 0,
                        partial_rows=fused_inputs)
        out = matmul(hidden, w_down, extra[2] if extra else None)  # [rows, D]
        if sort:
            out = jnp.zeros_like(out).at[order].set(out)  # back to token order

        # Weight and sum over each token's k experts (and its shared-expert row).
        routed = out[:num_tokens * top_k].reshape(num_tokens, top_k, dim)  # [N, k, D]
        total = jnp.einsum("nkd,nk->nd", routed.astype(jnp.float32), weights, precision=jax.lax.Precision.HIGHEST)
        if shared_kernels is not None:
            total = total + out[num_tokens * top_k:].astype(jnp.float32)
        return total.astype(dtype)


def shared_rows_fit(config: ml_collections.FrozenConfigDict, num_tokens: int) -> bool:
    """Whether the MoE runs its shared expert as rows of the routed experts' launches for `num_tokens` tokens:
    `moe_shared_in_routed`, one shared expert (the routed experts' shape; its kernels read as stored, either
    dense_kernel_layout), and the Pallas `rows` grid for all N*(k+1) rows."""
    return (config.moe_shared_in_routed and config.shared_experts == 1
            and extra_groups_supported(config.moe_grouped_matmul, config.dtype, config.emb_dim, config.moe_mlp_dim,
                                       num_tokens * (config.num_experts_per_tok + 1)))


class MoE(nn.Module):
    """The MoE MLP: `gate` (router), `experts` (routed), `shared_experts` (one SwiGLU of moe_mlp_dim*shared_experts).

    `__call__(x [B, T, D]) -> [B, T, D]` in config.dtype. With the "intermediates" collection mutable it also
    stores its tokens' routing there as `routing`: ((weights [N, k], expert ids [N, k]),).
    """
    config: ml_collections.FrozenConfigDict

    @nn.compact
    def __call__(self, x: jax.Array, routing: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
        """routing: the tokens' (weights [N, k], expert ids [N, k]) where the caller routed them already
        (`routes_in_post_norm`: the router's params read in the same launch as the norm); None: the `gate` routes."""
        cfg = self.config
        batch, seq_len, dim = x.shape
        tokens = x.reshape(batch * seq_len, dim)  # [N, D]
        weights, expert_ids = Router(cfg, name="gate")(tokens) if routing is None else routing
        # For instrumentation (benchmarks/model_decode.py counts the experts used per layer): kept only where the
        # caller makes "intermediates" mutable, whichever launch routed the tokens; a no-op otherwise.
        self.sow("intermediates", "routing", (weights, expert_ids))
        shared = MLP(cfg, cfg.moe_mlp_dim * cfg.shared_experts, name="shared_experts") if cfg.shared_experts else None
        experts = RoutedExperts(cfg, name="experts")
        if shared is not None and shared_rows_fit(cfg, batch * seq_len):
            return experts(tokens, weights, expert_ids, shared.kernels()).reshape(batch, seq_len, dim)
        out = experts(tokens, weights, expert_ids).reshape(batch, seq_len, dim)
        if shared is not None:
            out = out + shared(x)
        return out


def routes_in_post_norm(config: ml_collections.FrozenConfigDict, num_tokens: int, dim: int, dtype) -> bool:
    """Whether a decoder layer runs its post-attention norm and its MoE's router as one launch for `num_tokens`
    rows (`moe_router_in_norm`; `pallas_route.norm_and_route`): where the norm would run its Pallas kernel adding
    the residual (`norm_adds_residual`; one row by default) and the router its Pallas product and routing (at most
    ROWWISE_MAX_ROWS tokens), which that launch computes alike."""
    if not (config.moe_router_in_norm and config.norm_adds_residual) or num_tokens > ROWWISE_MAX_ROWS:
        return False
    return (rms_norm.resolve(config.norm_kernel, dtype, dim, num_tokens) == "pallas"
            and moe_router.resolve(config.moe_router_kernel, config.num_experts, config.num_experts_per_tok,
                                   config.n_routing_groups) == "pallas"
            and pallas_unavailable_reason(dtype, dim, config.num_experts) is None)
