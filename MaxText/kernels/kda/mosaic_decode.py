"""Pallas (Mosaic GPU, Hopper) single-token KDA decode over a state pool, updated in place: the state slices
streamed through shared memory by TMA.

The Triton-lowered kernel (pallas_decode.py) loads a state slice into registers and does its math before its
program ends, so the math is not hidden behind the traffic. Here each CTA (one warpgroup, 128 threads) is
persistent: it walks the items (batch row, head) `program, program + G, ...`, with `stages` items' [K, V] fp32 state
slices (64 KB each) and token inputs in shared memory, the next ones loading while it computes one. Thread `j` owns
value column `j`, so every reduction over the K state rows stays in one thread. Per item, with q and k the raw
inputs, rq = 1 / |q|, rk = 1 / |k| (eps inside the sqrt), e = exp(g):

    row factors (thread i: row i, shared through shared memory):  e_i k_i rk,  e_i q_i rq scale,  e_i,  k_i rk
    pass 1 over the rows:  P_j = sum_i (e_i k_i rk) S_ij,   O_j = sum_i (e_i q_i rq scale) S_ij
    delta_j = beta (v_j - P_j),   o_j = O_j + scale rq rk (q.k) delta_j
    pass 2 over the rows:  S'_ij = e_i S_ij + (k_i rk) delta_j    -> stored to the pool row

which is `pallas_decode.delta_rule_step` with q and k l2-normed (o from the new state, expanded). A padding row
(slot -1) reads pool row 0, stores a zero output and no state.

K = V = 128 only (one value column per thread); `pallas_ops.decode_kernel` takes it from 64 rows on Hopper
(benchmarks/RESULTS.md). Runs under Mosaic GPU's CPU interpreter with `interpret=True` (the tests do).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from MaxText.kernels.kda.common import L2NORM_EPS, SOFTPLUS_THRESHOLD

HEAD_DIM = 128  # K = V: one value column per thread of the warpgroup
STAGES = 3  # items in shared memory at once (3 x 64 KB of state)
ROWS_PER_ITERATION = 32  # state rows per loop iteration (unrolled)
NUM_FACTORS = 4  # the row factors above


def interpret_params():
    """Mosaic GPU's CPU interpreter (its parameters class has no public name in JAX 0.10-0.11)."""
    from jax._src.pallas.mosaic_gpu.interpret import params  # pylint: disable=import-outside-toplevel
    return params.InterpretGPUParams()


def default_programs() -> int:
    """One persistent CTA per SM (its shared memory holds the stages)."""
    return int(getattr(jax.devices()[0], "core_count", 0) or 132)


def _softplus(x):
    """`common.thresholded_softplus` without log1p (Mosaic GPU does not lower it): log1p(e) = log(w) e / (w - 1)
    with w = 1 + e rounded (exact to a few ulp), and e itself where w rounds to 1."""
    e = jnp.exp(jnp.minimum(x, SOFTPLUS_THRESHOLD))
    w = 1.0 + e
    log1p = jnp.where(w == 1.0, e, jnp.log(w) * (e / (w - 1.0)))
    return jnp.where(x > SOFTPLUS_THRESHOLD, x, log1p)


def _row_loop(num_rows, rows_per_iteration, body, init):
    """fori_loop over rows, `rows_per_iteration` rows unrolled per iteration: body(row, carry) -> carry."""
    def group(i, carry):
        for r in range(rows_per_iteration):
            carry = body(i * rows_per_iteration + r, carry)
        return carry
    return jax.lax.fori_loop(0, num_rows // rows_per_iteration, group, init)


def _decode_kernel(qkv_ref, a_ref, b_ref, alog_ref, dtb_ref, slot_ref, pool_ref, o_ref, pool_out_ref,
                   state_s, q_s, k_s, v_s, a_s, dtb_s, factors_s, bars, *, num_heads, num_items, programs, scale,
                   stages, rows_per_iteration):
    """pool_ref is read by TMA, pool_out_ref written (the same Ref on the GPU; see decode_call)."""
    H, K = num_heads, HEAD_DIM
    f32 = jnp.float32
    program = jax.lax.axis_index("program")
    count = (num_items - program + programs - 1) // programs  # items of this CTA

    def item_of(n):  # (batch row, head) of this CTA's n-th item (n clamped to its last)
        item = program + jnp.minimum(n, count - 1) * programs
        return item // H, item % H

    def fetch(n, stage, pool_row):  # TMA the n-th item's state slice (pool row `pool_row`) and inputs into `stage`
        row, head = item_of(n)
        bar = bars.at[stage]
        plgpu.copy_gmem_to_smem(pool_ref.at[pool_row, head], state_s.at[stage], bar)
        plgpu.copy_gmem_to_smem(qkv_ref.at[row, pl.ds(head * K, K)], q_s.at[stage], bar)
        plgpu.copy_gmem_to_smem(qkv_ref.at[row, pl.ds((H + head) * K, K)], k_s.at[stage], bar)
        plgpu.copy_gmem_to_smem(qkv_ref.at[row, pl.ds(2 * H * K + head * K, K)], v_s.at[stage], bar)
        plgpu.copy_gmem_to_smem(a_ref.at[row, pl.ds(head * K, K)], a_s.at[stage], bar)
        plgpu.copy_gmem_to_smem(dtb_ref.at[pl.ds(head * K, K)], dtb_s.at[stage], bar)

    def scalars(n):  # (slot, beta logit, A_log) of the n-th item: loaded an item ahead of their use
        row, head = item_of(n)
        return slot_ref[row], b_ref[row, head].astype(f32), alog_ref[head]

    def pool_row(n):  # the pool row the n-th item's state is read from: a padding row (slot -1) reads row 0
        return jnp.maximum(slot_ref[item_of(n)[0]], 0)

    for n in range(stages):
        @pl.when(n < count)
        def _():
            fetch(n, n, pool_row(n))

    def item_step(n, current):
        slot, beta_logit, alog = current
        upcoming = scalars(n + 1)
        refill_row = pool_row(n + stages)  # loaded now, used after the item's math
        stage = n % stages
        row, head = item_of(n)
        beta = 1.0 / (1.0 + jnp.exp(-beta_logit))
        plgpu.barrier_wait(bars.at[stage])
        # [K] vectors, thread i holding element i
        q, k = q_s[stage].astype(f32), k_s[stage].astype(f32)
        rq, rk = jax.lax.rsqrt(jnp.sum(q * q) + L2NORM_EPS), jax.lax.rsqrt(jnp.sum(k * k) + L2NORM_EPS)
        qk = jnp.sum(q * k)
        e = jnp.exp(-jnp.exp(alog) * _softplus(a_s[stage].astype(f32) + dtb_s[stage]))
        factors_s[0] = e * k * rk
        factors_s[1] = e * q * (scale * rq)
        factors_s[2] = e
        factors_s[3] = k * rk
        plgpu.commit_smem()  # every thread sees every row's factors

        def reduce_row(i, acc):  # pass 1
            p, o = acc
            state_row = state_s[stage, i]  # [V]
            return p + factors_s[0, i] * state_row, o + factors_s[1, i] * state_row

        zeros = state_s[stage, 0] * 0.0  # in the rows' layout
        p, o = _row_loop(K, rows_per_iteration, reduce_row, (zeros, zeros))
        delta = beta * (v_s[stage].astype(f32) - p)  # [V]
        out = o + (scale * rq * rk * qk) * delta
        valid = jnp.broadcast_to(slot >= 0, out.shape)  # Mosaic GPU's select takes no scalar predicate
        o_ref[row, head] = jnp.where(valid, out, 0.0).astype(o_ref.dtype)

        @pl.when(slot >= 0)
        def _():
            def store_row(i, carry):  # pass 2
                pool_out_ref[slot, head, i] = factors_s[2, i] * state_s[stage, i] + factors_s[3, i] * delta
                return carry
            _row_loop(K, rows_per_iteration, store_row, 0)

        plgpu.commit_smem()  # every thread is done with `stage` and the factors

        @pl.when(n + stages < count)
        def _():
            fetch(n + stages, stage, refill_row)
        return upcoming

    jax.lax.fori_loop(0, count, item_step, scalars(0))


def decode_call(mixed_qkv, a, b, A_log, dt_bias, state_pool, slot_indices, *, num_heads, head_dim, scale,
                out_dtype=None, programs=None, stages=STAGES, rows_per_iteration=ROWS_PER_ITERATION, interpret=False):
    """One token per row: `pallas_decode.decode_call`'s inputs, the gate and beta logit computed in kernel.
    The kernel updates `state_pool` [S, H, 128, 128] in place (a JAX Ref aliased in and out of it: donate the pool
    for a true in-place update). programs: persistent CTAs (default: one per SM); stages: items in shared memory;
    rows_per_iteration: the unroll of the loops over the K state rows.
    interpret=True runs Mosaic GPU's CPU interpreter, which takes no Refs: the kernel then writes the updated rows
    into a fresh buffer and the rows of valid slots are taken from it (the GPU benchmark checks the in-place update).
    Returns (o [B, H, V] in `out_dtype` (default: mixed_qkv's dtype), the updated pool)."""
    batch = mixed_qkv.shape[0]
    H, K = num_heads, head_dim
    if K != HEAD_DIM or state_pool.shape[-1] != HEAD_DIM:
        raise ValueError(f"the Mosaic GPU decode kernel needs K = V = {HEAD_DIM}; got K={K}, "
                         f"V={state_pool.shape[-1]}")
    if K % rows_per_iteration:
        raise ValueError(f"rows_per_iteration={rows_per_iteration} must divide K={K}")
    num_items = batch * H
    programs = min(programs or (2 if interpret else default_programs()), num_items)
    item_kernel = functools.partial(_decode_kernel, num_heads=H, num_items=num_items, programs=programs, scale=scale,
                                    stages=stages, rows_per_iteration=rows_per_iteration)
    in_dtype = mixed_qkv.dtype
    o_type = jax.ShapeDtypeStruct((batch, H, K), in_dtype if out_dtype is None else out_dtype)
    scratch = [plgpu.SMEM((stages, K, K), jnp.float32)]
    scratch += [plgpu.SMEM((stages, K), dtype) for dtype in (in_dtype, in_dtype, in_dtype, a.dtype, jnp.float32)]
    scratch += [plgpu.SMEM((NUM_FACTORS, K), jnp.float32), plgpu.Barrier(num_arrivals=6, num_barriers=stages)]

    def launch(body, out_type):  # scratch through run_scoped (as plgpu.kernel does), which Refs pass through
        def with_scratch(*refs):
            pl.run_scoped(lambda *scratch_refs: body(*refs, *scratch_refs), *scratch)
        return pl.kernel(with_scratch, out_type=out_type, mesh=plgpu.Mesh(grid=(programs,), grid_names=("program",)),
                         compiler_params=plgpu.CompilerParams(unsafe_no_auto_barriers=True),
                         interpret=interpret_params() if interpret else False, name="kda_packed_decode_mosaic")

    slots = slot_indices.astype(jnp.int32)
    inputs = (mixed_qkv, a, b, A_log.reshape(H).astype(jnp.float32), dt_bias.reshape(H * K).astype(jnp.float32),
              slots)
    if interpret:
        o, written = launch(item_kernel, (o_type, jax.ShapeDtypeStruct(state_pool.shape, jnp.float32)))(
            *inputs, state_pool)
        rows = state_pool.shape[0]
        updated = jnp.zeros(rows, bool).at[jnp.where(slots >= 0, slots, rows)].set(True, mode="drop")
        return o, jnp.where(updated[:, None, None, None], written, state_pool)

    def in_place_kernel(*refs):  # (inputs..., pool, o, scratch...): the pool Ref is read and written
        item_kernel(*refs[:7], refs[7], refs[6], *refs[8:])
    pool_ref = jax.new_ref(state_pool)
    o = launch(in_place_kernel, o_type)(*inputs, pool_ref)
    return o, pool_ref[...]


decode_step = jax.jit(decode_call, donate_argnums=(5,),
                      static_argnames=("num_heads", "head_dim", "scale", "out_dtype", "programs", "stages",
                                       "rows_per_iteration", "interpret"))
decode_step.__doc__ = "`decode_call` under jit, with the state pool (argument 5) donated."
