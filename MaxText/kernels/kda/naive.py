"""The oracle: KDA as a token-by-token `lax.scan` in float32. Every other implementation is tested against it.

Per head, with state S in R^{K x V}:
    S = diag(exp(g_t)) S;   S += k_t (beta_t (v_t - k_t^T S))^T;   o_t = q_t^T S
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from MaxText.kernels.kda.common import HIGHEST, prepare_inputs, segment_ids_or_zeros


def kda_step(state, q_t, k_t, v_t, g_t, beta_t):
    """One recurrence step. state: [..., H, K, V]; q_t, k_t, g_t: [..., H, K]; v_t: [..., H, V]; beta_t: [..., H].

    Returns (new state, o_t [..., H, V]), all float32.
    """
    state = state * jnp.exp(g_t)[..., None]
    predicted = jnp.einsum("...hk,...hkv->...hv", k_t, state, precision=HIGHEST)
    delta = beta_t[..., None] * (v_t - predicted)  # [..., H, V]
    state = state + k_t[..., :, None] * delta[..., None, :]
    o_t = jnp.einsum("...hk,...hkv->...hv", q_t, state, precision=HIGHEST)
    return state, o_t


@jax.jit
def _scan_batch(x, initial_state, segment_ids):
    """Runs every batch row from its own initial state; the state restarts from zero where segment_ids changes."""
    time_major = [jnp.moveaxis(t, 1, 0) for t in (x.q, x.k, x.v, x.g, x.beta)]  # [T, B, ...]
    previous_ids = jnp.concatenate([segment_ids[:, :1], segment_ids[:, :-1]], axis=1)
    restarts = jnp.moveaxis(segment_ids != previous_ids, 1, 0)  # [T, B]

    def body(state, xs):
        restart, *step_inputs = xs
        state = jnp.where(restart[:, None, None, None], 0.0, state)
        return kda_step(state, *step_inputs)

    final_state, o = jax.lax.scan(body, initial_state, (restarts, *time_major))
    return jnp.moveaxis(o, 0, 1), final_state  # [B, T, H, V], [B, H, K, V]


@jax.jit
def _scan_packed(x, initial_state, cu_seqlens):
    """B == 1 with sequences packed along T: the state restarts from initial_state[n] at each sequence start."""
    seq_len = x.q.shape[1]
    cu = jnp.asarray(cu_seqlens, jnp.int32)
    positions = jnp.arange(seq_len, dtype=jnp.int32)
    seq_ids = jnp.searchsorted(cu[1:], positions, side="right")  # [T], the sequence each token belongs to
    is_start = positions == cu[seq_ids]

    def body(carry, xs):
        state, finals = carry
        seq_id, start, q_t, k_t, v_t, g_t, b_t = xs
        state = jnp.where(start, initial_state[seq_id], state)
        state, o_t = kda_step(state, q_t, k_t, v_t, g_t, b_t)
        finals = finals.at[seq_id].set(state)  # the last write of a sequence is its final state
        return (state, finals), o_t

    xs = (seq_ids, is_start, x.q[0], x.k[0], x.v[0], x.g[0], x.beta[0])
    (_, finals), o = jax.lax.scan(body, (initial_state[0], initial_state), xs)
    return o[None], finals


def naive_recurrent_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                        use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None,
                        cu_seqlens=None, chunk_size=None, segment_ids=None):
    """fla-style KDA; returns (o [B, T, H, V] in q's dtype, final state [N, H, K, V] float32 or None).

    `chunk_size` is accepted (and ignored) so the signature matches `chunk_kda`. `segment_ids` [B, T] (our
    extension, for packed training rows): the state restarts from zero where the id changes along T.
    """
    del chunk_size
    x = prepare_inputs(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                       use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                       A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu_seqlens, segment_ids=segment_ids)
    if cu_seqlens is None:
        o, final_state = _scan_batch(x, x.initial_state, segment_ids_or_zeros(segment_ids, x.q.shape[:2]))
    else:
        o, final_state = _scan_packed(x, x.initial_state, cu_seqlens)
    return o.astype(q.dtype), (final_state if output_final_state else None)
