"""What every KDA kernel implementation shares: input checks, the in-kernel l2norm and gate, fp32 casting.

Conventions (fla-core's): q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]; states: [N, H, K, V] float32,
N = B, or the number of packed sequences when `cu_seqlens` ([N + 1], with B == 1) is given.
`g` is the per-step log-decay (<= 0), or the raw gate input when `use_gate_in_kernel`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from MaxText.kernels.rms_norm.naive import inverse_rms

HIGHEST = jax.lax.Precision.HIGHEST
L2NORM_EPS = 1e-6
SOFTPLUS_THRESHOLD = 20.0


def l2norm(x: jax.Array, eps: float = L2NORM_EPS) -> jax.Array:
    """x / sqrt(sum(x^2) + eps) over the last axis, in float32 (fla / HF convention: eps inside the sqrt)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def thresholded_softplus(x: jax.Array) -> jax.Array:
    """softplus(x), and x itself above SOFTPLUS_THRESHOLD (as HF / fla), written with exp and log1p only so that it
    also lowers inside the Pallas kernels."""
    return jnp.where(x > SOFTPLUS_THRESHOLD, x, jnp.log1p(jnp.exp(jnp.minimum(x, SOFTPLUS_THRESHOLD))))


def gated_rms_norm(x: jax.Array, gate: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """The KDA output norm (HF KimiLinearRMSNormGated), float32: x [..., V] * rsqrt(mean(x^2) + eps) * scale [V] *
    sigmoid(gate [..., V]). Also used inside the Pallas decode kernel."""
    x = x.astype(jnp.float32) * inverse_rms(x, eps)
    return x * scale.astype(jnp.float32) * jax.nn.sigmoid(gate.astype(jnp.float32))


def kda_gate(g_raw: jax.Array, A_log: jax.Array, dt_bias: jax.Array) -> jax.Array:
    """Log-decay g = -exp(A_log[h]) * softplus(g_raw + dt_bias), float32.

    g_raw: [..., H, K]; A_log: H values (any shape holding H elements); dt_bias: H*K values.
    softplus(x) = x for x > 20, as in HF / fla.
    """
    num_heads, head_dim = g_raw.shape[-2:]
    if A_log.size != num_heads:
        raise ValueError(f"A_log has {A_log.size} values (shape {A_log.shape}); expected one per head, H={num_heads}")
    if dt_bias.size != num_heads * head_dim:
        raise ValueError(f"dt_bias has {dt_bias.size} values (shape {dt_bias.shape}); expected H*K = "
                         f"{num_heads}*{head_dim} = {num_heads * head_dim}")
    x = g_raw.astype(jnp.float32) + dt_bias.astype(jnp.float32).reshape(num_heads, head_dim)
    return -jnp.exp(A_log.astype(jnp.float32).reshape(num_heads, 1)) * thresholded_softplus(x)


def causal_conv(inputs, window, kernel, segment_ids=None):
    """Depthwise causal convolution continuing from `window`.

    inputs: [B, T, C]; window: [B, W-1, C] (the previous W-1 inputs); kernel: [W, C]; segment_ids: [B, T] or None
    (a tap that reaches into another segment contributes nothing: packed documents do not see each other).
    Returns (outputs [B, T, C] float32, new window [B, W-1, C]).
    """
    width = kernel.shape[0]
    seq_len = inputs.shape[1]
    padded = jnp.concatenate([window.astype(inputs.dtype), inputs], axis=1)  # [B, W-1+T, C]
    kernel = kernel.astype(jnp.float32)
    if segment_ids is not None:
        padded_ids = jnp.concatenate([jnp.repeat(segment_ids[:, :1], width - 1, axis=1), segment_ids], axis=1)
    out = 0.0
    for tap in range(width):
        term = padded[:, tap:tap + seq_len].astype(jnp.float32) * kernel[tap]
        if segment_ids is not None:
            term = jnp.where((padded_ids[:, tap:tap + seq_len] == segment_ids)[..., None], term, 0.0)
        out = out + term
    return out, padded[:, seq_len:]


class KDAInputs(NamedTuple):
    """Kernel inputs after the shared preprocessing: all float32, q already multiplied by `scale`."""
    q: jax.Array  # [B, T, H, K]
    k: jax.Array  # [B, T, H, K]
    v: jax.Array  # [B, T, H, V]
    g: jax.Array  # [B, T, H, K] log-decay
    beta: jax.Array  # [B, T, H]
    initial_state: jax.Array  # [N, H, K, V]


def check_cu_seqlens(cu_seqlens, batch: int, seq_len: int) -> None:
    """Validates a concrete `cu_seqlens` ([N + 1], 0 = first <= ... <= last = T, with B == 1)."""
    if batch != 1:
        raise ValueError(f"cu_seqlens packs sequences along T and needs batch size 1, got B={batch}")
    if isinstance(cu_seqlens, jax.core.Tracer):
        return
    cu = np.asarray(cu_seqlens)
    if cu.ndim != 1 or cu.size < 2:
        raise ValueError(f"cu_seqlens must be a 1-D array of N + 1 >= 2 offsets, got shape {cu.shape}")
    if cu[0] != 0 or cu[-1] != seq_len or np.any(np.diff(cu) < 0):
        raise ValueError(f"cu_seqlens must start at 0, end at T={seq_len} and not decrease; got {cu.tolist()}")


def segment_ids_or_zeros(segment_ids, batch_and_time) -> jax.Array:
    """Checks `segment_ids` [B, T] (state resets where the id changes); None means one segment per row."""
    if segment_ids is None:
        return jnp.zeros(batch_and_time, jnp.int32)
    if tuple(segment_ids.shape) != tuple(batch_and_time):
        raise ValueError(f"segment_ids must be [B, T] = {tuple(batch_and_time)}; got {tuple(segment_ids.shape)}")
    return jnp.asarray(segment_ids, jnp.int32)


def prepare_inputs(q, k, v, g, beta, *, scale=None, initial_state=None, use_qk_l2norm_in_kernel=False,
                   use_gate_in_kernel=False, A_log=None, dt_bias=None, cu_seqlens=None, segment_ids=None) -> KDAInputs:
    """Checks shapes, applies the optional in-kernel l2norm and gate, scales q; returns float32 inputs."""
    if q.ndim != 4:
        raise ValueError(f"q must be [B, T, H, K], got shape {q.shape}")
    batch, seq_len, num_heads, head_k = q.shape
    if k.shape != q.shape or g.shape != q.shape:
        raise ValueError(f"q, k and g must share the shape [B, T, H, K]; got q {q.shape}, k {k.shape}, g {g.shape}")
    if v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must be [B, T, H, V] with B, T, H of q {q.shape[:3]}; got {v.shape}")
    if beta.shape != q.shape[:3]:
        raise ValueError(f"beta must be [B, T, H] = {q.shape[:3]}; got {beta.shape}")
    head_v = v.shape[-1]
    if cu_seqlens is not None:
        if segment_ids is not None:
            raise ValueError("pass either cu_seqlens (packed along T, B == 1) or segment_ids, not both")
        check_cu_seqlens(cu_seqlens, batch, seq_len)
        num_states = cu_seqlens.shape[0] - 1
    else:
        num_states = batch
    if initial_state is None:
        initial_state = jnp.zeros((num_states, num_heads, head_k, head_v), jnp.float32)
    elif initial_state.shape != (num_states, num_heads, head_k, head_v):
        raise ValueError(f"initial_state must be [N, H, K, V] = {(num_states, num_heads, head_k, head_v)} "
                         f"(N = {'number of packed sequences' if cu_seqlens is not None else 'B'}); "
                         f"got {initial_state.shape}")
    if use_gate_in_kernel:
        if A_log is None or dt_bias is None:
            raise ValueError("use_gate_in_kernel=True needs A_log and dt_bias")
        g = kda_gate(g, A_log, dt_bias)
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    scale = head_k ** -0.5 if scale is None else scale
    f32 = jnp.float32
    q, k, v, g, beta, initial_state = (jnp.asarray(x, f32) for x in (q, k, v, g, beta, initial_state))
    return KDAInputs(q * scale, k, v, g, beta, initial_state)
