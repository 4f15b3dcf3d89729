"""Pallas (Triton lowering): KDA's one-token decode of one row from the layer's input in one launch
(project_decode.py's oracle: the input norm, q / k / v and the gates' products, the short convolution, the packed
decode step on the state pool in place, the output norm).

In the separate launches the recurrence waits for the whole q / k / v product (56.6 MB of weights in the 48B model),
then for the convolution's kernels, then runs alone with the memory idle. Here the recurrence of a head starts as soon
as its own rows of the products are written, while the other heads' weights still stream. Programs, in launch order
(the GPU dispatches a launch's programs in order, so a program waits only for programs dispatched before it):

  1. low-rank products: ROWS rows each of f_a, g_a and b times h = norm_scale * x (a loop over CHUNK input columns
     at a time, CHUNKS_AHEAD of them loaded ahead; float32 sums, rounded to x's dtype);
  2. per head, head after head: the head's q, k and v rows (ROWS per program);
  3. per head: GATE_ROWS rows each of the gate input f_b(f_a) and the output gate g_b(g_a) (the weights loaded, then
     a wait for (1), then the product of the normed low-rank row: one load and one product per program, dispatched
     while (2)'s last programs stream);
  4. per (head, block of value columns): load the state slice, wait for the head's programs of (2) and (3), then the
     convolution (the window read, the new one written out of place), SiLU, `pallas_decode`'s token factors and
     delta rule, the state stored in place; the head's last value block norms the head's output.

Each program of (1), (2) and (3) counts itself done on an int32 counter (after a CTA barrier over its stores, one atomic
add, acquire and release at GPU scope); a waiting program spins on an atomic read of its counter. The counters come
in and go out zero (`counters`: [2 * H + 1] int32, kept between steps by the caller): each counter's last reader takes
its count back. Intermediate products go through two scratch outputs of the launch (bf16 / x's dtype, in L2).

One row (B = 1): the batch-1 decode step, where the latency of this chain is the step's. Runs under `interpret=True`
on CPU (programs in order: every wait is already met).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from MaxText.kernels import pallas_counts
from MaxText.kernels.kda.common import gated_rms_norm
from MaxText.kernels.kda.pallas_decode import delta_rule_step, token_factors
from MaxText.kernels.kda.project_decode import ProjectionWeights, check_inputs

ROWS = 16  # product rows per program
CHUNK = 256  # input columns per load of a product program
CHUNKS_AHEAD = 1  # a product program's weight chunks loaded before the current chunk's products (0: the loop left to
#                  Triton's pipeliner, NUM_STAGES; D / CHUNK - 1 or more: all at once). With each chunk summed at once
#                  and 16 value columns a recurrence program the launch holds 80 registers per thread, so that all
#                  768 product programs of the 48B model are resident at once (6 per SM): the launch took 24.5-24.9 µs
#                  in its KDA layers on an H200, the other forms timed 25.9-39.4, the separate kernels' chain 25.6-26.4
#                  (benchmarks/RESULTS.md, forty-fourth session)
NUM_STAGES = 3  # the pipeliner's stages (CHUNKS_AHEAD = 0)
GATE_ROWS = 64  # f_b / g_b rows per gate program


def counters_shape(num_heads: int) -> tuple[int]:
    """The launch's counters: per head its programs of (2) and (3) done, then (1) done, then per head its value
    blocks done."""
    return (2 * num_heads + 1,)


def unsupported_reason(batch: int, model_dim: int, num_heads: int, head_dim: int, value_dim: int) -> str | None:
    """None when the launch takes these dims: one row; D a multiple of CHUNK (or a power of two below it); H, K and V
    powers of two, or multiples of ROWS (Triton's block shapes)."""
    if batch != 1:
        return f"the one-launch KDA decode takes one row (batch-1 decode), got {batch}"
    chunk = min(CHUNK, model_dim)
    dims = {"D": (model_dim, chunk), "H": (num_heads, min(ROWS, num_heads)), "K": (head_dim, min(ROWS, head_dim)),
            "V": (value_dim, min(ROWS, value_dim))}
    for name, (dim, block) in dims.items():
        if block & (block - 1) or dim % block:
            return (f"the one-launch KDA decode needs D a multiple of {CHUNK} (or a power of two below it) and H, K, "
                    f"V multiples of {ROWS} (or powers of two below it); got {name}={dim}")
    return None


class Layout(NamedTuple):
    """The launch's programs: `low_rank`, then per head `products` (q, k, v rows), then per head `gates` (f_b and g_b
    row blocks), then per head `value_blocks` recurrence programs; a head's recurrence waits for its products and
    gates (`per_head` programs)."""
    low_rank: int
    products: int
    gates: int
    value_blocks: int

    @property
    def per_head(self) -> int:
        return self.products + self.gates


def layout(dims, block_v: int) -> Layout:
    K, H, V = dims.key, dims.heads, dims.value
    rows_k, rows_v = min(ROWS, K), min(ROWS, V)
    return Layout(low_rank=2 * (K // rows_k) + H // min(ROWS, H), products=2 * (K // rows_k) + V // rows_v,
                  gates=K // min(GATE_ROWS, K) + V // min(GATE_ROWS, V), value_blocks=V // block_v)


def _kernel(x_ref, norm_scale_ref, wq_ref, wk_ref, wv_ref, wfa_ref, wga_ref, wb_ref, wfb_ref, wgb_ref, cq_ref, ck_ref,
            cv_ref, window_ref, alog_ref, dtb_ref, out_norm_scale_ref, slot_ref, pool_ref, _counts_in,
            o_ref, pool_out_ref, window_out_ref, counts_ref, products_ref, gates_ref, raw_ref, *, dims, block_v,
            chunks_ahead, scale, norm_eps, out_norm_eps, interpret):
    D, H, K, V, W = dims.model, dims.heads, dims.key, dims.value, dims.width
    f32, dtype = jnp.float32, x_ref.dtype
    chunk = min(CHUNK, D)
    plan = layout(dims, block_v)
    low_rank, per_head, value_blocks = plan.low_rank, plan.per_head, plan.value_blocks
    # products_ref: q | k | v | f_a | g_a | b, the raw products of h, in x's dtype
    offsets = {"q": 0, "k": H * K, "v": 2 * H * K, "f_a": 2 * H * K + H * V, "g_a": 2 * H * K + H * V + K,
               "b": 2 * H * K + H * V + 2 * K}
    low_rank_counter = np.int32(H)  # (the atomics take an array index: a numpy scalar stays a literal)
    program = pl.program_id(0)

    def fresh(ref):  # a value another program wrote in this launch (after its count): a volatile load, past L1
        return pltriton.load(ref, volatile=not interpret)  # (JAX 0.10-0.11 lower no cache_modifier: a key error)

    def count_done(counter, amount=1):
        if not interpret:  # every thread's stores before the count
            pltriton.debug_barrier()
        pltriton.atomic_add(counts_ref, counter, np.int32(amount))

    def wait_for(counter, target):  # spin until counts_ref[counter] >= target (an atomic read each round)
        if interpret:  # programs run one after another in launch order: every wait is met (and the interpreter
            return     # cannot discharge a loop over an atomic)
        lax.while_loop(lambda seen: seen < target, lambda _: pltriton.atomic_add(counts_ref, counter, np.int32(0)),
                       np.int32(-1))
        pltriton.debug_barrier()

    def row_scale():  # the input norm's 1 / rms(x), float32
        squares = jnp.zeros((chunk,), f32)
        for c in range(D // chunk):
            xs = x_ref[0, pl.ds(c * chunk, chunk)].astype(f32)
            squares = squares + xs * xs
        return lax.rsqrt(jnp.sum(squares) / D + norm_eps)

    def product_rows(w_ref, first, rows, name):  # rows [first, first + rows) of w_ref [N, D] times h -> products_ref
        chunks = D // chunk

        def weights(c):  # [rows, chunk]
            return w_ref[pl.ds(first, rows), pl.ds(c * chunk, chunk)]

        def add_chunk(c, acc, w):  # acc [rows] float32
            cols = pl.ds(c * chunk, chunk)
            h = (norm_scale_ref[cols].astype(dtype) * x_ref[0, cols]).astype(f32)  # [chunk], h in x's dtype
            return acc + jnp.sum(w.astype(f32) * h[None, :], axis=1)

        zeros = jnp.zeros((rows,), f32)
        if chunks_ahead >= chunks - 1:  # every chunk's load issued at once
            acc = zeros
            for c in range(chunks):
                acc = add_chunk(c, acc, weights(c))
        elif chunks_ahead:  # chunks c + 1 .. c + chunks_ahead loaded before chunk c's FMAs (the last ones reload)
            def step(c, carry):
                acc, tiles = carry[0], carry[1:]
                return add_chunk(c, acc, tiles[0]), *tiles[1:], weights(jnp.minimum(c + chunks_ahead, chunks - 1))
            acc = lax.fori_loop(0, chunks, step, (zeros, *[weights(c) for c in range(chunks_ahead)]))[0]
        else:  # left to Triton's pipeliner (NUM_STAGES)
            acc = lax.fori_loop(0, chunks, lambda c, acc: add_chunk(c, acc, weights(c)), zeros)
        products_ref[pl.ds(offsets[name] + first, rows)] = acc.astype(dtype)

    # (1) low-rank products
    rows_k, rows_h, rows_v = min(ROWS, K), min(ROWS, H), min(ROWS, V)
    segments = [("f_a", wfa_ref, rows_k, K // rows_k), ("g_a", wga_ref, rows_k, K // rows_k),
                ("b", wb_ref, rows_h, H // rows_h)]
    start = 0
    for name, w_ref, rows, count in segments:
        @pl.when((program >= start) & (program < start + count))
        def _low_rank(name=name, w_ref=w_ref, rows=rows, start=start):
            product_rows(w_ref, (program - start) * rows, rows, name)
            count_done(low_rank_counter)
        start += count

    # (2) per head: q, k, v rows
    head_parts = [("q", wq_ref, rows_k, K // rows_k, K), ("k", wk_ref, rows_k, K // rows_k, K),
                  ("v", wv_ref, rows_v, V // rows_v, V)]
    in_products = program - low_rank
    head, part = in_products // plan.products, in_products % plan.products
    is_product = (in_products >= 0) & (in_products < H * plan.products)
    first_part = 0
    for name, w_ref, rows, count, width in head_parts:
        @pl.when(is_product & (part >= first_part) & (part < first_part + count))
        def _qkv(name=name, w_ref=w_ref, rows=rows, first_part=first_part, width=width):
            product_rows(w_ref, head * width + (part - first_part) * rows, rows, name)
            count_done(head)
        first_part += count

    # (3) per head: blocks of the gate input f_b(f_a) and the output gate g_b(g_a), from (1)'s normed products
    in_gates = in_products - H * plan.products
    g_head, g_part = in_gates // plan.gates, in_gates % plan.gates
    is_gate = (in_gates >= 0) & (in_gates < H * plan.gates)
    gate_blocks_k = K // min(GATE_ROWS, K)
    gate_parts = [(wfb_ref, "f_a", K, 0, 0, gate_blocks_k), (wgb_ref, "g_a", V, H * K, gate_blocks_k, plan.gates)]
    for w_ref, name, width, offset, first_part, end_part in gate_parts:
        @pl.when(is_gate & (g_part >= first_part) & (g_part < end_part))
        def _gates(w_ref=w_ref, name=name, width=width, offset=offset, first_part=first_part):
            rows = min(GATE_ROWS, width)
            first = g_head * width + (g_part - first_part) * rows
            w = w_ref[pl.ds(first, rows), :].astype(f32)  # [rows, K], loaded before the wait
            s = row_scale()
            wait_for(low_rank_counter, low_rank)
            low = (fresh(products_ref.at[pl.ds(offsets[name], K)]).astype(f32) * s).astype(dtype)  # scale_rows
            gates_ref[pl.ds(offset + first, rows)] = jnp.sum(w * low.astype(f32)[None, :], axis=1).astype(dtype)
            count_done(g_head)
            # (1)'s counter is read by every gate program: each counts itself past it, the last takes it back
            passed = pltriton.atomic_add(counts_ref, low_rank_counter, np.int32(1))

            @pl.when(passed == low_rank + H * plan.gates - 1)
            def _reset():
                pltriton.atomic_add(counts_ref, low_rank_counter, np.int32(-(low_rank + H * plan.gates)))

    # (4) the recurrence per (head, value block)
    decode = in_gates - H * plan.gates
    d_head, vblk = decode // value_blocks, decode % value_blocks

    @pl.when(decode >= 0)
    def _decode():
        slot = slot_ref[0]
        valid = slot >= 0
        safe = jnp.where(valid, slot, 0)
        cols = pl.ds(vblk * block_v, block_v)
        state = pool_ref[safe, d_head, :, cols]  # [K, BV], loaded before the wait
        channels = {"q": pl.ds(d_head * K, K), "k": pl.ds(d_head * K, K),
                    "v": pl.ds(d_head * V + vblk * block_v, block_v)}
        widths = {"q": K, "k": K, "v": block_v}
        window_cols = {"q": pl.ds(channels["q"].start, K), "k": pl.ds(H * K + channels["k"].start, K),
                       "v": pl.ds(2 * H * K + channels["v"].start, block_v)}
        conv_refs = {"q": cq_ref, "k": ck_ref, "v": cv_ref}
        # the inputs that wait for nothing, loaded before the wait: the window's taps (oldest first) and the kernels
        window = {name: [window_ref[0, t, window_cols[name]] for t in range(W - 1)] for name in channels}
        taps = {name: [conv_refs[name][t, channels[name]].astype(f32) for t in range(W)] for name in channels}
        s = row_scale()
        wait_for(d_head, per_head)
        mixed = {}
        for name, ch in channels.items():
            pre = (fresh(products_ref.at[pl.ds(offsets[name] + ch.start, widths[name])]).astype(f32) * s).astype(
                dtype)
            inputs = window[name] + [pre]
            conv = sum(value.astype(f32) * tap for value, tap in zip(inputs, taps[name]))
            mixed[name] = jax.nn.silu(conv).astype(dtype)

            def write_window(inputs=inputs, cols=window_cols[name]):
                for t in range(W - 1):
                    window_out_ref[0, t, cols] = inputs[t + 1].astype(window_out_ref.dtype)
            if name == "v":
                write_window()
            else:  # a head's q / k window columns: its first value block writes them
                pl.when(vblk == 0)(write_window)
        beta_logit = (fresh(products_ref.at[pl.ds(offsets["b"] + d_head, 1)]).astype(f32) * s).astype(dtype)
        gate_input = fresh(gates_ref.at[pl.ds(d_head * K, K)])
        q, k, g, beta = token_factors(mixed["q"], mixed["k"], gate_input, beta_logit[0], alog_ref, dtb_ref, d_head,
                                      head_k=K, scale=scale, gate_in_kernel=True, l2norm_in_kernel=True,
                                      beta_logit=True)
        state, o = delta_rule_step(state, q, k, mixed["v"].astype(f32), g, beta)
        pltriton.store(pool_out_ref.at[safe, d_head, :, cols], state, mask=jnp.broadcast_to(valid, state.shape))

        def finish(o_head):  # the head's output norm; the head's counter of (2) taken back
            out_gate = fresh(gates_ref.at[pl.ds(H * K + d_head * V, V)])
            normed = gated_rms_norm(o_head, out_gate, out_norm_scale_ref[...], out_norm_eps)
            o_ref[0, d_head, :] = jnp.where(valid, normed, 0.0).astype(o_ref.dtype)
            pltriton.atomic_add(counts_ref, d_head, np.int32(-per_head))

        if value_blocks == 1:
            finish(o.astype(o_ref.dtype))
            return
        raw_ref[d_head, cols] = o.astype(raw_ref.dtype)
        pallas_counts.count_then_finish(counts_ref, H + 1 + d_head, value_blocks,
                                        lambda: finish(fresh(raw_ref.at[d_head, :])), interpret)


def project_and_decode(x, norm_scale, weights: ProjectionWeights, window, A_log, dt_bias, state_pool, slot_indices,
                       out_norm_scale, counts=None, *, num_heads: int, head_dim: int, norm_eps: float,
                       out_norm_eps: float, scale: float | None = None, block_v: int = 16, num_warps: int = 4,
                       chunks_ahead: int = CHUNKS_AHEAD, interpret: bool = False):
    """`project_decode.project_and_decode_reference` in one launch, B = 1. `state_pool` is aliased to the second
    output (donate it for a true in-place update); `counts` [2 * H + 1] int32 zeros (`counters_shape`; default: zeros
    made here) likewise to the fourth, zero again after the launch.
    Returns (o [1, H, V] in x's dtype, the updated pool, the new window [1, W-1, 3*H*K], the counts)."""
    dims = check_inputs(x, norm_scale, weights, window, state_pool, slot_indices, num_heads, head_dim)
    H, K, V = dims.heads, dims.key, dims.value
    reason = unsupported_reason(dims.batch, dims.model, H, K, V)
    if reason:
        raise ValueError(reason)
    block_v = min(block_v, V)
    if chunks_ahead < 0:
        raise ValueError(f"chunks_ahead must be >= 0, got {chunks_ahead}")
    if V % block_v:
        raise ValueError(f"value head dim V={V} must be a multiple of block_v={block_v}")
    counts = pallas_counts.counters(counts, counters_shape(H), "counts", "heads' products, low-rank products, "
                                                                         "heads' value blocks")
    plan = layout(dims, block_v)
    dtype = x.dtype
    inputs = [x, norm_scale, *weights, window, A_log.reshape(H).astype(jnp.float32),
              dt_bias.reshape(H * K).astype(jnp.float32), out_norm_scale.reshape(V), slot_indices.astype(jnp.int32),
              state_pool, counts]
    outputs = [jax.ShapeDtypeStruct((1, H, V), dtype), jax.ShapeDtypeStruct(state_pool.shape, jnp.float32),
               jax.ShapeDtypeStruct(window.shape, window.dtype), jax.ShapeDtypeStruct(counts.shape, jnp.int32),
               jax.ShapeDtypeStruct((2 * H * K + H * V + 2 * K + H,), dtype),  # the raw products
               jax.ShapeDtypeStruct((H * K + H * V,), dtype),  # the gate input and the output gate
               jax.ShapeDtypeStruct((H, V), dtype)]  # the heads' outputs before their norm
    kernel = functools.partial(_kernel, dims=dims, block_v=block_v, chunks_ahead=chunks_ahead,
                               scale=K ** -0.5 if scale is None else float(scale), norm_eps=norm_eps,
                               out_norm_eps=out_norm_eps, interpret=interpret)
    o, pool, new_window, counts, *_ = pl.pallas_call(
        kernel, out_shape=tuple(outputs), grid=(plan.low_rank + H * (plan.per_head + plan.value_blocks),),
        input_output_aliases={len(inputs) - 2: 1, len(inputs) - 1: 3},
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=NUM_STAGES),
        interpret=interpret, name="kda_project_decode")(*inputs)
    return o, pool, new_window, counts
