"""Pallas (Triton lowering) single-token KDA decode over a state pool, updated in place.

One program per (batch row, head, block of BV value columns): it reads the row's packed conv output, computes
l2norm / scale / gate / sigmoid(beta) in registers, loads its [K, BV] slice of the fp32 state from the pool row
`slot_indices[b]`, applies
    S = diag(exp(g)) S;  S += k (beta (v - k^T S))^T;  o = q^T S
and stores the slice back into the same pool buffer (`input_output_aliases`). A row with slot -1 stores zeros to
its output and skips the state store (its load reads row 0 and is discarded). With `out_norm_eps` the launch
also applies the KDA output norm (`common.gated_rms_norm`): the head's last value block to finish (an atomic count
per row and head) norms the head's o, so no norm kernel follows (the layer's `kda_decode_out_norm`).

The per-token math (`token_factors`, `delta_rule_step`) is shared with the verify kernel (pallas_verify.py).
The kernel is memory bound: per row and head it moves K*V*4 bytes in and out. It runs under
`interpret=True` on CPU (the tests do).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from MaxText.kernels import pallas_counts
from MaxText.kernels.kda.common import L2NORM_EPS, gated_rms_norm, thresholded_softplus


def token_factors(q, k, g, beta, alog_ref, dtb_ref, head, *, head_k, scale, gate_in_kernel, l2norm_in_kernel,
                  beta_logit):
    """One token of one head, inside a kernel: returns float32 (q [K] l2-normed if asked and scaled, k [K],
    log-decay g [K], beta scalar).

    q, k, g: [K] loaded values (g is the raw gate input when `gate_in_kernel`: g = -exp(A_log[h]) *
    softplus(g + dt_bias[h]), read from `alog_ref` [H] / `dtb_ref` [H*K]); beta: a scalar, a logit when
    `beta_logit` (then sigmoid(beta)).
    """
    f32 = jnp.float32
    q, k, g, beta = q.astype(f32), k.astype(f32), g.astype(f32), beta.astype(f32)
    if l2norm_in_kernel:
        q = q * jax.lax.rsqrt(jnp.sum(q * q) + L2NORM_EPS)
        k = k * jax.lax.rsqrt(jnp.sum(k * k) + L2NORM_EPS)
    q = q * scale
    if gate_in_kernel:
        g = -jnp.exp(alog_ref[head].astype(f32)) * thresholded_softplus(
            g + dtb_ref[pl.ds(head * head_k, head_k)].astype(f32))
    if beta_logit:
        beta = jax.nn.sigmoid(beta)
    return q, k, g, beta


def delta_rule_step(state, q, k, v, g, beta):
    """One KDA step on a [K, BV] float32 state slice: q, k, g [K], v [BV] float32, beta scalar.

    Returns (new state [K, BV], o [BV]), float32.
    """
    state = state * jnp.exp(g)[:, None]
    predicted = jnp.sum(state * k[:, None], axis=0)  # [BV]
    delta = beta * (v - predicted)
    state = state + k[:, None] * delta[None, :]
    return state, jnp.sum(state * q[:, None], axis=0)


def item_grid(batch: int, num_heads: int, value_blocks: int, columns_fastest: bool) -> tuple[int, int, int]:
    """The launch grid of one program per (row, head, value block). Pallas' Triton lowering makes the first grid
    axis CUDA's x, whose blocks are dispatched first: rows fastest by default; with `columns_fastest` a head's value
    blocks run side by side (they cover its contiguous [K, V] state together)."""
    return (value_blocks, num_heads, batch) if columns_fastest else (batch, num_heads, value_blocks)


def item_ids(columns_fastest: bool):
    """(row, head, value block) of this program under `item_grid`'s order."""
    first, head, last = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    return (last, head, first) if columns_fastest else (first, head, last)


def _decode_kernel(qkv_ref, a_ref, b_ref, alog_ref, dtb_ref, slot_ref, pool_ref, *refs, num_heads, head_k, head_v,
                   block_v, scale, gate_in_kernel, l2norm_in_kernel, beta_logit, columns_fastest, out_norm_eps,
                   interpret):
    """refs: (o, pool out); with the output norm (out_norm_eps set) (gate, norm scale, [counts in], o, pool out,
    [raw o, counts]) -- the bracketed ones when a head spans several value blocks."""
    row, head, vblk = item_ids(columns_fastest)
    H, K = num_heads, head_k
    value_blocks = head_v // block_v
    if out_norm_eps is None:
        o_ref, pool_out_ref = refs
    elif value_blocks == 1:
        gate_ref, norm_scale_ref, o_ref, pool_out_ref = refs
    else:
        gate_ref, norm_scale_ref, _, o_ref, pool_out_ref, raw_ref, counts_ref = refs
    slot = slot_ref[row]
    valid = slot >= 0
    safe = jnp.where(valid, slot, 0)  # a padding row reads pool row 0 and stores nothing
    cols = pl.ds(vblk * block_v, block_v)
    q, k, g, beta = token_factors(
        qkv_ref[row, pl.ds(head * K, K)], qkv_ref[row, pl.ds(H * K + head * K, K)],
        a_ref[row, pl.ds(head * K, K)], b_ref[row, head], alog_ref, dtb_ref, head, head_k=K, scale=scale,
        gate_in_kernel=gate_in_kernel, l2norm_in_kernel=l2norm_in_kernel, beta_logit=beta_logit)
    v = qkv_ref[row, pl.ds(2 * H * K + head * head_v + vblk * block_v, block_v)].astype(jnp.float32)  # [BV]
    state = pool_ref[safe, head, :, cols]
    state, o = delta_rule_step(state, q, k, v, g, beta)  # [K, BV], [BV]
    if out_norm_eps is None:
        o_ref[row, head, cols] = jnp.where(valid, o, 0.0).astype(o_ref.dtype)
    elif value_blocks > 1:
        raw_ref[row, head, cols] = o.astype(raw_ref.dtype)
    pltriton.store(pool_out_ref.at[safe, head, :, cols], state, mask=jnp.broadcast_to(valid, state.shape))
    if out_norm_eps is None:
        return

    def normalize(o_head):  # [V] in the output dtype -> the head's gated norm, stored
        gate = gate_ref[row, pl.ds(head * head_v, head_v)]
        normed = gated_rms_norm(o_head, gate, norm_scale_ref[...], out_norm_eps)
        o_ref[row, head, :] = jnp.where(valid, normed, 0.0).astype(o_ref.dtype)

    if value_blocks == 1:
        normalize(o.astype(o_ref.dtype))
        return
    # The head's last value block to finish norms the whole head (its blocks' raw outputs all written: the count is
    # an atomic read-modify-write, acquire and release at GPU scope, after a CTA barrier over this block's stores),
    # then takes the head's counts back to zero.
    pallas_counts.count_then_finish(counts_ref, row * H + head, value_blocks,
                                    lambda: normalize(raw_ref[row, head, :]), interpret)


def decode_call(mixed_qkv, a, b, A_log, dt_bias, state_pool, slot_indices, *, num_heads, head_dim, scale,
                gate_in_kernel=True, l2norm_in_kernel=True, beta_logit=True, block_v=32, num_warps=4,
                columns_fastest=False, out_dtype=None, out_gate=None, out_norm_scale=None, out_norm_eps=None,
                norm_counts=None, interpret=False):
    """One token per row. Shapes as `packed_decode.packed_decode_kda_reference`; `state_pool` is aliased to the
    second output (donate it, as `decode_step` does, for a true in-place update).
    With gate_in_kernel=False, `a` is the log-decay g itself; with beta_logit=False, `b` is beta itself.
    columns_fastest: `item_grid`'s order.
    out_gate [B, H*V], out_norm_scale [V], out_norm_eps: the output is the KDA output norm
    `common.gated_rms_norm(o, gate, scale, eps)` of o rounded to its dtype (the head's last value block to finish
    computes it: one launch, no norm kernel after it; a head's blocks count themselves done on int32 counters [B*H]).
    norm_counts [B, H] int32 zeros: those counters, left zero by the launch (`pallas_counts`), so that a buffer kept
    between steps (the KDA decode cache's `norm_counts`) needs no zeros made per launch; default: zeros made here.
    Returns (o [B, H, V] in `out_dtype` (default: mixed_qkv's dtype), the updated pool), with norm_counts given also
    norm_counts after the launch (zero; the same array where the launch does not count).
    """
    batch = mixed_qkv.shape[0]
    H, K = num_heads, head_dim
    V = state_pool.shape[-1]
    block_v = min(block_v, V)
    if V % block_v:
        raise ValueError(f"value head dim V={V} must be a multiple of block_v={block_v}")
    o_type = jax.ShapeDtypeStruct((batch, H, V), mixed_qkv.dtype if out_dtype is None else out_dtype)
    inputs = [mixed_qkv, a, b, A_log.reshape(H), dt_bias.reshape(H * K), slot_indices.astype(jnp.int32), state_pool]
    outputs = [o_type, jax.ShapeDtypeStruct(state_pool.shape, jnp.float32)]
    aliases = {6: 1}
    counts = pallas_counts.counters(norm_counts, (batch, H), "norm_counts", "rows, heads")
    counting = out_norm_eps is not None and V > block_v
    if out_norm_eps is not None:
        if out_gate is None or out_norm_scale is None:
            raise ValueError("out_norm_eps needs out_gate [B, H*V] and out_norm_scale [V]")
        inputs += [out_gate.reshape(batch, H * V), out_norm_scale.reshape(V)]
        if counting:  # the head's blocks' raw outputs, and a count of its finished blocks
            inputs.append(counts.reshape(-1))
            outputs += [o_type, jax.ShapeDtypeStruct((batch * H,), jnp.int32)]
            aliases[len(inputs) - 1] = 3
    kernel = functools.partial(_decode_kernel, num_heads=H, head_k=K, head_v=V, block_v=block_v, scale=scale,
                               gate_in_kernel=gate_in_kernel, l2norm_in_kernel=l2norm_in_kernel, beta_logit=beta_logit,
                               columns_fastest=columns_fastest, out_norm_eps=out_norm_eps, interpret=interpret)
    results = pl.pallas_call(
        kernel,
        out_shape=tuple(outputs),
        grid=item_grid(batch, H, V // block_v, columns_fastest),
        input_output_aliases=aliases,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="kda_packed_decode",
    )(*inputs)
    if norm_counts is None:
        return results[0], results[1]
    return results[0], results[1], results[3].reshape(batch, H) if counting else norm_counts


decode_step = jax.jit(decode_call, donate_argnums=(5,),
                      static_argnames=("num_heads", "head_dim", "scale", "gate_in_kernel", "l2norm_in_kernel",
                                       "beta_logit", "block_v", "num_warps", "columns_fastest",
                                       "out_dtype", "out_norm_eps", "interpret"))
decode_step.__doc__ = "`decode_call` under jit, with the state pool (argument 5) donated."
