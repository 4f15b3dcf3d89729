"""KDA's one-token decode from the layer's input row: the input norm, every projection before the recurrence, the
short convolution, the packed decode step and the output norm, as the KDA layer computes them at decode with its
input norm deferred (`input_norm_after_projections`). The oracle of the one-launch Pallas kernel
(pallas_project_decode.py) and the shapes and checks it shares.

    o, new_pool, new_window = project_and_decode_reference(x, norm_scale, weights, window, A_log, dt_bias,
                                                           state_pool, slot_indices, out_norm_scale, ...)

x [B, D] the residual row (the layer's input before its RMSNorm); norm_scale [D] the input norm's scale;
`weights` a `ProjectionWeights` of kernels stored [out, in] (`dense_kernel_layout: out_in`, HF's Linear.weight);
window [B, W-1, 3*H*K] the conv window; the rest as `packed_decode.packed_decode_kda_reference` (o is the KDA output
norm of the recurrence's output, in x's dtype). Every rounding is the layer's: h = scale * x and each product in x's
dtype, each product of h times the norm's 1 / rms rounded again (`linears.scale_rows`), the conv output's SiLU in x's
dtype.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from MaxText.kernels.kda.common import causal_conv
from MaxText.kernels.kda.packed_decode import packed_decode_kda_reference
from MaxText.kernels.rms_norm.naive import inverse_rms


class ProjectionWeights(NamedTuple):
    """The KDA layer's projections before its recurrence, each stored [out, in]."""
    q: jax.Array  # [H*K, D]
    k: jax.Array  # [H*K, D]
    v: jax.Array  # [H*V, D]
    f_a: jax.Array  # [K, D]
    g_a: jax.Array  # [K, D]
    b: jax.Array  # [H, D]
    f_b: jax.Array  # [H*K, K]
    g_b: jax.Array  # [H*V, K]
    q_conv: jax.Array  # [W, H*K] (the short convolutions' kernels, as the layer stores them)
    k_conv: jax.Array  # [W, H*K]
    v_conv: jax.Array  # [W, H*V]


class Dims(NamedTuple):
    batch: int
    model: int  # D
    heads: int  # H
    key: int  # K
    value: int  # V
    width: int  # W


def check_inputs(x, norm_scale, weights: ProjectionWeights, window, state_pool, slot_indices, num_heads: int,
                 head_dim: int) -> Dims:
    """The problem's dims; ValueError naming the first input whose shape does not fit them."""
    batch, model = x.shape
    H, K = num_heads, head_dim
    V = state_pool.shape[-1]
    W = weights.q_conv.shape[0]
    expected = {"norm_scale": (model,), "q": (H * K, model), "k": (H * K, model), "v": (H * V, model),
                "f_a": (K, model), "g_a": (K, model), "b": (H, model), "f_b": (H * K, K), "g_b": (H * V, K),
                "q_conv": (W, H * K), "k_conv": (W, H * K), "v_conv": (W, H * V),
                "window": (batch, W - 1, 2 * H * K + H * V), "state_pool": (state_pool.shape[0], H, K, V),
                "slot_indices": (batch,)}
    given = {"norm_scale": norm_scale, **weights._asdict(), "window": window, "state_pool": state_pool,
             "slot_indices": slot_indices}
    for name, shape in expected.items():
        if tuple(given[name].shape) != shape:
            raise ValueError(f"{name} must have shape {shape} for x [B={batch}, D={model}], H={H}, K={K}, V={V}, "
                             f"W={W}; got {tuple(given[name].shape)}")
    return Dims(batch, model, H, K, V, W)


def project_and_decode_reference(x, norm_scale, weights: ProjectionWeights, window, A_log, dt_bias, state_pool,
                                 slot_indices, out_norm_scale, *, num_heads: int, head_dim: int, norm_eps: float,
                                 out_norm_eps: float):
    """See the module docstring. Returns (o [B, H, V] in x's dtype, new pool, new window [B, W-1, 3*H*K])."""
    check_inputs(x, norm_scale, weights, window, state_pool, slot_indices, num_heads, head_dim)
    dtype = x.dtype
    h = norm_scale.astype(dtype) * x  # [B, D]
    row_scale = inverse_rms(x, norm_eps)  # [B, 1] float32

    def product(row, kernel):  # row [B, N] @ kernel[out, in].T, accumulated in float32, in x's dtype
        return jnp.dot(row, kernel.T, preferred_element_type=jnp.float32).astype(dtype)

    def normed_product(kernel):  # the layer's scale_rows of h's product
        return (product(h, kernel).astype(jnp.float32) * row_scale).astype(dtype)

    pre = jnp.concatenate([normed_product(w) for w in (weights.q, weights.k, weights.v)], axis=-1)  # [B, 3*H*K]
    conv_kernel = jnp.concatenate([weights.q_conv, weights.k_conv, weights.v_conv], axis=-1)  # [W, 3*H*K]
    conv_out, new_window = causal_conv(pre[:, None], window, conv_kernel)
    mixed = jax.nn.silu(conv_out[:, 0]).astype(dtype)  # [B, 3*H*K]
    gate_input = product(normed_product(weights.f_a), weights.f_b)  # [B, H*K]
    out_gate = product(normed_product(weights.g_a), weights.g_b)  # [B, H*V]
    beta_logit = normed_product(weights.b)  # [B, H]
    o, new_pool = packed_decode_kda_reference(mixed, gate_input, beta_logit, A_log, dt_bias, state_pool, slot_indices,
                                              num_heads=num_heads, head_dim=head_dim, out_gate=out_gate,
                                              out_norm_scale=out_norm_scale, out_norm_eps=out_norm_eps)
    return o, new_pool, new_window.astype(window.dtype)
