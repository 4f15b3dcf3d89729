"""Pallas (Triton lowering) grouped matmul over rows sorted by group: each group's weight matrix is read once per
block of its rows, and empty groups cost nothing.

    rows [M, K] (sorted by group), weights [E, K, N], group_sizes [E] (sum M), row_groups [M]  ->  out [M, N]

Two grids, by M:
  rows    (M <= rowwise_max_rows, decode) one program per (row, block of `block_n` columns): the row times its own
          group's [K, block_n] columns as a vector-matrix product in float32 (no tile schedule, one kernel; a group
          with several rows is read once per row).
  tiles   (above) a tile schedule (plain JAX, `tile_schedule`) cuts every group's rows into tiles of at most
          `block_m` rows; a tile never spans two groups. The grid is (tile, block of `block_n` columns); a program
          loads its group's [block_k, block_n] weight blocks and a block of `block_m` rows from its first one (the
          input is padded so the block always lies inside), accumulates in float32 on the tensor cores and stores
          only the rows of its group (masked: the programs of neighbouring tiles run concurrently). The number of
          tiles depends on the data, so the grid has the static bound floor(M / block_m) + min(E, M) tiles (each
          non-empty group adds at most one partial tile); tiles past the last do nothing. A prefill reads each
          used expert once per `block_m` of its rows.

Runs under `interpret=True` on CPU (the tests do). Benchmark: benchmarks/grouped_matmul.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from MaxText.kernels.pallas_dot import dot

BLOCK_CHOICES = (128, 64, 32, 16)  # block_k / block_n: the largest that divides the dimension (and <= the request)
ROWWISE_MAX_ROWS = 64  # the `rows` grid up to this many rows, the `tiles` grid above


def unsupported_reason(rows_dtype, contract_dim: int, out_dim: int) -> str | None:
    """None when the kernel takes rows of this dtype and these K (contract) / N (out) dims."""
    if jnp.dtype(rows_dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        return f"the Pallas grouped matmul takes bfloat16 or float32 rows, got {jnp.dtype(rows_dtype)}"
    for name, dim in (("K", contract_dim), ("N", out_dim)):
        if dim % BLOCK_CHOICES[-1]:
            return f"the Pallas grouped matmul needs {name} to be a multiple of {BLOCK_CHOICES[-1]}, got {dim}"
    return None


def _block(dim: int, requested: int) -> int:
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


def _gmm_kernel(group_ref, start_ref, end_ref, rows_ref, w_ref, out_ref, *, block_m, block_k, block_n, precise,
                interpret):
    tile, col_block = pl.program_id(0), pl.program_id(1)
    start, end, group = start_ref[tile], end_ref[tile], group_ref[tile]

    @pl.when(start < end)
    def _tile():
        owned = (start + jnp.arange(block_m)) < end  # [BM] rows of this tile's group
        row_block = pl.ds(start, block_m)
        cols = pl.ds(col_block * block_n, block_n)

        def body(kb, acc):
            ks = pl.ds(pl.multiple_of(kb * block_k, block_k), block_k)
            x = rows_ref[row_block, ks]  # [BM, BK]; rows past the group are computed and not stored
            return acc + dot(x, w_ref[group, ks, cols], precise=precise, interpret=interpret)  # [BM, BN]

        acc = lax.fori_loop(0, rows_ref.shape[1] // block_k, body, jnp.zeros((block_m, block_n), jnp.float32))
        pltriton.store(out_ref.at[row_block, cols], acc.astype(out_ref.dtype), mask=owned[:, None])


def _rowwise_kernel(groups_ref, rows_ref, w_ref, out_ref, *, block_k, block_n):
    row, col_block = pl.program_id(0), pl.program_id(1)
    group = groups_ref[row]
    cols = pl.ds(col_block * block_n, block_n)

    def body(kb, acc):
        ks = pl.ds(pl.multiple_of(kb * block_k, block_k), block_k)
        x = rows_ref[row, ks].astype(jnp.float32)  # [BK]
        return acc + jnp.sum(x[:, None] * w_ref[group, ks, cols].astype(jnp.float32), axis=0)  # [BN]

    acc = lax.fori_loop(0, rows_ref.shape[1] // block_k, body, jnp.zeros((block_n,), jnp.float32))
    out_ref[row, cols] = acc.astype(out_ref.dtype)


def grouped_matmul(rows: jax.Array, weights: jax.Array, group_sizes: jax.Array, row_groups: jax.Array, *,
                   block_m: int | None = None, block_n: int | None = None, block_k: int = 128, num_warps: int = 4,
                   num_stages: int = 3, rowwise_max_rows: int = ROWWISE_MAX_ROWS,
                   interpret: bool = False) -> jax.Array:
    """rows [M, K] sorted by group, weights [E, K, N] (rows' dtype), group_sizes [E] int32 (sum M), row_groups [M]
    int32 (the same grouping) -> [M, N] in rows' dtype. The `rows` grid multiplies in float32; the `tiles` grid
    multiplies bf16 operands in one tensor-core pass (fp32 accumulation) and fp32 ones in 3-pass tf32 (about fp32).
    block_m (tiles) defaults to 16 rows (the tensor cores' least) up to 1024 rows, 64 above; block_n to 32 columns
    for the `rows` grid (more programs for few rows) and 64 for `tiles`.

    Differentiable: the backward pass is `jax.lax.ragged_dot`'s (XLA), so training gets this kernel's forward and
    the previous default's gradients."""
    options = (("block_m", block_m), ("block_n", block_n), ("block_k", block_k), ("num_warps", num_warps),
               ("num_stages", num_stages), ("rowwise_max_rows", rowwise_max_rows), ("interpret", interpret))
    return _grouped_matmul(rows, weights, group_sizes, row_groups, options)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _grouped_matmul(rows, weights, group_sizes, row_groups, options):
    return _launch(rows, weights, group_sizes, row_groups, **dict(options))


def _grouped_matmul_fwd(rows, weights, group_sizes, row_groups, options):
    return _launch(rows, weights, group_sizes, row_groups, **dict(options)), (rows, weights, group_sizes)


def _grouped_matmul_bwd(options, residuals, out_cotangent):
    rows, weights, group_sizes = residuals
    _, vjp = jax.vjp(lambda r, w: lax.ragged_dot(r, w, group_sizes), rows, weights)
    return (*vjp(out_cotangent), None, None)


_grouped_matmul.defvjp(_grouped_matmul_fwd, _grouped_matmul_bwd)


def _launch(rows, weights, group_sizes, row_groups, *, block_m, block_n, block_k, num_warps, num_stages,
            rowwise_max_rows, interpret):
    num_rows, contract = rows.shape
    num_groups, _, out_dim = weights.shape
    reason = unsupported_reason(rows.dtype, contract, out_dim)
    if reason:
        raise ValueError(reason)
    if weights.shape[1] != contract or group_sizes.shape != (num_groups,) or row_groups.shape != (num_rows,):
        raise ValueError(f"expected weights [E, {contract}, N], group_sizes [E] and row_groups [{num_rows}], got "
                         f"{weights.shape}, {group_sizes.shape} and {row_groups.shape}")
    weights = weights.astype(rows.dtype)
    params = pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    block_k = _block(contract, block_k)
    if num_rows <= rowwise_max_rows:
        block_n = _block(out_dim, block_n or 32)
        kernel = functools.partial(_rowwise_kernel, block_k=block_k, block_n=block_n)
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((num_rows, out_dim), rows.dtype),
                              grid=(num_rows, out_dim // block_n), compiler_params=params, interpret=interpret,
                              name="grouped_matmul_rows")(row_groups.astype(jnp.int32), rows, weights)
    block_m = block_m or (16 if num_rows <= 1024 else 64)
    block_n = _block(out_dim, block_n or 64)
    group, start, end = tile_schedule(group_sizes, num_rows, block_m)
    # A tile's block of rows may run past M: pad so that every [start, start + block_m) lies inside the buffers.
    padded = jnp.pad(rows, ((0, block_m), (0, 0)))  # [M + BM, K]
    kernel = functools.partial(_gmm_kernel, block_m=block_m, block_k=block_k, block_n=block_n,
                               precise=rows.dtype == jnp.float32, interpret=interpret)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_rows + block_m, out_dim), rows.dtype),
        grid=(group.shape[0], out_dim // block_n),
        compiler_params=params,
        interpret=interpret,
        name="grouped_matmul_tiles",
    )(group, start, end, padded, weights)
    return out[:num_rows]
