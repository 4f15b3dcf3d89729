"""Grouped matmul of the MoE's sorted, dropless dispatch (config key `moe_grouped_matmul`), and the same Pallas
kernel with one group as the dense projections' decode matmul (config key `dense_matmul`, `dense_matmul` below):

    out = grouped_matmul(rows, weights, group_sizes, row_groups, implementation="auto")
    rows [M, K] sorted by group; weights [E, K, N]; group_sizes [E] int32 (sum M); row_groups [M] int32 (the same
    grouping, non-decreasing)  ->  out [M, N], row m times weights[row_groups[m]]

Implementations:
  gather      naive.py, the oracle: each row times its own gathered [K, N] matrix. Any backend; reads one matrix per
              row, so it suits CPU and few rows.
  ragged_dot  `jax.lax.ragged_dot`. A native grouped GEMM on TPU; XLA:GPU (JAX 0.11.2) and XLA:CPU expand it into a
              dense product over every group (measured on an H200: 15-30x the time at 256 experts vs 8).
  pallas      pallas_gmm.py, a Triton grouped matmul that reads each used group's matrix once per block of rows
              (a vector-matrix grid, K split for parallelism, for <= 16 rows).
              NVIDIA GPU only, and not under a multi-device mesh (XLA cannot partition a Pallas call; the sharded
              MoE keeps ragged_dot). Differentiable through ragged_dot's backward (training: fast forward only).
              Weights stored [E, N, K] (`weights_out_in`, config key `expert_kernel_layout: out_in`): for <= 16 rows
              pallas_rows_out_in.py, one output feature's contiguous weights per warp (forward only); the `tiles`
              grid and gather read them as stored too, ragged_dot gets them transposed to [E, K, N] (a copy).
  auto        on an NVIDIA GPU without a multi-device mesh: pallas (when its import and the shapes allow; else one
              log line and ragged_dot); ragged_dot on TPU and sharded GPUs; gather on CPU.

Measured on an H200 (JAX 0.11.2, Kimi-Linear-48B's experts, benchmarks/grouped_matmul.py, benchmarks/RESULTS.md):
per expert product at 8 / 64 / 512 rows pallas 22-27 / 76-91 / 267-269 us, gather 85-118 / 646-937 / 5081-7309
us, ragged_dot 287-291 / 322-350 / 843-1075 us.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
import math
from typing import Any

import jax
import jax.numpy as jnp

from MaxText.kernels.grouped_matmul.naive import gather_matmul, silu_glu, token_rows

CHOICES = ("auto", "ragged_dot", "gather", "pallas")
# The Pallas kernel's `rows` grid (vector-matrix, any row order) up to this many rows, its `tiles` grid above
# (pallas_gmm.py; defined here so that callers need not import Pallas).
ROWWISE_MAX_ROWS = 16
log = logging.getLogger(__name__)
_logged: set[str] = set()


def single_gpu_reason(kernel: str) -> str | None:
    """Why a Pallas `kernel` (named in the message) that XLA cannot partition cannot run here: not an NVIDIA GPU, or a
    multi-device mesh is current. None when it can."""
    backend = jax.default_backend()
    if backend != "gpu" or "rocm" in jax.devices()[0].platform:
        return f"the {kernel} needs an NVIDIA GPU, and the default backend is {backend!r}"
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and mesh.size > 1:
        return f"a {mesh.size}-device mesh is current, and XLA cannot partition the {kernel}"
    return None


def pallas_kernel_reason(kernel: str, module_name: str, *args) -> str | None:
    """Why the Pallas `kernel` (named in the message) of module `module_name` cannot run here: `single_gpu_reason`,
    a failed import (a JAX without Pallas' Triton lowering), or the module's `unsupported_reason(*args)`. None when
    it can."""
    reason = single_gpu_reason(kernel)
    if reason:
        return reason
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        return f"the {kernel} does not import ({e})"
    return module.unsupported_reason(*args)


def pallas_unavailable_reason(rows_dtype, contract_dim: int, out_dim: int) -> str | None:
    """Why the Pallas kernel cannot run here (None when it can)."""
    return pallas_kernel_reason("Pallas grouped matmul", "MaxText.kernels.grouped_matmul.pallas_gmm", rows_dtype,
                                contract_dim, out_dim)


def pallas_or_fallback(key: str, implementation: str, reason: str | None, fallback: str, alternatives: str) -> str:
    """'pallas' when it can run (reason is None); else an error naming `reason` for an explicit `key`=pallas, or
    `fallback` for auto, logged once per reason."""
    if reason is None:
        return "pallas"
    if implementation == "pallas":
        raise RuntimeError(f"{key}=pallas was requested, but {reason}; use {alternatives}")
    if reason not in _logged:
        _logged.add(reason)
        log.info("%s=auto: %s, because %s", key, fallback, reason)
    return fallback


def resolve(implementation: str, rows_dtype=None, contract_dim: int = 128, out_dim: int = 128) -> str:
    """Maps a `moe_grouped_matmul` value to the implementation that runs: 'gather' | 'ragged_dot' | 'pallas'."""
    if implementation not in CHOICES:
        raise ValueError(f"moe_grouped_matmul={implementation!r} is unknown; choose one of {CHOICES}")
    if implementation in ("gather", "ragged_dot"):
        return implementation
    if implementation == "auto" and jax.default_backend() == "cpu":
        return "gather"
    if implementation == "auto" and jax.default_backend() == "tpu":
        return "ragged_dot"
    reason = pallas_unavailable_reason(rows_dtype or "bfloat16", contract_dim, out_dim)
    return pallas_or_fallback("moe_grouped_matmul", implementation, reason, "ragged_dot", "auto, ragged_dot or gather")


def as_tuple(arrays) -> tuple[tuple, bool]:
    """(`arrays` as a tuple, whether several were given): the matmuls here take one weight array or a tuple of them
    and answer in kind."""
    several = isinstance(arrays, (tuple, list))
    return (tuple(arrays) if several else (arrays,)), several


def check_glu_weights(weights: tuple, glu: bool) -> None:
    """glu multiplies by (gate, up): an error naming the count of weight arrays otherwise."""
    if glu and len(weights) != 2:
        raise ValueError(f"glu multiplies by (gate, up): expected two weight arrays, got {len(weights)}")


def glu_output(gate: jax.Array, up: jax.Array, dtype) -> jax.Array:
    """silu_glu of two products (any dtype; computed in float32) -> `dtype`."""
    return silu_glu(gate.astype(jnp.float32), up.astype(jnp.float32)).astype(dtype)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["parts"], meta_fields=["dtype"])
@dataclasses.dataclass(frozen=True)
class PartialRows:
    """Rows [M, K] given as the unsummed K-split products of the matmul that made them, for a Pallas matmul that
    finishes them as it loads its rows (no kernel of their own between the two launches). parts: one [S, M, K]
    array (the rows are its sum over S) or two (an MoE's gate and up products: the rows are SiLU(gate) * up of the
    sums), float32 where S > 1; the rows have `dtype`. `materialize` computes them (elsewhere). A pytree (dtype
    static); `shape` is the rows'."""
    parts: tuple
    dtype: Any

    @property
    def shape(self) -> tuple[int, ...]:
        return self.parts[0].shape[1:]

    def materialize(self) -> jax.Array:
        return finished_rows([part.sum(axis=0) for part in self.parts], self.dtype)


def finished_rows(sums, dtype) -> jax.Array:
    """The rows that PartialRows' part sums stand for, in `dtype`: the one sum, or SiLU(gate) * up of two (in
    float32)."""
    sums = [part_sum.astype(jnp.float32) for part_sum in sums]
    return (sums[0] if len(sums) == 1 else silu_glu(*sums)).astype(dtype)


def product_rows(rows, rows_per_token: int, extra_rows: bool) -> int:
    """How many product rows a `grouped_matmul` call multiplies: rows' count, or with rows_per_token its tokens'
    expansion (`token_rows`)."""
    count = rows.shape[0]
    return count * rows_per_token + (count if extra_rows else 0) if rows_per_token else count


def grouped_matmul(rows, weights, group_sizes: jax.Array, row_groups: jax.Array, *,
                   implementation: str = "auto", precision=None, extra_weights=None, rows_mma: bool | None = None,
                   rows_one_launch: bool = False, glu: bool = False, rows_per_token: int = 0,
                   partial_rows: bool = False, extra_out_in: bool = False, weights_out_in: bool = False):
    """See the module docstring. `weights` [E, K, N] or a tuple of such arrays sharing the rows (e.g. an MoE's gate
    and up projections; returns a tuple of products: the Pallas `tiles` grid reads each row block once for all);
    with weights_out_in [E, N, K] (each group's matrix as torch's Linear.weight): where the Pallas kernel would run
    its `rows` grid, `pallas_rows_out_in` (one output feature's contiguous weights per warp) reads them as stored, as
    do the Pallas `tiles` grid (its blocks multiplied transposed) and gather; ragged_dot gets them transposed to
    [E, K, N] (a copy per call).
    `precision` applies to gather and ragged_dot; the Pallas kernel multiplies bf16 operands in one tensor-core pass
    and fp32 ones in 3-pass tf32. extra_weights: [X, K, N] per weight array for rows of groups E...E+X-1 (stored
    [X, N, K] with extra_out_in: read transposed), on the Pallas `rows` grid only (`extra_groups_supported`;
    pallas_gmm.grouped_matmul). rows_mma: whether the Pallas `rows` grid multiplies on the tensor cores (None: its
    default, `pallas_gmm.default_tiles`); rows_one_launch: whether it multiplies by every array in one launch. glu:
    `weights` is (gate, up); returns the one array glu_output(rows @ gate, rows @ up) (the Pallas kernel applies it
    inside where one program holds both products).

    Inputs the Pallas `rows` grid reads as they are (elsewhere they are expanded first, with the same result):
    rows may be `PartialRows` (the previous call's unsummed products); rows_per_token > 0: `rows` [T, K] are
    tokens standing for `token_rows(rows, rows_per_token, extra_rows=extra_weights is not None)` (no repeated copy);
    row_groups may then list only the T * rows_per_token routed rows, the extra rows being of group E.
    partial_rows: returns `PartialRows` (with glu: one, of the gate and up products) where the products' sums (and
    the activation) would be a kernel of their own after the launch."""
    weights, several = as_tuple(weights)
    check_glu_weights(weights, glu)
    num_rows = product_rows(rows, rows_per_token, extra_weights is not None)
    if weights_out_in:
        outs = _rows_out_in(rows, weights, row_groups, implementation, num_rows, extra_weights=extra_weights,
                            extra_out_in=extra_out_in, rows_per_token=rows_per_token, glu=glu)
        if outs is not None:
            return outs if several and not glu else outs[0]
    out_dim = weights[0].shape[1 if weights_out_in else 2]
    chosen = resolve(implementation, rows.dtype, rows.shape[1], out_dim)
    if extra_weights is not None and not extra_groups_supported(implementation, rows.dtype, rows.shape[1],
                                                                out_dim, num_rows):
        raise ValueError(f"extra_weights need the Pallas rows grid (at most {ROWWISE_MAX_ROWS} rows); "
                         f"moe_grouped_matmul={implementation!r} runs {chosen} for {num_rows} rows")
    if chosen != "pallas" or num_rows > ROWWISE_MAX_ROWS:  # only the Pallas rows grid reads these as they are
        rows = rows.materialize() if isinstance(rows, PartialRows) else rows
        rows = token_rows(rows, rows_per_token, extra_weights is not None) if rows_per_token else rows
        rows_per_token, partial_rows = 0, False
    if chosen == "pallas":
        from MaxText.kernels.grouped_matmul import pallas_gmm  # pylint: disable=import-outside-toplevel
        return pallas_gmm.grouped_matmul(rows, weights if several else weights[0], group_sizes, row_groups,
                                         extra_weights=extra_weights, rows_mma=rows_mma,
                                         rows_one_launch=rows_one_launch, glu=glu, rows_per_token=rows_per_token,
                                         partial_rows=partial_rows, extra_out_in=extra_out_in,
                                         weights_out_in=weights_out_in)
    if chosen == "ragged_dot":
        weights = tuple(jnp.swapaxes(w, 1, 2) for w in weights) if weights_out_in else weights  # [E, K, N]
        product = functools.partial(jax.lax.ragged_dot, group_sizes=group_sizes, precision=precision)
    else:
        product = functools.partial(gather_matmul, row_groups=row_groups, precision=precision,
                                    weights_out_in=weights_out_in)
    outs = tuple(product(rows, w) for w in weights)
    if glu:
        return glu_output(*outs, rows.dtype)
    return outs if several else outs[0]


def _rows_out_in(rows, weights, row_groups, implementation, num_rows, *, extra_weights, extra_out_in,
                 rows_per_token, glu):
    """`grouped_matmul` of [E, N, K] weights by `pallas_rows_out_in` where the Pallas `rows` grid would run (a tuple
    of products; glu: one), else None."""
    contract, out_dim = weights[0].shape[2], weights[0].shape[1]
    if resolve(implementation, rows.dtype, contract, out_dim) != "pallas" or num_rows > ROWWISE_MAX_ROWS:
        return None
    from MaxText.kernels.grouped_matmul import pallas_rows_out_in  # pylint: disable=import-outside-toplevel
    block_rows = pallas_rows_out_in.BLOCK_ROWS_GLU if glu else pallas_rows_out_in.BLOCK_ROWS
    if pallas_rows_out_in.unsupported_reason(contract, out_dim, block_rows):
        return None
    rows = rows.materialize() if isinstance(rows, PartialRows) else rows
    extras = () if extra_weights is None else tuple(
        x if extra_out_in else jnp.swapaxes(x, 1, 2) for x in as_tuple(extra_weights)[0])  # [X, N, K]
    return pallas_rows_out_in.grouped_matmul_out_in(rows, weights, row_groups, extra_weights=extras,
                                                    rows_per_token=rows_per_token, glu=glu)


def extra_groups_supported(implementation: str, rows_dtype, contract_dim: int, out_dim: int, num_rows: int) -> bool:
    """Whether `grouped_matmul` takes extra_weights for this call: the Pallas kernel's `rows` grid runs it."""
    return (resolve(implementation, rows_dtype, contract_dim, out_dim) == "pallas"
            and num_rows <= ROWWISE_MAX_ROWS)


def rows_must_be_sorted(implementation: str, rows_dtype, contract_dim: int, out_dim: int, num_rows: int) -> bool:
    """Whether `grouped_matmul` needs its rows sorted by group for this call: ragged_dot and the Pallas `tiles`
    grid do; gather and the Pallas `rows` grid (<= ROWWISE_MAX_ROWS rows, decode) multiply every row by
    its own group's matrix in any order, so a caller may skip the sort and the unsort (a few small kernels per MoE
    layer and step)."""
    chosen = resolve(implementation, rows_dtype, contract_dim, out_dim)
    if chosen == "pallas":
        return num_rows > ROWWISE_MAX_ROWS
    return chosen == "ragged_dot"


DENSE_CHOICES = ("auto", "xla", "pallas")
# `auto`: the Pallas kernel for at most this many rows. Measured on an H200 (Kimi-Linear-48B decode steps, JAX 0.11.2):
# batch 1 4.51 ms with it vs 6.70 ms with XLA; batch 8 9.08 vs 8.72 ms (one run of model_decode.py each way;
# per projection, same run: benchmarks/grouped_matmul.py; benchmarks/RESULTS.md).
DENSE_PALLAS_MAX_ROWS = 1


def resolve_dense(implementation: str, dtype, contract_dim: int, out_dim: int, num_rows: int) -> str:
    """Maps a `dense_matmul` value to 'xla' | 'pallas' for a [num_rows, contract_dim] x [contract_dim, out_dim]
    product. auto: pallas for bfloat16 products of <= DENSE_PALLAS_MAX_ROWS rows (a batch-1 decode step) on one
    NVIDIA GPU, else xla."""
    if implementation not in DENSE_CHOICES:
        raise ValueError(f"dense_matmul={implementation!r} is unknown; choose one of {DENSE_CHOICES}")
    if implementation == "xla":
        return "xla"
    if implementation == "auto" and (jax.default_backend() != "gpu" or num_rows > DENSE_PALLAS_MAX_ROWS
                                     or jnp.dtype(dtype) != jnp.bfloat16):
        return "xla"
    return pallas_or_fallback("dense_matmul", implementation, pallas_unavailable_reason(dtype, contract_dim, out_dim),
                               "xla", "auto or xla")


# XLA:GPU rewrites a one-row product into its reduction emitter only when the operands have fewer elements than this
# (DotStrengthReduction); a larger one runs as a cuBLAS GEMM.
XLA_ROW_REWRITE_ELEMENTS = 10_000_000


def row_product_as_reduce(rows: int, kernel_elements: int, max_elements: int) -> bool:
    """Whether `dense_matmul`'s XLA product of `rows` rows writes x @ kernel as multiply + sum: one row, a kernel of
    more than XLA_ROW_REWRITE_ELEMENTS and at most `max_elements` elements (0: never)."""
    return rows == 1 and XLA_ROW_REWRITE_ELEMENTS < kernel_elements <= max_elements


def row_product(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """x [..., K] (one row) @ kernel [K, N] as float32 products summed over K, rounded to x's dtype: the math of a
    dot at DEFAULT precision, in the form XLA:GPU streams through its reduction emitter."""
    return jnp.sum(x[..., :, None].astype(jnp.float32) * kernel.astype(jnp.float32), axis=-2).astype(x.dtype)


def dense_matmul(x: jax.Array, kernel, *, implementation: str = "auto", precision=None, grid: str = "tiles",
                 pad_rows: bool = False, row_reduce_max_elements: int = 0):
    """x [..., K] @ kernel [K, N] -> [..., N] in x's dtype. xla: jnp.dot (with `precision`). pallas: the grouped
    matmul's tiles grid with one group and K split over programs (pallas_gmm.dense_matmul): XLA's M = 1
    products read an H200's memory at ~0.6 TB/s in a Kimi-Linear-48B decode step (benchmarks/RESULTS.md).
    `kernel` may be a tuple of same-shape [K, N] kernels: returns the tuple of products (pallas: one launch).
    grid, pad_rows: the Pallas kernel's grid and whether its tiles grid pads the rows to a 16-row block
    (pallas_gmm.dense_matmul; config keys `dense_matmul_grid`, `dense_pad_rows`). row_reduce_max_elements: XLA's
    one-row products of larger kernels than XLA rewrites itself, up to this many elements, as multiply + sum
    (`row_product`; config key `dense_row_reduce_max_elements`)."""
    kernels, several = as_tuple(kernel)
    rows = math.prod(x.shape[:-1])
    if resolve_dense(implementation, x.dtype, x.shape[-1], kernels[0].shape[-1], rows) == "xla":
        outs = tuple(row_product(x, k) if row_product_as_reduce(rows, k.size, row_reduce_max_elements)
                     else jnp.dot(x, k, precision=precision) for k in kernels)
    else:
        from MaxText.kernels.grouped_matmul import pallas_gmm  # pylint: disable=import-outside-toplevel
        outs = pallas_gmm.dense_matmul(x.reshape(rows, x.shape[-1]), kernels, grid=grid,
                                       pad_rows=pad_rows)  # [M, N] each
        outs = tuple(out.reshape(*x.shape[:-1], out.shape[-1]) for out in outs)
    return outs if several else outs[0]
