"""Pallas (Triton lowering) grouped matmul over rows sorted by group: each group's weight matrix is read once per
block of its rows, and empty groups cost nothing.

    rows [M, K] (sorted by group), weights [E, K, N], group_sizes [E] (sum M), row_groups [M]  ->  out [M, N]

Two grids, by M:
  rows    (M <= rowwise_max_rows, decode) one program per (row, block of `block_n` columns, K split): the row times
          its own group's [K / split_k, block_n] columns as a vector-matrix product (no tile schedule, one kernel per
          weight array, or one for all with `rows_one_launch`; a group with several rows is read once per row): bf16
          rows on the tensor cores as a 16-row tile with zeros below the row (`rows_mma`: Triton pipelines the weight
          loads), float32 rows in float32 FMAs.
  tiles   (above) a tile schedule (plain JAX, `tile_schedule`) cuts every group's rows into tiles of at most
          `block_m` rows; a tile never spans two groups. The grid is (tile, block of `block_n` columns, K split); a
          program loads its group's [block_k, block_n] weight blocks and a block of `block_m` rows from its first one
          (the input is padded so the block always lies inside, or read with masks: `pad_rows`), accumulates in
          float32 on the tensor cores and stores only the rows of its group (masked: the programs of neighbouring
          tiles run concurrently). The number of tiles depends on the data, so the grid has the static bound
          floor(M / block_m) + min(E, M) tiles (each non-empty group adds at most one partial tile); tiles past the
          last do nothing. A prefill reads each used expert once per `block_m` of its rows.
With split_k > 1 every program covers 1 / split_k of K and writes a float32 partial product; XLA sums them. With
`glu` (an MoE's gate and up arrays) the result is SiLU(gate) * up: computed from a program's float32 accumulators
where it holds both products and K is whole, else from the summed products.

Default tiles (`default_tiles`) are the fastest of benchmarks/grouped_matmul.py --sweep on an H200 (JAX 0.11.2,
benchmarks/RESULTS.md) at 8, 64 and 512 rows of Kimi-Linear-48B's experts.

Runs under `interpret=True` on CPU (the tests do). Benchmark: benchmarks/grouped_matmul.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from MaxText.kernels import pallas_counts
from MaxText.kernels.grouped_matmul import (ROWWISE_MAX_ROWS, PartialRows, as_tuple, check_glu_weights,
                                            finished_rows, glu_output, product_rows, silu_glu)
from MaxText.kernels.pallas_dot import dot

BLOCK_CHOICES = (128, 64, 32, 16)  # block_k / block_n: the largest that divides the dimension (and <= the request)
# The `rows` grid up to ROWWISE_MAX_ROWS rows (16, set in the package __init__), the `tiles` grid above. H200, 48B
# expert shapes, routing within 48 experts: 16 rows 24 / 26 us (rows) vs 33 / 29 (tiles); 32 rows 49 / 51 vs 42 / 42;
# 64 rows 66 / 76 vs 57 / 55.
MMA_ROWS = 16  # the tensor cores' least tile height (`rows_mma` pads each row to it)
# dense_split_k keeps K whole where a program's [K, block_n] slice is at most this: a split would add a partial-sum
# kernel (one more launch, ~2 us in a decode step) to products of ~1 us.
UNSPLIT_MAX_BYTES = 16 * 1024
SHARED_MEMORY_BYTES = 232448  # per thread block on an H200 (227 KiB): bounds the `tiles` grid's pipeline stages


def unsupported_reason(rows_dtype, contract_dim: int, out_dim: int) -> str | None:
    """None when the kernel takes rows of this dtype and these K (contract) / N (out) dims."""
    if jnp.dtype(rows_dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        return f"the Pallas grouped matmul takes bfloat16 or float32 rows, got {jnp.dtype(rows_dtype)}"
    for name, dim in (("K", contract_dim), ("N", out_dim)):
        if dim % BLOCK_CHOICES[-1]:
            return f"the Pallas grouped matmul needs {name} to be a multiple of {BLOCK_CHOICES[-1]}, got {dim}"
    return None


def default_tiles(num_rows: int, dtype, k_blocks: int, one_launch: bool = False, rows_mma: bool | None = None) -> dict:
    """block_m (`tiles` only), block_n, split_k, rows_mma (`rows` only) and num_warps by row count, K's blocks and
    (`rows` grid) whether each program multiplies by several arrays (`one_launch`) and the product requested
    (`rows_mma`: None for the default). Measured on an H200 at Kimi-Linear-48B's expert shapes
    (benchmarks/grouped_matmul.py --sweep, bf16, 8 rows: batch-1 decode): on the tensor cores (`rows_mma`), gate/up
    (18 K blocks of 128) 15.5 us with block_n 128 and 2 K splits (FMA rows grid 23.1 with block_n 64 and 6 splits,
    the previous default), down (8 K blocks) 20.6 us with block_n 64 and K whole (FMA 25.3 with 2 splits): K splits
    in two from 16 blocks on (each program then reads at most ~9 blocks), and block_n 64. (Alone, gate/up was fastest
    with block_n 128; in the 48B batch-1 step, where the gate and up launches run side by side, block_n 64 (256
    programs a launch instead of 128) took 0.52 vs 0.55 ms for the 52 launches, 2.600 / 2.625 vs 2.666 / 2.645 ms per
    token in one process, the same tokens and cache bits: benchmarks/RESULTS.md, nineteenth session.) At the 48B
    step's 9 rows (the shared expert's row too; two sweeps, twelfth session): the FMA grid with 2 warps, block_n 64
    and 2 K splits was the fastest gate/up (14.9 / 15.0 us vs 18.0 / 19.9 with the tensor-core default), and for down
    4 K splits (16.8 us): the bf16 FMA grid's tiles (`moe_rows_product=fma`). In one launch for gate and up
    (`one_launch`, each program both arrays), block_n 64 and 2 K splits on the tensor cores (27.2 us at 9 rows, vs
    31.6 with block_n 32 and K whole). float32 rows keep the FMA grid (3-pass tf32 would triple the products):
    block_n 64 and 6 K splits where they divide K's blocks, else 2, else 1. 64 rows 75 us with block_n 128 (rows or
    tiles grid); 512 rows 257 us with tiles of block_n 128 (268-279 us with 64). float32 keeps block_n 64: three
    pipeline stages of fp32 [64, 128] row and [128, 128] weight blocks would exceed an H200's 227 KiB of shared
    memory."""
    bf16 = jnp.dtype(dtype) == jnp.bfloat16
    halves = 2 if k_blocks >= 16 and k_blocks % 2 == 0 else 1  # K in two from 16 blocks on
    if num_rows <= ROWWISE_MAX_ROWS and bf16 and (one_launch or rows_mma is not False):
        return {"block_m": 16, "block_n": 64, "split_k": halves, "rows_mma": True, "num_warps": 4}
    if num_rows <= ROWWISE_MAX_ROWS and bf16:
        split_k = halves if halves > 1 else next((d for d in (4, 2) if k_blocks % d == 0), 1)
        return {"block_m": 16, "block_n": 64, "split_k": split_k, "rows_mma": False, "num_warps": 2}
    if num_rows <= ROWWISE_MAX_ROWS:
        split_k = next((d for d in (6, 2) if k_blocks % d == 0), 1)
        return {"block_m": 16, "block_n": 64, "split_k": split_k, "rows_mma": False, "num_warps": 4}
    return {"block_m": 16 if num_rows <= 1024 else 64, "block_n": 128 if bf16 else 64, "split_k": 1,
            "rows_mma": False, "num_warps": 4}


def block_for(dim: int, requested: int) -> int:
    """The largest of BLOCK_CHOICES that divides `dim` and is at most `requested` (a block_k / block_n)."""
    return next(b for b in BLOCK_CHOICES if b <= requested and dim % b == 0)


def tile_schedule(group_sizes: jax.Array, num_rows: int, block_m: int):
    """Tiles of at most `block_m` rows, none spanning two groups, in row order.

    Returns (group, first row, end row) per tile, each [floor(num_rows / block_m) + min(E, num_rows)] int32; tiles
    past the last real one have first row = end row = 0 (and group 0)."""
    num_groups = group_sizes.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    bound = num_rows // block_m + min(num_groups, num_rows)
    tiles_per_group = (sizes + block_m - 1) // block_m  # [E]
    tiles_end = jnp.cumsum(tiles_per_group)  # [E] one past each group's last tile
    group_end = jnp.cumsum(sizes)  # [E]
    tile = jnp.arange(bound, dtype=jnp.int32)
    # [bound]; E past the last tile. compare_all: one fused [bound, E] comparison (the default binary search is a
    # loop of small kernels on the GPU).
    owner = jnp.searchsorted(tiles_end, tile, side="right", method="compare_all").astype(jnp.int32)
    real = owner < num_groups
    group = jnp.where(real, owner, 0)
    group_first_tile = tiles_end[group] - tiles_per_group[group]
    start = group_end[group] - sizes[group] + (tile - group_first_tile) * block_m
    return group, jnp.where(real, start, 0), jnp.where(real, group_end[group], 0)


def _gmm_kernel(group_ref, start_ref, end_ref, rows_ref, *refs, block_m, block_k, block_n, k_blocks, num_weights,
                glu, precise, masked_rows, weights_out_in, interpret):
    w_refs, out_refs = refs[:num_weights], refs[num_weights:]  # one output per weight array (glu: one)
    # split: this program's K blocks are [split * k_blocks, (split + 1) * k_blocks)
    tile, col_block, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start, end, group = start_ref[tile], end_ref[tile], group_ref[tile]

    @pl.when(start < end)
    def _tile():
        owned = (start + jnp.arange(block_m)) < end  # [BM] rows of this tile's group
        row_block = pl.ds(start, block_m)
        cols = pl.ds(col_block * block_n, block_n)

        def body(kb, accs):
            ks = pl.ds(pl.multiple_of((split * k_blocks + kb) * block_k, block_k), block_k)
            if masked_rows:  # unpadded rows: the block's rows past the group are not read (zeros)
                x = pltriton.load(rows_ref.at[row_block, ks], mask=owned[:, None], other=0)  # [BM, BK]
            else:  # padded rows: rows past the group are computed and not stored
                x = rows_ref[row_block, ks]  # [BM, BK]
            return tuple(acc + dot(x, w_ref[group, cols, ks] if weights_out_in else w_ref[group, ks, cols],
                                   trans_b=weights_out_in, precise=precise, interpret=interpret)  # [BM, BN]
                         for acc, w_ref in zip(accs, w_refs))

        accs = lax.fori_loop(0, k_blocks, body, tuple(jnp.zeros((block_m, block_n), jnp.float32) for _ in w_refs))
        for acc, out_ref in zip((silu_glu(*accs),) if glu else accs, out_refs):
            pltriton.store(out_ref.at[split, row_block, cols], acc.astype(out_ref.dtype), mask=owned[:, None])


def row_group_and_source(row, groups_ref, listed_rows, num_groups, rows_per_token, num_tokens):
    """A few-row program's (group, input row) for product row `row`: the group groups_ref lists for it, or
    `num_groups` (extra matrix 0) for rows past `listed_rows` (None: every row listed); with rows_per_token the
    token it stands for (row r < T * rows_per_token reads token r // rows_per_token, the extra rows after them token
    r - T * rows_per_token, `token_rows`), else the row itself."""
    if listed_rows is None:
        group = groups_ref[row]
    else:
        group = jnp.where(row < listed_rows, groups_ref[jnp.minimum(row, listed_rows - 1)], num_groups)
    if not rows_per_token:
        return group, row
    routed = num_tokens * rows_per_token
    return group, jnp.where(row < routed, row // rows_per_token, row - routed)


def _rowwise_kernel(groups_ref, *refs, **options):
    """The `rows` grid's kernel: program (row, column block, K split) is `_rowwise_program`'s."""
    _rowwise_program((pl.program_id(0), pl.program_id(1), pl.program_id(2)), groups_ref, refs, **options)


def _rowwise_program(ids, groups_ref, refs, *, block_k, block_n, k_blocks, num_inputs, num_weights, num_groups, mma,
                     glu, partial_rows, rows_per_token, listed_rows, interpret, extra_out_in=False,
                     weights_out_in=False):
    """One program of the `rows` grid, ids = (row, column block, K split). refs: `num_inputs` row refs (the rows, or
    with partial_rows the parts [S, M, K] of PartialRows), then `num_weights` weight refs, then (with extra weights) one
    extra weight ref per weight, then the outputs (one per weight; glu: one). Each program multiplies its row by
    every weight array's [K / split_k, block_n] block in one loop over K (the row loaded once for all); a row of
    group g >= num_groups uses the extra weights' matrix g - num_groups (stored [X, N, K] with extra_out_in: its
    [block_n, BK] blocks multiplied transposed; the weights likewise with weights_out_in), and rows past the
    `listed_rows` of
    groups_ref (None: all) are of group num_groups. rows_per_token > 0: the rows are tokens, row r < T *
    rows_per_token reads token r // rows_per_token and the extra rows after them token r - T * rows_per_token
    (`token_rows`). mma: each K block as a tensor-core product of a 16-row tile holding the row in row 0 (zeros
    elsewhere), so that Triton pipelines the weight loads as it does for products; else float32 FMAs and a reduction
    over K. glu: stores silu_glu of the two products (split_k 1 only)."""
    num_outputs = 1 if glu else num_weights
    row_refs, refs = refs[:num_inputs], refs[num_inputs:]
    w_refs, extra_refs, out_refs = refs[:num_weights], refs[num_weights:-num_outputs], refs[-num_outputs:]
    row, col_block, split = ids
    group, source = row_group_and_source(row, groups_ref, listed_rows, num_groups, rows_per_token,
                                         row_refs[0].shape[-2])  # source: the row of the input this program reads
    cols = pl.ds(col_block * block_n, block_n)
    dtype = w_refs[0].dtype

    first_row = jnp.arange(MMA_ROWS)[:, None] == 0  # rows_mma: the 16-row tile holds the row in row 0
    precise = dtype == jnp.float32

    def load_row(ks):  # [BK] in the weights' dtype
        if not partial_rows:
            return row_refs[0][source, ks]
        return finished_rows([sum(ref[s, source, ks].astype(jnp.float32) for s in range(ref.shape[0]))
                              for ref in row_refs], dtype)

    def body(weight_refs, matrix, transposed, kb, accs):
        ks = pl.ds(pl.multiple_of((split * k_blocks + kb) * block_k, block_k), block_k)
        x = load_row(ks)  # [BK]
        blocks = [w_ref[matrix, cols, ks] if transposed else w_ref[matrix, ks, cols] for w_ref in weight_refs]
        if mma:  # blocks [BN, BK] (transposed) or [BK, BN]
            tile = jnp.where(first_row, x[None, :], jnp.zeros((), x.dtype))  # [16, BK]: the row, then zeros
            return tuple(acc + dot(tile, w, trans_b=transposed, precise=precise, interpret=interpret)  # [16, BN]
                         for acc, w in zip(accs, blocks))
        return tuple(acc + block_product(x, w.T if transposed else w) for acc, w in zip(accs, blocks))

    def multiply(weight_refs, matrix, transposed=False):
        acc_shape = (MMA_ROWS, block_n) if mma else (block_n,)
        accs = lax.fori_loop(0, k_blocks, functools.partial(body, weight_refs, matrix, transposed),
                             tuple(jnp.zeros(acc_shape, jnp.float32) for _ in weight_refs))
        accs = tuple(jnp.sum(acc, axis=0) for acc in accs) if mma else accs  # [BN] each
        for acc, out_ref in zip((silu_glu(*accs),) if glu else accs, out_refs):
            out_ref[split, row, cols] = acc.astype(out_ref.dtype)

    if not extra_refs:
        multiply(w_refs, group, weights_out_in)
        return
    extra = group >= num_groups
    pl.when(jnp.logical_not(extra))(functools.partial(multiply, w_refs, group, weights_out_in))
    pl.when(extra)(functools.partial(multiply, extra_refs, group - num_groups, extra_out_in))


def grouped_matmul(rows: jax.Array, weights, group_sizes: jax.Array, row_groups: jax.Array, *,
                   block_m: int | None = None, block_n: int | None = None, block_k: int = 128,
                   split_k: int | None = None, num_warps: int | None = None, num_stages: int = 3,
                   rowwise_max_rows: int = ROWWISE_MAX_ROWS, rows_one_launch: bool = False,
                   rows_mma: bool | None = None, glu: bool = False, pad_rows: bool = True, extra_weights=None,
                   rows_per_token: int = 0, partial_rows: bool = False, extra_out_in: bool = False,
                   weights_out_in: bool = False, interpret: bool = False):
    """rows [M, K] sorted by group (any order on the `rows` grid), weights [E, K, N] (rows' dtype), group_sizes [E]
    int32 (sum M), row_groups [M] int32 (the same grouping) -> [M, N] in rows' dtype. `weights` may also be a tuple
    of such arrays (e.g. an MoE's gate and up projections; returns a tuple of products): the `tiles` grid reads each
    row block once for all of them in one kernel (H200, 48B experts, gate + up: 32 rows 80 vs 96 us as two calls);
    the `rows` grid launches one kernel per array, or with rows_one_launch one kernel whose programs each multiply
    their row by every array's column block (the row loaded once for all, half the programs of two launches).
    glu: `weights` is (gate, up) and the result is silu_glu(rows @ gate, rows @ up) [M, N], one array: applied to the
    float32 accumulators inside the kernel where one program holds both products (the `tiles` grid, or the `rows`
    grid with rows_one_launch, K not split: one output written instead of two, no activation kernel), else to the
    float32 sums of the products after it.
    The `tiles` grid (and the `rows` grid with rows_mma) multiplies bf16 operands in one tensor-core pass (fp32
    accumulation) and fp32 ones in 3-pass tf32 (about fp32); the `rows` grid without it in float32 FMAs.
    block_m, block_n, split_k, rows_mma and num_warps default to `default_tiles` (block_m: 16 rows, the tensor cores'
    least, up to 1024 rows, 64 above). The `tiles` grid runs at most `num_stages` pipeline stages, fewer where they
    would not fit in SHARED_MEMORY_BYTES (`tiles_pipeline_stages`; gate and up at block_m 64: two). split_k > 1 cuts K
    into that many equal parts, each its own program (more programs for few rows), writing float32 partial products that
    are then summed.

    rows_mma: the `rows` grid multiplies on the tensor cores (each row padded to a 16-row tile; Triton then pipelines
    the weight loads, `num_stages`) instead of in float32 FMAs; default `default_tiles` (bf16 rows: on).
    extra_weights: on the `rows` grid (M <= rowwise_max_rows), one [X, K, N] array per weight array (a tuple when
    `weights` is one): a row of group E + x (row_groups up to E + X - 1) is multiplied by extra matrix x, e.g. an
    MoE's shared expert as one more row per token in the routed experts' launches (its weights are not copied into
    the [E, K, N] arrays). Forward only (decode). extra_out_in: the extra arrays are stored [X, N, K] (e.g. a
    shared expert's kernels in a dense_kernel_layout out_in model) and read transposed, without a copy.
    weights_out_in: `weights` are stored [E, N, K] (each group's matrix as torch's Linear.weight; an MoE's experts
    with expert_kernel_layout out_in) and read transposed, on either grid, without a copy.
    pad_rows: the `tiles` grid pads the rows by block_m so that every tile's row block lies inside the buffer; False
    reads and writes a single group of fewer than block_m rows with masks instead (no pad kernel before the launch).
    Forward only (the package's `grouped_matmul` documents them): rows as `PartialRows` (finished as each row is
    loaded on the `rows` grid; the `tiles` grid materializes them first), partial_rows (the K splits' products
    returned as `PartialRows` where their sums, or the activation, would be a kernel of their own), and on the
    `rows` grid only rows_per_token (tokens read in place of their repeated rows; row_groups may omit the extra
    rows, of extra group 0).

    Differentiable (without extra_weights): the backward pass is `jax.lax.ragged_dot`'s (XLA; with glu, of the
    products recomputed), so training gets this kernel's forward and the previous default's gradients."""
    options = (("block_m", block_m), ("block_n", block_n), ("block_k", block_k), ("split_k", split_k),
               ("num_warps", num_warps), ("num_stages", num_stages), ("rowwise_max_rows", rowwise_max_rows),
               ("rows_one_launch", rows_one_launch), ("rows_mma", rows_mma), ("glu", glu), ("pad_rows", pad_rows),
               ("weights_out_in", weights_out_in), ("interpret", interpret))
    weights, several = as_tuple(weights)
    check_glu_weights(weights, glu)
    if extra_weights is None and not (rows_per_token or partial_rows or isinstance(rows, PartialRows)):
        outs = _grouped_matmul(rows, weights, group_sizes, row_groups, options)
    else:
        extras = as_tuple(extra_weights)[0] if extra_weights is not None else ()
        outs = _launch(rows, weights, group_sizes, row_groups, extra_weights=extras, rows_per_token=rows_per_token,
                       partial_rows=partial_rows, extra_out_in=extra_out_in, **dict(options))
    return outs if several and not glu else outs[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _grouped_matmul(rows, weights, group_sizes, row_groups, options):
    return _launch(rows, weights, group_sizes, row_groups, **dict(options))


def _grouped_matmul_fwd(rows, weights, group_sizes, row_groups, options):
    return _launch(rows, weights, group_sizes, row_groups, **dict(options)), (rows, weights, group_sizes)


def _grouped_matmul_bwd(options, residuals, out_cotangents):
    rows, weights, group_sizes = residuals

    def products(r, ws):
        if dict(options)["weights_out_in"]:
            ws = tuple(jnp.swapaxes(w, 1, 2) for w in ws)  # [E, K, N] (the gradient comes back [E, N, K])
        outs = tuple(lax.ragged_dot(r, w, group_sizes) for w in ws)
        return (glu_output(*outs, r.dtype),) if dict(options)["glu"] else outs

    _, vjp = jax.vjp(products, rows, weights)
    return (*vjp(out_cotangents), None, None)


_grouped_matmul.defvjp(_grouped_matmul_fwd, _grouped_matmul_bwd)


def _launch(rows, weights, group_sizes, row_groups, *, block_m, block_n, block_k, split_k, num_warps, num_stages,
            rowwise_max_rows, rows_one_launch, rows_mma, glu, pad_rows, interpret, extra_weights=(),
            rows_per_token=0, partial_rows=False, extra_out_in=False, weights_out_in=False):
    """weights: a tuple of [E, K, N] arrays ([E, N, K] with weights_out_in; extra_weights: () or one [X, K, N] array
    per weight array, [X, N, K] with extra_out_in, `rows` grid only) -> a tuple of [M, N] products (glu: one array;
    partial_rows: PartialRows where they need finishing)."""
    num_rows = product_rows(rows, rows_per_token, bool(extra_weights))
    contract = rows.shape[1]
    num_groups, out_dim = weights[0].shape[0], weights[0].shape[1 if weights_out_in else 2]
    reason = unsupported_reason(rows.dtype, contract, out_dim)
    if reason:
        raise ValueError(reason)
    listed = row_groups.shape[0] if row_groups.ndim == 1 else -1
    matrix = (out_dim, contract) if weights_out_in else (contract, out_dim)
    if (any(w.shape != (num_groups, *matrix) for w in weights) or group_sizes.shape != (num_groups,)
            or not (listed == num_rows or extra_weights and 0 < listed < num_rows)):
        names = "[E, N, {0}]" if weights_out_in else "[E, {0}, N]"
        raise ValueError(f"expected weights {names.format(contract)} (all of one shape), group_sizes [E] and "
                         f"row_groups [{num_rows}] (with extra weights: at least one row), got "
                         f"{[w.shape for w in weights]}, {group_sizes.shape} and {row_groups.shape}")
    extra_shape = (out_dim, contract) if extra_out_in else (contract, out_dim)
    if extra_weights and (len(extra_weights) != len(weights)
                          or any(x.ndim != 3 or x.shape[1:] != extra_shape for x in extra_weights)):
        raise ValueError(f"expected one extra weight array [X, {extra_shape[0]}, {extra_shape[1]}] per weight array"
                         f" (extra_out_in={extra_out_in}), got {[x.shape for x in extra_weights]} for {len(weights)}")
    rows_grid_only = [name for name, used in (("extra_weights", bool(extra_weights)),
                                              ("rows_per_token", rows_per_token)) if used]
    if rows_grid_only and num_rows > rowwise_max_rows:
        raise ValueError(f"{' and '.join(rows_grid_only)} need the rows grid (M <= rowwise_max_rows="
                         f"{rowwise_max_rows}), got M={num_rows}")
    rows_grid = num_rows <= rowwise_max_rows
    block_k = block_for(contract, block_k)
    defaults = default_tiles(num_rows, rows.dtype, contract // block_k, rows_one_launch and len(weights) > 1,
                             rows_mma)
    block_m = block_m or defaults["block_m"]
    block_n = block_for(out_dim, block_n or defaults["block_n"])
    split_k = defaults["split_k"] if split_k is None else split_k
    rows_mma = defaults["rows_mma"] if rows_mma is None else rows_mma
    num_warps = num_warps or defaults["num_warps"]
    if split_k < 1 or (contract // block_k) % split_k:
        raise ValueError(f"split_k={split_k} must divide the {contract // block_k} blocks of {block_k} that K="
                         f"{contract} makes")
    # The activation inside the kernel where one program holds both products and K is whole.
    glu_in_kernel = glu and split_k == 1 and (rows_one_launch or not rows_grid)
    weights = tuple(w.astype(rows.dtype) for w in weights)
    extra_weights = tuple(x.astype(rows.dtype) for x in extra_weights)
    if not rows_grid:
        num_stages = tiles_pipeline_stages(num_stages, block_m, block_k, block_n, len(weights), rows.dtype)
    params = pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    # Partial products of the K splits stay float32 until summed: out [split_k, rows (+ padding), N] per weight.
    if rows_grid:
        outs = _rowwise_partials(rows, weights, row_groups, block_k=block_k, block_n=block_n, split_k=split_k,
                                 params=params, one_launch=rows_one_launch, mma=rows_mma, glu=glu_in_kernel,
                                 interpret=interpret, extra_weights=extra_weights, num_rows=num_rows,
                                 rows_per_token=rows_per_token, extra_out_in=extra_out_in,
                                 weights_out_in=weights_out_in)
    else:
        group, start, end = tile_schedule(group_sizes, num_rows, block_m)
        # A tile's block of rows may run past M: pad so that every [start, start + block_m) lies inside the buffers,
        # or (one group of fewer than block_m rows, without pad_rows: its one tile starts at row 0) read and write
        # the block with masks, with no pad kernel before the launch.
        rows = rows.materialize() if isinstance(rows, PartialRows) else rows  # (only the rows grid loads parts)
        masked_rows = not pad_rows and num_groups == 1 and num_rows < block_m
        padded = rows if masked_rows else jnp.pad(rows, ((0, block_m), (0, 0)))  # [M (+ BM), K]
        kernel = functools.partial(_gmm_kernel, block_m=block_m, block_k=block_k, block_n=block_n,
                                   k_blocks=contract // block_k // split_k, num_weights=len(weights),
                                   glu=glu_in_kernel, precise=rows.dtype == jnp.float32, masked_rows=masked_rows,
                                   weights_out_in=weights_out_in, interpret=interpret)
        out_shape = jax.ShapeDtypeStruct((split_k, padded.shape[0], out_dim), _partial_dtype(rows.dtype, split_k))
        outs = pl.pallas_call(
            kernel,
            out_shape=(out_shape,) * (1 if glu_in_kernel else len(weights)),
            grid=(group.shape[0], out_dim // block_n, split_k),
            compiler_params=params,
            interpret=interpret,
            name="grouped_matmul_tiles",
        )(group, start, end, padded, *weights)
        outs = tuple(out[:, :num_rows] for out in outs)
    if partial_rows and (glu and not glu_in_kernel or split_k > 1):  # the consumer finishes them
        return (PartialRows(outs, rows.dtype),) if glu else tuple(PartialRows((out,), rows.dtype) for out in outs)
    sums = tuple(out[0] if split_k == 1 else out.sum(axis=0) for out in outs)  # float32 where K was split
    if glu and not glu_in_kernel:
        return (glu_output(*sums, rows.dtype),)
    return tuple(out.astype(rows.dtype) for out in sums)


def _partial_dtype(rows_dtype, split_k: int):
    """The dtype of the K splits' partial products: float32 until summed, or the rows' when there is one split."""
    return rows_dtype if split_k == 1 else jnp.float32


def _rowwise_options(rows, weights, row_groups, *, block_k, block_n, split_k, one_launch, mma, glu, num_rows,
                     rows_per_token, interpret, extra_out_in=False, weights_out_in=False) -> dict:
    """`_rowwise_program`'s options for a `rows` grid launch (as `_rowwise_partials` takes its arguments)."""
    listed = row_groups.shape[0]
    return dict(block_k=block_k, block_n=block_n, k_blocks=rows.shape[1] // block_k // split_k,
                num_inputs=len(rows.parts) if isinstance(rows, PartialRows) else 1,
                num_weights=len(weights) if one_launch else 1, num_groups=weights[0].shape[0], mma=mma, glu=glu,
                partial_rows=isinstance(rows, PartialRows), rows_per_token=rows_per_token,
                listed_rows=None if listed == num_rows else listed, interpret=interpret, extra_out_in=extra_out_in,
                weights_out_in=weights_out_in)


def _rowwise_partials(rows, weights, row_groups, *, block_k, block_n, split_k, params, one_launch, interpret,
                      mma=False, glu=False, extra_weights=(), num_rows=None, rows_per_token=0, out_dtype=None,
                      extra_out_in=False, weights_out_in=False):
    """The `rows` grid: a tuple of [split_k, M, N] products, one per weight array (float32 when split_k > 1, else in
    rows' dtype): one launch per weight array, or with one_launch a single kernel for all of them (glu, one_launch
    and split_k 1 only: one silu_glu output instead); weights [E, N, K] with weights_out_in. extra_weights: () or
    one [X, K, N] array per weight array, for rows of groups E...E+X-1 ([X, N, K] with extra_out_in). rows: an
    array or PartialRows; num_rows: the product rows M (default rows'); rows_per_token: `grouped_matmul`'s;
    out_dtype: the products' (default `_partial_dtype`)."""
    num_rows = num_rows or rows.shape[0]
    out_dim = weights[0].shape[1 if weights_out_in else 2]
    per_launch = len(weights) if one_launch else 1
    inputs = rows.parts if isinstance(rows, PartialRows) else (rows,)
    out_shape = jax.ShapeDtypeStruct((split_k, num_rows, out_dim), out_dtype or _partial_dtype(rows.dtype, split_k))
    options = _rowwise_options(rows, weights, row_groups, block_k=block_k, block_n=block_n, split_k=split_k,
                               one_launch=one_launch, mma=mma, glu=glu, num_rows=num_rows,
                               rows_per_token=rows_per_token, interpret=interpret, extra_out_in=extra_out_in,
                               weights_out_in=weights_out_in)
    call = pl.pallas_call(
        functools.partial(_rowwise_kernel, **options),
        out_shape=(out_shape,) * (1 if glu else per_launch),
        grid=(num_rows, out_dim // block_n, split_k), compiler_params=params, interpret=interpret,
        name="grouped_matmul_rows")
    groups = row_groups.astype(jnp.int32)
    if one_launch:
        return call(groups, *inputs, *weights, *extra_weights)
    extras = [(x,) for x in extra_weights] or [()] * len(weights)
    return tuple(out for w, x in zip(weights, extras) for out in call(groups, *inputs, w, *x))


def _finishing_kernel(groups_ref, rows_ref, kernel_ref, *refs, finish, num_finish_inputs, programs_per_row,
                      options):
    """`vector_matrix_partials` with `finish`: program (row, column block, K block) writes its partial product, then
    counts itself done for its row; the row's last program to count calls `finish` on the row's partial products
    (all written: the count is an atomic read-modify-write, acquire and release at GPU scope)."""
    finish_inputs, refs = refs[:num_finish_inputs], refs[num_finish_inputs + 1:]  # (+1: the counts' input)
    parts_ref, finish_outputs, counts_ref = refs[0], refs[1:-1], refs[-1]
    ids = (pl.program_id(0), pl.program_id(1), pl.program_id(2))
    _rowwise_program(ids, groups_ref, (rows_ref, kernel_ref, parts_ref), **options)
    pallas_counts.count_then_finish(counts_ref, ids[0], programs_per_row,
                                    functools.partial(finish, ids[0], parts_ref, *finish_inputs, *finish_outputs),
                                    options["interpret"])


def block_product(x, w):
    """x [BK] times a weight block w [BK, BN] inside a kernel: float32 FMAs of both as stored, reduced over K ->
    [BN] float32 (the `rows` grid's FMA product of one K block)."""
    return jnp.sum(x.astype(jnp.float32)[:, None] * w.astype(jnp.float32), axis=0)


def vector_matrix_partials(rows: jax.Array, kernel: jax.Array, *, block_k: int = 128, block_n: int = 64,
                           num_warps: int = 4, finish=None, finish_inputs=(), finish_outputs=(),
                           interpret: bool = False):
    """rows [M, K] (few: one program per row and block) x kernel [K, N] -> [K / block_k, M, N] float32 partial
    products, one per block of K (their sum is rows @ kernel), for a consumer that sums them itself (the MoE router
    kernel sums them while it routes: no separate reduction). The `rows` grid with one group and K split into every
    block; both operands are multiplied in float32 as stored (bf16 rows or a bf16 kernel are not converted first:
    exact products).

    finish: in the same launch, the last program of each row to write its partial product calls
    finish(row, parts_ref, *finish_input_refs, *finish_output_refs) (e.g. the MoE router's routing of the row's
    token: `pallas_route.product_and_route`). finish_inputs: arrays; finish_outputs: ShapeDtypeStructs. Returns
    (parts, *finish outputs) then."""
    num_rows, contract = rows.shape
    if kernel.ndim != 2 or kernel.shape[0] != contract:
        raise ValueError(f"expected a kernel [{contract}, N] for rows [{num_rows}, {contract}], got {kernel.shape}")
    reason = unsupported_reason(rows.dtype, contract, kernel.shape[1])
    if reason:
        raise ValueError(reason)
    block_k, block_n = block_for(contract, block_k), block_for(kernel.shape[1], block_n)
    plan = dict(block_k=block_k, block_n=block_n, split_k=contract // block_k, one_launch=False,
                interpret=interpret)
    params = pltriton.CompilerParams(num_warps=num_warps, num_stages=1)
    groups, weights = jnp.zeros((num_rows,), jnp.int32), (kernel[None],)  # one group
    if finish is None:
        (parts,) = _rowwise_partials(rows, weights, groups, params=params, out_dtype=jnp.float32, **plan)
        return parts
    options = _rowwise_options(rows, weights, groups, mma=False, glu=False, num_rows=num_rows, rows_per_token=0,
                               **plan)
    grid = (num_rows, kernel.shape[1] // block_n, contract // block_k)
    counts = jnp.zeros((num_rows,), jnp.int32)  # programs done per row (aliased to the last output)
    inputs = (groups, rows, *weights, *finish_inputs, counts)
    outs = pl.pallas_call(
        functools.partial(_finishing_kernel, finish=finish, num_finish_inputs=len(finish_inputs),
                          programs_per_row=grid[1] * grid[2], options=options),
        out_shape=(jax.ShapeDtypeStruct((grid[2], num_rows, kernel.shape[1]), jnp.float32), *finish_outputs,
                   jax.ShapeDtypeStruct((num_rows,), jnp.int32)),
        grid=grid, input_output_aliases={len(inputs) - 1: len(finish_outputs) + 1}, compiler_params=params,
        interpret=interpret, name="vector_matrix_finished")(*inputs)
    return outs[:-1]


def tiles_pipeline_stages(requested: int, block_m: int, block_k: int, block_n: int, num_weights: int, dtype) -> int:
    """At most `requested` pipeline stages of the `tiles` grid, each holding a [block_m, block_k] row block and one
    [block_k, block_n] block per weight array, within SHARED_MEMORY_BYTES (Triton refuses the kernel otherwise)."""
    stage_bytes = (block_m * block_k + num_weights * block_k * block_n) * jnp.dtype(dtype).itemsize
    return max(1, min(requested, SHARED_MEMORY_BYTES // stage_bytes))


def dense_split_k(contract: int, out_dim: int, block_k: int, block_n: int, min_programs: int = 256,
                  itemsize: int = 2) -> int:
    """The fewest K splits (a divisor of K's blocks) that give a single-tile product at least `min_programs`
    programs (about two per H200 SM), or all of K's blocks; K whole (one kernel, no partial sums to add) where a
    program's unsplit [K, block_n] slice is at most UNSPLIT_MAX_BYTES (KDA's f_b / g_b: K = 128)."""
    k_blocks = contract // block_k
    col_blocks = out_dim // block_n
    if contract * block_n * itemsize <= UNSPLIT_MAX_BYTES:
        return 1
    return next(d for d in range(1, k_blocks + 1) if k_blocks % d == 0 and (col_blocks * d >= min_programs
                                                                             or d == k_blocks))


def dense_matmul(rows: jax.Array, kernel, *, block_k: int = 64, block_n: int = 64, min_programs: int = 256,
                 grid: str = "tiles", pad_rows: bool = False, interpret: bool = False):
    """rows [M, K] x kernel [K, N] -> [M, N] in rows' dtype, for few rows (M <= 16: one tile, each weight read
    once): the `tiles` grid with one group, K split (dense_split_k, for at least `min_programs` programs) so that a
    decode step's projection keeps the whole GPU reading. `kernel` may also be a tuple of [K, N] kernels (projections
    of the same rows, e.g. q / k / v): one launch multiplies by all of them (each program one column block of each)
    and a tuple of products is returned. grid="rows": the vector-matrix `rows` grid instead (its default product:
    bf16 rows on the tensor cores), every kernel in one launch (rows_one_launch): the rows need no padding to a
    16-row block (the `tiles` grid's input pad is one more XLA kernel per projection; pad_rows=False, the default,
    reads fewer than 16 rows with masked loads instead: no pad kernel; config key `dense_pad_rows`)."""
    if grid not in ("tiles", "rows"):
        raise ValueError(f"grid={grid!r}: expected 'tiles' or 'rows'")
    kernels, several = as_tuple(kernel)
    if len({k.shape for k in kernels}) != 1:
        raise ValueError(f"kernels of one launch must share a shape, got {[k.shape for k in kernels]}")
    num_rows, contract = rows.shape
    out_dim = kernels[0].shape[1]
    block_k, block_n = block_for(contract, block_k), block_for(out_dim, block_n)
    split_k = dense_split_k(contract, out_dim, block_k, block_n, min_programs, rows.dtype.itemsize)
    outs = grouped_matmul(rows, tuple(k[None] for k in kernels), jnp.full((1,), num_rows, jnp.int32),
                          jnp.zeros((num_rows,), jnp.int32), block_m=16, block_n=block_n, block_k=block_k,
                          split_k=split_k, rowwise_max_rows=num_rows if grid == "rows" else 0,
                          rows_one_launch=grid == "rows", pad_rows=pad_rows, interpret=interpret)
    return outs if several else outs[0]
