"""Packed single-token KDA decode over a state pool (seed 004), in plain JAX: the oracle and the CPU fallback.

    o, new_pool = packed_decode_kda_reference(mixed_qkv, a, b, A_log, dt_bias, state_pool, slot_indices,
                                              num_heads=H, head_dim=K, scale=None)

Inputs (one decode token per row; B rows):
  mixed_qkv:    [B, 2*H*K + H*V]  the short-conv output (after silu), q then k then v, any float dtype;
                q and k are NOT yet l2-normalised (that happens here, fp32, eps 1e-6 inside the sqrt).
  a:            [B, H*K]          raw gate input; g = -exp(A_log[h]) * softplus(a + dt_bias)  (fp32)
  b:            [B, H]            raw beta logit; beta = sigmoid(b)
  A_log:        [H]               dt_bias: [H*K]
  state_pool:   [S, H, K, V]      float32 recurrent states; row `slot_indices[i]` belongs to batch row i
  slot_indices: [B] int32         -1 marks a padding row: its output is zero and no pool row is touched
Returns o [B, H, V] in mixed_qkv's dtype and the pool with the B rows updated (others bit-identical).
The Pallas kernel (`pallas_ops.packed_decode_kda`) has this exact signature and updates the pool in place.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from MaxText.kernels.kda.common import kda_gate, l2norm
from MaxText.kernels.kda.naive import kda_step


class PackedLayout:
    """Sizes of a packed conv output row: q [H*K], k [H*K], v [H*V]."""

    def __init__(self, mixed_width: int, num_heads: int, head_dim: int):
        qk_width = 2 * num_heads * head_dim
        if mixed_width <= qk_width or (mixed_width - qk_width) % num_heads:
            raise ValueError(f"mixed_qkv has {mixed_width} columns; expected 2*H*K + H*V with H={num_heads}, "
                             f"K={head_dim} (2*H*K = {qk_width}) and V a positive integer")
        self.num_heads, self.head_dim = num_heads, head_dim
        self.value_dim = (mixed_width - qk_width) // num_heads


def check_packed_inputs(mixed_qkv, a, b, A_log, dt_bias, state_pool, slot_indices, num_heads, head_dim):
    """Validates the packed-decode shapes; returns the layout (value head dim V included)."""
    if mixed_qkv.ndim != 2:
        raise ValueError(f"mixed_qkv must be [B, 2*H*K + H*V], got shape {mixed_qkv.shape}")
    layout = PackedLayout(mixed_qkv.shape[1], num_heads, head_dim)
    batch, H, K, V = mixed_qkv.shape[0], num_heads, head_dim, layout.value_dim
    expected = {"a": (a, (batch, H * K)), "b": (b, (batch, H)), "A_log": (A_log, (H,)),
                "dt_bias": (dt_bias, (H * K,)), "slot_indices": (slot_indices, (batch,))}
    for name, (value, shape) in expected.items():
        if tuple(value.shape) != shape:
            raise ValueError(f"{name} must have shape {shape} (B={batch}, H={H}, K={K}); got {tuple(value.shape)}")
    if state_pool.ndim != 4 or tuple(state_pool.shape[1:]) != (H, K, V):
        raise ValueError(f"state_pool must be [S, H, K, V] = [S, {H}, {K}, {V}]; got {tuple(state_pool.shape)}")
    if state_pool.dtype != jnp.float32:
        raise ValueError(f"state_pool must be float32, got {state_pool.dtype}")
    if not jnp.issubdtype(slot_indices.dtype, jnp.integer):
        raise ValueError(f"slot_indices must be integer (int32), got {slot_indices.dtype}")
    return layout


def split_packed(mixed_qkv, num_heads: int, head_dim: int, value_dim: int):
    """[B, 2*H*K + H*V] -> q, k [B, H, K] and v [B, H, V] (views, dtype unchanged)."""
    batch, hk = mixed_qkv.shape[0], num_heads * head_dim
    q = mixed_qkv[:, :hk].reshape(batch, num_heads, head_dim)
    k = mixed_qkv[:, hk:2 * hk].reshape(batch, num_heads, head_dim)
    v = mixed_qkv[:, 2 * hk:].reshape(batch, num_heads, value_dim)
    return q, k, v


def packed_decode_kda_reference(mixed_qkv, a, b, A_log, dt_bias, state_pool, slot_indices, *, num_heads: int,
                                head_dim: int, scale: float | None = None):
    """Pure-JAX packed decode (see the module docstring); fp32 math on `naive.kda_step`."""
    layout = check_packed_inputs(mixed_qkv, a, b, A_log, dt_bias, state_pool, slot_indices, num_heads, head_dim)
    H, K, V = num_heads, head_dim, layout.value_dim
    scale = K ** -0.5 if scale is None else scale
    q, k, v = split_packed(mixed_qkv, H, K, V)  # [B, H, K], [B, H, K], [B, H, V]
    q, k = l2norm(q) * scale, l2norm(k)
    g = kda_gate(a.reshape(-1, H, K), A_log, dt_bias)  # [B, H, K] fp32
    beta = jax.nn.sigmoid(b.astype(jnp.float32))  # [B, H]
    slots = slot_indices.astype(jnp.int32)
    valid = slots >= 0
    safe = jnp.where(valid, slots, 0)
    state = state_pool[safe]  # [B, H, K, V]
    new_state, o = kda_step(state, q, k, v.astype(jnp.float32), g, beta)
    o = jnp.where(valid[:, None, None], o, 0.0).astype(mixed_qkv.dtype)
    # Padding rows scatter to an out-of-range index, which mode="drop" discards: the pool row stays untouched.
    target = jnp.where(valid, slots, state_pool.shape[0])
    new_pool = state_pool.at[target].set(new_state, mode="drop")
    return o, new_pool
