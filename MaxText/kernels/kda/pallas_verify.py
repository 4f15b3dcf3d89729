"""Pallas (Triton lowering) speculative-verify KDA: T draft tokens from each row's committed state, every token's
post-state written to its own checkpoint slot.

One program per (batch row, head, block of BV value columns). It loads the row's committed [K, BV] fp32 state slice
into registers once, then for each of the T tokens (T small: the draft tokens + 1) computes l2norm / scale / gate
in registers (`pallas_decode.token_factors`, shared with the decode kernel), applies
    S = diag(exp(g)) S;  S += k (beta (v - k^T S))^T;  o = q^T S          (`pallas_decode.delta_rule_step`)
and stores o [BV] and the state slice (cast to the checkpoint dtype; the recurrence itself stays fp32) for that
token. The committed state is only read: nothing aliases it.

Semantics: `verify.recurrent_kda_checkpoints`. Memory bound: per row and head it reads K*V*4 bytes of state and
writes T*K*V checkpoint elements. Runs under `interpret=True` on CPU (the tests do).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from MaxText.kernels.kda.pallas_decode import delta_rule_step, token_factors


def _verify_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, alog_ref, dtb_ref, h0_ref, o_ref, ckpt_ref, *, seq_len,
                   head_k, block_v, scale, gate_in_kernel, l2norm_in_kernel):
    row, head, vblk = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    cols = pl.ds(vblk * block_v, block_v)

    def token(t, state):  # state: [K, BV] fp32
        q, k, g, beta = token_factors(
            q_ref[row, t, head, :], k_ref[row, t, head, :], g_ref[row, t, head, :], beta_ref[row, t, head],
            alog_ref, dtb_ref, head, head_k=head_k, scale=scale, gate_in_kernel=gate_in_kernel,
            l2norm_in_kernel=l2norm_in_kernel, beta_logit=False)
        state, o = delta_rule_step(state, q, k, v_ref[row, t, head, cols].astype(jnp.float32), g, beta)
        o_ref[row, t, head, cols] = o.astype(o_ref.dtype)
        ckpt_ref[row, t, head, :, cols] = state.astype(ckpt_ref.dtype)
        return state

    jax.lax.fori_loop(0, seq_len, token, h0_ref[row, head, :, cols].astype(jnp.float32))


def verify_call(q, k, v, g, beta, A_log, dt_bias, initial_state, *, scale, checkpoint_dtype, gate_in_kernel,
                l2norm_in_kernel, block_v=32, num_warps=4, interpret=False):
    """q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H] (after the sigmoid); A_log [H]; dt_bias [H*K]
    (read only when `gate_in_kernel`); initial_state [B, H, K, V] float32 (not modified).

    Returns (o [B, T, H, V] in q's dtype, checkpoints [B, T, H, K, V] in `checkpoint_dtype`).
    """
    batch, seq_len, H, K = q.shape
    V = v.shape[-1]
    block_v = min(block_v, V)
    if V % block_v:
        raise ValueError(f"value head dim V={V} must be a multiple of block_v={block_v}")
    kernel = functools.partial(_verify_kernel, seq_len=seq_len, head_k=K, block_v=block_v, scale=scale,
                               gate_in_kernel=gate_in_kernel, l2norm_in_kernel=l2norm_in_kernel)
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((batch, seq_len, H, V), q.dtype),
                   jax.ShapeDtypeStruct((batch, seq_len, H, K, V), checkpoint_dtype)),
        grid=(batch, H, V // block_v),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="kda_verify",
    )(q, k, v, g, beta, A_log.reshape(H), dt_bias.reshape(H * K), initial_state.astype(jnp.float32))


verify_step = jax.jit(verify_call, static_argnames=("scale", "checkpoint_dtype", "gate_in_kernel", "l2norm_in_kernel",
                                                    "block_v", "num_warps", "interpret"))
verify_step.__doc__ = "`verify_call` under jit."
