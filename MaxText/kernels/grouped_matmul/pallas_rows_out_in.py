"""Pallas (Triton lowering): the grouped matmul's few-row form for weights stored [E, N, K] (each group's matrix as
torch's Linear.weight; an MoE's experts with config key `expert_kernel_layout: out_in`), one output row of a group's
matrix per warp:

    outs = grouped_matmul_out_in(rows, weights, row_groups, extra_weights=..., rows_per_token=..., glu=...)
    rows [M, K] (or [T, K] tokens with rows_per_token), weights: tuple of [E, N, K], row_groups [L] int32
    -> one [M, N] product per weight array (glu: the one array SiLU(gate) * up)

Program (row, block of `block_rows` output features) on one warp: each feature's weights are a contiguous row of K,
streamed in chunks of CHUNK columns with `chunks_ahead` chunks loaded before the current chunk's FMAs, float32 sums;
several weight arrays (an MoE's gate and up) in the same program, the SwiGLU applied to its accumulators (glu).
A row of group g >= E uses extra matrix g - E (rows from L on: extra matrix 0, e.g. an MoE's shared expert as one
more row per token). Rows per token: row r < T * rows_per_token reads token r // rows_per_token, the extra rows after
them token r - T * rows_per_token (no repeated copy). `naive.rows_out_in` is the oracle.

Measured on an H200 (JAX 0.11.2, benchmarks/RESULTS.md, forty-seventh session), Kimi-Linear-48B's 8 routed experts
and shared expert at batch 1 in a model of 8 KDA + MoE layers: from the router's end to the next layer's start 35.5-35.8
us against the [E, K, N] `rows` grid's 38.2-38.9 (gate and up one launch of 1-feature programs, down 2-feature
programs: the defaults here); the layer 71.4-72.0 vs 75.1-75.7 us.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from MaxText.kernels.grouped_matmul import check_glu_weights, product_rows, silu_glu
from MaxText.kernels.grouped_matmul.pallas_gmm import BLOCK_CHOICES, row_group_and_source

CHUNK = 256  # columns of K per load (a power of two down to 16 where K is not a multiple)
CHUNKS_AHEAD = 3  # chunks loaded before the current chunk's FMAs (2 and 5 timed within 0.3 us of it)
BLOCK_ROWS_GLU = 1  # output features a program: gate / up (two arrays, SwiGLU in the kernel)
BLOCK_ROWS = 2  # output features a program: one array (down: 11.9-12.1 us vs 14.6 with 1, 13.1 with 4)
NUM_WARPS = 1  # (down with 2 features on 2 warps, or 4 on 4: 15.2 us)


def chunk_for(contract_dim: int) -> int | None:
    """The K chunk: CHUNK, or the largest power of two from 16 up that divides K; None when none does."""
    return next((c for c in (CHUNK, *BLOCK_CHOICES) if contract_dim % c == 0), None)


def unsupported_reason(contract_dim: int, out_dim: int, block_rows: int) -> str | None:
    """None when the kernel takes these dims."""
    if chunk_for(contract_dim) is None:
        return f"the [E, N, K] rows kernel needs K a multiple of 16, got K={contract_dim}"
    if out_dim % block_rows:
        return f"the [E, N, K] rows kernel needs N a multiple of block_rows={block_rows}, got N={out_dim}"
    return None


def _kernel(groups_ref, rows_ref, *refs, num_weights, num_outputs, has_extra, listed, num_groups, rows_per_token,
            num_tokens, block_rows, chunk, chunks_ahead, blocks, glu):
    w_refs, out_refs = refs[:num_weights], refs[len(refs) - num_outputs:]
    extra_refs = refs[num_weights:2 * num_weights] if has_extra else ()
    program = pl.program_id(0)
    row, first = program // blocks, (program % blocks) * block_rows
    group, source = row_group_and_source(row, groups_ref, listed, num_groups, rows_per_token,
                                         num_tokens)  # source: the row of `rows` this program reads
    features = pl.ds(first, block_rows)
    num_chunks = w_refs[0].shape[-1] // chunk

    def multiply(matrix_refs, matrix):
        tiles, accs = {}, [jnp.zeros((block_rows,), jnp.float32) for _ in matrix_refs]
        for c in range(num_chunks):  # unrolled: chunks c .. c + chunks_ahead in flight
            for ahead in range(c, min(c + chunks_ahead + 1, num_chunks)):
                if ahead not in tiles:
                    tiles[ahead] = [ref[matrix, features, pl.ds(ahead * chunk, chunk)] for ref in matrix_refs]
            x = rows_ref[source, pl.ds(c * chunk, chunk)].astype(jnp.float32)  # [chunk]
            accs = [acc + jnp.sum(tile.astype(jnp.float32) * x[None, :], axis=1)  # [block_rows]
                    for acc, tile in zip(accs, tiles.pop(c))]
        for acc, out_ref in zip((silu_glu(*accs),) if glu else accs, out_refs):
            out_ref[row, features] = acc.astype(out_ref.dtype)

    if not has_extra:
        multiply(w_refs, group)
        return
    extra = group >= num_groups
    pl.when(jnp.logical_not(extra))(functools.partial(multiply, w_refs, group))
    pl.when(extra)(functools.partial(multiply, extra_refs, group - num_groups))


def grouped_matmul_out_in(rows: jax.Array, weights: tuple, row_groups: jax.Array, *, extra_weights: tuple = (),
                          rows_per_token: int = 0, glu: bool = False, block_rows: int | None = None,
                          num_warps: int = NUM_WARPS, chunks_ahead: int = CHUNKS_AHEAD,
                          interpret: bool = False) -> tuple:
    """See the module docstring: rows [M, K] (rows_per_token: [T, K] tokens), weights a tuple of [E, N, K] arrays,
    extra_weights () or one [X, N, K] array per weight array, row_groups [L] int32 (L = M, or with extra weights
    0 < L <= M; values < E + X) -> a tuple of [M, N] products in rows' dtype (glu: one). block_rows: output
    features a program (default BLOCK_ROWS_GLU with glu, else BLOCK_ROWS). Forward only (decode)."""
    num_groups, out_dim, contract = weights[0].shape
    if any(w.shape != weights[0].shape for w in weights) or rows.shape[-1] != contract:
        raise ValueError(f"expected rows [M, {contract}] and weights of one shape [E, N, K], got rows {rows.shape} "
                         f"and weights {[w.shape for w in weights]}")
    if extra_weights and len(extra_weights) != len(weights):
        raise ValueError(f"expected one extra array per weight array, got {len(extra_weights)} for {len(weights)}")
    check_glu_weights(weights, glu)
    block_rows = block_rows or (BLOCK_ROWS_GLU if glu else BLOCK_ROWS)
    reason = unsupported_reason(contract, out_dim, block_rows)
    if reason:
        raise ValueError(reason)
    num_rows = product_rows(rows, rows_per_token, bool(extra_weights))
    listed = row_groups.shape[0]
    if not (listed == num_rows or extra_weights and 0 < listed < num_rows):
        raise ValueError(f"expected row_groups [{num_rows}] (with extra weights: at least one row, the rows past them "
                         f"of extra group 0), got {row_groups.shape}")
    blocks = out_dim // block_rows
    num_outputs = 1 if glu else len(weights)
    kernel = functools.partial(
        _kernel, num_weights=len(weights), num_outputs=num_outputs, has_extra=bool(extra_weights),
        listed=None if listed == num_rows else listed, num_groups=num_groups, rows_per_token=rows_per_token,
        num_tokens=rows.shape[0], block_rows=block_rows,
        chunk=chunk_for(contract), chunks_ahead=chunks_ahead, blocks=blocks, glu=glu)
    return tuple(pl.pallas_call(
        kernel, out_shape=(jax.ShapeDtypeStruct((num_rows, out_dim), rows.dtype),) * num_outputs,
        grid=(num_rows * blocks,), compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret, name="grouped_matmul_rows_out_in",
    )(row_groups.astype(jnp.int32), rows, *weights, *extra_weights))
