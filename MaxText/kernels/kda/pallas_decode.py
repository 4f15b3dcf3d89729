"""Pallas (Triton lowering) single-token KDA decode over a state pool, updated in place.

One program per (batch row, head, block of BV value columns): it reads the row's packed conv output, computes
l2norm / scale / gate / sigmoid(beta) in registers, loads its [K, BV] slice of the fp32 state from the pool row
`slot_indices[b]`, applies
    S = diag(exp(g)) S;  S += k (beta (v - k^T S))^T;  o = q^T S
and stores the slice back into the same pool buffer (`input_output_aliases`). A row with slot -1 stores zeros to
its output and skips the state store (its load reads row 0 and is discarded).

Persistent form (`programs=P`): P programs loop over the same items, program p taking items p, p + P, ...; each
iteration issues the next item's loads (state slice and token inputs) before the current item's math and stores,
so that a program's state traffic overlaps its own math rather than waiting on it.

The per-token math (`token_factors`, `delta_rule_step`) is shared with the verify kernel (pallas_verify.py).
The kernel is memory bound: per row and head it moves K*V*4 bytes in and out. It runs under
`interpret=True` on CPU (the tests do).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from MaxText.kernels.kda.common import L2NORM_EPS, thresholded_softplus


def gate_params(alog_ref, dtb_ref, head, *, head_k, gate_in_kernel):
    """Head `head`'s (A_log scalar, dt_bias [K]) loaded from `alog_ref` [H] / `dtb_ref` [H*K], or (None, None) when
    the gate is not computed in the kernel."""
    if not gate_in_kernel:
        return None, None
    return alog_ref[head], dtb_ref[pl.ds(head * head_k, head_k)]


def token_factors(q, k, g, beta, alog, dtb, *, scale, gate_in_kernel, l2norm_in_kernel, beta_logit):
    """One token of one head, inside a kernel: returns float32 (q [K] l2-normed if asked and scaled, k [K],
    log-decay g [K], beta scalar).

    q, k, g: [K] loaded values (g is the raw gate input when `gate_in_kernel`: g = -exp(alog) * softplus(g + dtb),
    with the head's loaded A_log scalar and dt_bias [K] from `gate_params`); beta: a scalar, a logit when
    `beta_logit` (then sigmoid(beta)).
    """
    f32 = jnp.float32
    q, k, g, beta = q.astype(f32), k.astype(f32), g.astype(f32), beta.astype(f32)
    if l2norm_in_kernel:
        q = q * jax.lax.rsqrt(jnp.sum(q * q) + L2NORM_EPS)
        k = k * jax.lax.rsqrt(jnp.sum(k * k) + L2NORM_EPS)
    q = q * scale
    if gate_in_kernel:
        g = -jnp.exp(alog.astype(f32)) * thresholded_softplus(g + dtb.astype(f32))
    if beta_logit:
        beta = jax.nn.sigmoid(beta)
    return q, k, g, beta


def delta_rule_step(state, q, k, v, g, beta):
    """One KDA step on a [K, BV] float32 state slice: q, k, g [K], v [BV] float32, beta scalar.
    Returns (new state [K, BV], o [BV]), float32."""
    state = state * jnp.exp(g)[:, None]
    predicted = jnp.sum(state * k[:, None], axis=0)  # [BV]
    delta = beta * (v - predicted)
    state = state + k[:, None] * delta[None, :]
    return state, jnp.sum(state * q[:, None], axis=0)


class _Item(NamedTuple):
    """One work item of the decode kernel, loaded: (row, head, block of value columns) and its inputs as loaded
    (q, k, g [K], beta scalar, v [BV]; A_log, dt_bias of the head, or None; the [K, BV] fp32 state slice)."""
    row: jax.Array
    head: jax.Array
    vblk: jax.Array
    slot: jax.Array
    q: jax.Array
    k: jax.Array
    g: jax.Array
    beta: jax.Array
    v: jax.Array
    alog: jax.Array | None
    dtb: jax.Array | None
    state: jax.Array


def _load_item(refs, row, head, vblk, *, num_heads, head_k, head_v, block_v, gate_in_kernel):
    """Issues every load of item (row, head, vblk): the token's inputs and the state slice of pool row slot[row]
    (row 0 for a padding row; its result is never stored)."""
    qkv_ref, a_ref, b_ref, alog_ref, dtb_ref, slot_ref, pool_ref = refs
    H, K = num_heads, head_k
    slot = slot_ref[row]
    alog, dtb = gate_params(alog_ref, dtb_ref, head, head_k=K, gate_in_kernel=gate_in_kernel)
    return _Item(row, head, vblk, slot,
                 q=qkv_ref[row, pl.ds(head * K, K)], k=qkv_ref[row, pl.ds(H * K + head * K, K)],
                 g=a_ref[row, pl.ds(head * K, K)], beta=b_ref[row, head],
                 v=qkv_ref[row, pl.ds(2 * H * K + head * head_v + vblk * block_v, block_v)], alog=alog, dtb=dtb,
                 state=pool_ref[jnp.where(slot >= 0, slot, 0), head, :, pl.ds(vblk * block_v, block_v)])


def _update_item(item: _Item, o_ref, pool_out_ref, live, *, block_v, scale, gate_in_kernel, l2norm_in_kernel,
                 beta_logit):
    """The item's math and stores: o (zeros for a padding row) and, for a real row, the new state slice in place.
    Nothing is stored when `live` is False (a persistent program's iteration past the last item)."""
    valid = item.slot >= 0
    q, k, g, beta = token_factors(item.q, item.k, item.g, item.beta, item.alog, item.dtb, scale=scale,
                                  gate_in_kernel=gate_in_kernel, l2norm_in_kernel=l2norm_in_kernel,
                                  beta_logit=beta_logit)
    state, o = delta_rule_step(item.state, q, k, item.v.astype(jnp.float32), g, beta)
    cols = pl.ds(item.vblk * block_v, block_v)
    pltriton.store(o_ref.at[item.row, item.head, cols], jnp.where(valid, o, 0.0).astype(o_ref.dtype),
                   mask=jnp.broadcast_to(live, o.shape))
    pltriton.store(pool_out_ref.at[jnp.where(valid, item.slot, 0), item.head, :, cols], state,
                   mask=jnp.broadcast_to(valid & live, state.shape))


def _decode_kernel(*refs, layout, update):
    """One program per item (grid (row, head, value block))."""
    item = _load_item(refs[:7], pl.program_id(0), pl.program_id(1), pl.program_id(2), **layout)
    update(item, *refs[7:], True)


def _persistent_decode_kernel(*refs, layout, update, programs, num_items, iterations):
    """`programs` programs; program p takes items p, p + programs, ... (item = (row * H + head) * value blocks +
    block): each iteration issues the next item's loads before the current item's math and stores, so a program's
    state traffic overlaps its own math."""
    blocks = layout["head_v"] // layout["block_v"]
    heads_blocks = layout["num_heads"] * blocks

    def load(item):
        item = jnp.minimum(item, num_items - 1)  # past the end: a valid address, loaded and never stored
        return _load_item(refs[:7], item // heads_blocks, (item // blocks) % layout["num_heads"], item % blocks,
                          **layout)

    first = pl.program_id(0)  # read outside the loop (the CPU interpreter substitutes it only there)

    def iteration(i, current):
        item = first + i * programs
        following = load(item + programs)
        update(current, *refs[7:], item < num_items)
        return following

    jax.lax.fori_loop(0, iterations, iteration, load(first))


def decode_call(mixed_qkv, a, b, A_log, dt_bias, state_pool, slot_indices, *, num_heads, head_dim, scale,
                gate_in_kernel=True, l2norm_in_kernel=True, beta_logit=True, block_v=32, num_warps=4,
                programs=None, out_dtype=None, interpret=False):
    """One token per row. Shapes as `packed_decode.packed_decode_kda_reference`; `state_pool` is aliased to the
    second output (donate it, as `decode_step` does, for a true in-place update).
    With gate_in_kernel=False, `a` is the log-decay g itself; with beta_logit=False, `b` is beta itself.
    programs: None, one program per (row, head, block of block_v value columns);
    an int, that many persistent programs looping over those items, each loading its next item while it computes
    the current one (`_persistent_decode_kernel`).
    Returns (o [B, H, V] in `out_dtype` (default: mixed_qkv's dtype), the updated pool).
    """
    batch = mixed_qkv.shape[0]
    H, K = num_heads, head_dim
    V = state_pool.shape[-1]
    block_v = min(block_v, V)
    if V % block_v:
        raise ValueError(f"value head dim V={V} must be a multiple of block_v={block_v}")
    if programs is not None and programs < 1:
        raise ValueError(f"programs={programs}: expected None or a positive number of persistent programs")
    layout = dict(num_heads=H, head_k=K, head_v=V, block_v=block_v, gate_in_kernel=gate_in_kernel)
    update = functools.partial(_update_item, block_v=block_v, scale=scale, gate_in_kernel=gate_in_kernel,
                               l2norm_in_kernel=l2norm_in_kernel, beta_logit=beta_logit)
    num_items = batch * H * (V // block_v)
    if programs is None:
        kernel, grid = functools.partial(_decode_kernel, layout=layout, update=update), (batch, H, V // block_v)
    else:
        programs = min(programs, num_items)
        kernel = functools.partial(_persistent_decode_kernel, layout=layout, update=update, programs=programs,
                                   num_items=num_items, iterations=-(-num_items // programs))
        grid = (programs,)
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((batch, H, V), mixed_qkv.dtype if out_dtype is None else out_dtype),
                   jax.ShapeDtypeStruct(state_pool.shape, jnp.float32)),
        grid=grid,
        input_output_aliases={6: 1},
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="kda_packed_decode",
    )(mixed_qkv, a, b, A_log.reshape(H), dt_bias.reshape(H * K), slot_indices.astype(jnp.int32), state_pool)


decode_step = jax.jit(decode_call, donate_argnums=(5,),
                      static_argnames=("num_heads", "head_dim", "scale", "gate_in_kernel", "l2norm_in_kernel",
                                       "beta_logit", "block_v", "num_warps", "programs", "out_dtype", "interpret"))
decode_step.__doc__ = "`decode_call` under jit, with the state pool (argument 5) donated."
