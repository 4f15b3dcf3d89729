"""Pallas (Triton lowering) speculative-verify KDA: T draft tokens from each row's committed state, every token's
post-state written to its own slot.

One program per (batch row, head, block of BV value columns). It loads the row's committed [K, BV] fp32 state slice
into registers once, then for each of the T tokens (T small: the draft tokens + 1) computes l2norm / scale / gate
in registers (`pallas_decode.token_factors`, shared with the decode kernel), applies
    S = diag(exp(g)) S;  S += k (beta (v - k^T S))^T;  o = q^T S          (`pallas_decode.delta_rule_step`)
and stores o [BV] and the state slice for that token. Where the states go (`verify_call`):
  * checkpoints: a fresh [B, T, H, K, V] output in the checkpoint dtype, token t at index t (the committed state is
    a separate input and only read);
  * ring (the KDA block's cache): the row's state ring [B, S, H, K, V] fp32 is both input and output
    (`input_output_aliases`, updated in place). The program reads slot s = state_slot[b] and writes token t's state
    to slot (s + 1 + t) mod S. Every program reads its own [K, BV] block of slot s before it writes any slot, and no
    other program touches that block, so reading and writing one buffer is safe; slot s itself is never written.

Semantics: `verify.recurrent_kda_checkpoints` / `verify.recurrent_kda_ring_checkpoints`. Memory bound: per row and
head it reads K*V*4 bytes of state and writes T*K*V state elements. Runs under `interpret=True` on CPU (the tests
do).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from MaxText.kernels.kda.pallas_decode import delta_rule_step, token_factors


def _verify_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, alog_ref, dtb_ref, slot_ref, states_in_ref, o_ref,
                   states_ref, *, seq_len, first_write, num_out_slots, head_k, block_v, scale, gate_in_kernel,
                   l2norm_in_kernel):
    row, head, vblk = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    cols = pl.ds(vblk * block_v, block_v)
    read_slot = slot_ref[row]

    def token(t, state):  # state: [K, BV] fp32
        q, k, g, beta = token_factors(
            q_ref[row, t, head, :], k_ref[row, t, head, :], g_ref[row, t, head, :], beta_ref[row, t, head],
            alog_ref, dtb_ref, head, head_k=head_k, scale=scale, gate_in_kernel=gate_in_kernel,
            l2norm_in_kernel=l2norm_in_kernel, beta_logit=False)
        state, o = delta_rule_step(state, q, k, v_ref[row, t, head, cols].astype(jnp.float32), g, beta)
        o_ref[row, t, head, cols] = o.astype(o_ref.dtype)
        write_slot = jax.lax.rem(read_slot + first_write + t, num_out_slots)  # all non-negative
        states_ref[row, write_slot, head, :, cols] = state.astype(states_ref.dtype)
        return state

    jax.lax.fori_loop(0, seq_len, token, states_in_ref[row, read_slot, head, :, cols].astype(jnp.float32))


def verify_call(q, k, v, g, beta, A_log, dt_bias, states, state_slot, *, scale, in_ring, checkpoint_dtype,
                gate_in_kernel, l2norm_in_kernel, block_v=32, num_warps=4, interpret=False):
    """q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H] (after the sigmoid); A_log [H]; dt_bias [H*K]
    (read only when `gate_in_kernel`).

    in_ring=False: `states` is the committed state [B, H, K, V] float32 (not modified; `state_slot` is ignored).
        Returns (o [B, T, H, V] in q's dtype, checkpoints [B, T, H, K, V] in `checkpoint_dtype`).
    in_ring=True: `states` is the state ring [B, S, H, K, V] float32 (S >= T + 1), `state_slot` [B] int32 each row's
        committed slot; `checkpoint_dtype` must be float32. Returns (o, the ring with token t's state in slot
        (s + 1 + t) mod S), the ring aliased to the output (donate it for a true in-place update).
    """
    batch, seq_len, H, K = q.shape
    V = v.shape[-1]
    block_v = min(block_v, V)
    if V % block_v:
        raise ValueError(f"value head dim V={V} must be a multiple of block_v={block_v}")
    if in_ring:
        if jnp.dtype(checkpoint_dtype) != jnp.float32:
            raise ValueError(f"ring checkpoints are float32 (any slot may become the committed state); got "
                             f"checkpoint_dtype={jnp.dtype(checkpoint_dtype)}")
        states_out = jax.ShapeDtypeStruct(states.shape, jnp.float32)
        first_write, num_out_slots, aliases = 1, states.shape[1], {8: 1}
    else:  # the committed state as a one-slot ring read at slot 0; checkpoint t goes to index t of a fresh output
        states, state_slot = states[:, None], jnp.zeros((batch,), jnp.int32)
        states_out = jax.ShapeDtypeStruct((batch, seq_len, H, K, V), checkpoint_dtype)
        first_write, num_out_slots, aliases = 0, seq_len, {}
    kernel = functools.partial(_verify_kernel, seq_len=seq_len, first_write=first_write, num_out_slots=num_out_slots,
                               head_k=K, block_v=block_v, scale=scale, gate_in_kernel=gate_in_kernel,
                               l2norm_in_kernel=l2norm_in_kernel)
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((batch, seq_len, H, V), q.dtype), states_out),
        grid=(batch, H, V // block_v),
        input_output_aliases=aliases,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="kda_verify",
    )(q, k, v, g, beta, A_log.reshape(H), dt_bias.reshape(H * K), state_slot.astype(jnp.int32),
      states.astype(jnp.float32))


_STATIC = ("scale", "in_ring", "checkpoint_dtype", "gate_in_kernel", "l2norm_in_kernel", "block_v", "num_warps",
           "interpret")
verify_step = jax.jit(verify_call, static_argnames=_STATIC)
verify_step.__doc__ = "`verify_call` under jit."
ring_verify_step = jax.jit(verify_call, static_argnames=_STATIC, donate_argnums=(7,))
ring_verify_step.__doc__ = "`verify_call` under jit with `states` (argument 7, the state ring) donated."
