"""Packed single-token KDA decode over a state pool (seed 004), in plain JAX: the oracle and the CPU fallback.

    o, new_pool = packed_decode_kda_reference(mixed_qkv, a, b, A_log, dt_bias, state_pool, slot_indices,
                                              num_heads=H, head_dim=K, scale=None, out_dtype=None)

Inputs (one decode token per row; B rows):
  mixed_qkv:    [B, 2*H*K + H*V]  the short-conv output (after silu), q then k then v, any float dtype;
                q and k are NOT yet l2-normalised (that happens here, fp32, eps 1e-6 inside the sqrt).
  a:            [B, H*K]          raw gate input; g = -exp(A_log[h]) * softplus(a + dt_bias)  (fp32)
  b:            [B, H]            raw beta logit; beta = sigmoid(b)
  A_log:        [H]               dt_bias: [H*K]
  state_pool:   [S, H, K, V]      float32 recurrent states; row `slot_indices[i]` belongs to batch row i
  slot_indices: [B] int32         -1 marks a padding row: its output is zero and no pool row is touched
Returns o [B, H, V] in `out_dtype` (default: mixed_qkv's dtype) and the pool with the B rows updated (others
bit-identical). With out_gate [B, H*V], out_norm_scale [V] and out_norm_eps, o is the KDA output norm of that o
(`apply_output_norm`: RMS norm per head times scale times sigmoid(gate), in o's dtype).
The Pallas kernel (`pallas_ops.packed_decode_kda`) has this exact signature and updates the pool in place.

    fn = shard_map_packed_decode(kernel_fn, mesh, row_axes=("data",), head_axes=("tensor",))
runs a packed-decode kernel per (rows, heads) shard (for kernels XLA cannot partition): see its docstring.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from MaxText.kernels.kda.common import gated_rms_norm, kda_gate, l2norm
from MaxText.kernels.kda.naive import kda_step
from MaxText.kernels.kda.sharded import spec_axes


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


def apply_output_norm(o, out_gate, out_norm_scale, out_norm_eps):
    """o [B, H, V] -> the KDA output norm `common.gated_rms_norm(o, gate, scale, eps)` per head, in o's dtype
    (out_gate [B, H*V], out_norm_scale [V]): what the kernels' `out_norm_eps` option computes in their launch."""
    gate = out_gate.reshape(o.shape)
    return gated_rms_norm(o, gate, out_norm_scale, out_norm_eps).astype(o.dtype)


def packed_decode_kda_reference(mixed_qkv, a, b, A_log, dt_bias, state_pool, slot_indices, *, num_heads: int,
                                head_dim: int, scale: float | None = None, out_dtype=None, out_gate=None,
                                out_norm_scale=None, out_norm_eps=None):
    """Pure-JAX packed decode (see the module docstring); fp32 math on `naive.kda_step`. o is in `out_dtype`
    (default: mixed_qkv's dtype); with out_norm_eps, the output norm of it (`apply_output_norm`)."""
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
    o = jnp.where(valid[:, None, None], o, 0.0).astype(mixed_qkv.dtype if out_dtype is None else out_dtype)
    # Padding rows scatter to an out-of-range index, which mode="drop" discards: the pool row stays untouched.
    target = jnp.where(valid, slots, state_pool.shape[0])
    new_pool = state_pool.at[target].set(new_state, mode="drop")
    if out_norm_eps is not None:
        o = apply_output_norm(o, out_gate, out_norm_scale, out_norm_eps)
    return o, new_pool


def shard_map_packed_decode(kernel_fn: Callable, mesh, row_axes: Sequence[str], head_axes: Sequence[str]) -> Callable:
    """`kernel_fn` (the packed-decode signature above) run under `jax.shard_map`, each device on its own batch rows
    and pool rows (over `row_axes`) and its own heads (over `head_axes`), with no communication.

    The packed row [q heads | k heads | v heads] does not split over heads as one contiguous axis, so it travels as
    qk [B, 2, H, K] and v [B, H, V] and each shard re-packs its own heads (a small activation copy; the state pool is
    passed through untouched, so it stays in place). `slot_indices` are global pool rows; each shard subtracts its
    first pool row. Row i's slot must lie in row i's own shard of the pool (as for the KDA block's cache: pool row i
    is batch row i); a slot held by another shard is treated as padding there (zero output, no state written).
    B and S must be multiples of the row shards, H of the head shards.
    """
    rows, heads = spec_axes(row_axes), spec_axes(head_axes)
    in_specs = (P(rows, None, heads, None), P(rows, heads, None), P(rows, heads, None), P(rows, heads), P(heads),
                P(heads), P(rows, heads, None, None), P(rows))
    out_specs = (P(rows, heads, None), P(rows, heads, None, None))

    def sharded(mixed_qkv, a, b, A_log, dt_bias, state_pool, slot_indices, *, num_heads: int, head_dim: int,
                **kwargs):
        layout = check_packed_inputs(mixed_qkv, a, b, A_log, dt_bias, state_pool, slot_indices, num_heads, head_dim)
        batch, H, K, V = mixed_qkv.shape[0], num_heads, head_dim, layout.value_dim
        qk = mixed_qkv[:, :2 * H * K].reshape(batch, 2, H, K)
        v = mixed_qkv[:, 2 * H * K:].reshape(batch, H, V)

        def local(qk, v, a, b, A_log, dt_bias, pool, slots):
            local_batch, local_heads = v.shape[:2]
            mixed = jnp.concatenate([qk.reshape(local_batch, -1), v.reshape(local_batch, -1)], axis=-1)
            first_row = jax.lax.axis_index(rows) * pool.shape[0] if rows else 0
            slots = slots - first_row
            slots = jnp.where((slots >= 0) & (slots < pool.shape[0]), slots, -1)
            return kernel_fn(mixed, a.reshape(local_batch, -1), b, A_log, dt_bias, pool, slots,
                             num_heads=local_heads, head_dim=K, **kwargs)

        return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(
            qk, v, a.reshape(batch, H, K), b, A_log.reshape(H), dt_bias.reshape(H * K), state_pool,
            slot_indices.astype(jnp.int32))

    return sharded
