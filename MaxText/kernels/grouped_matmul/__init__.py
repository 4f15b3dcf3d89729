"""Grouped matmul of the MoE's sorted, dropless dispatch (config key `moe_grouped_matmul`):

    out = grouped_matmul(rows, weights, group_sizes, row_groups, implementation="auto")
    rows [M, K] sorted by group; weights [E, K, N]; group_sizes [E] int32 (sum M); row_groups [M] int32 (the same
    grouping, non-decreasing)  ->  out [M, N], row m times weights[row_groups[m]]

Implementations:
  gather      naive.py, the oracle: each row times its own gathered [K, N] matrix. Any backend; reads one matrix per
              row, so it suits CPU and few rows.
  ragged_dot  `jax.lax.ragged_dot`. A native grouped GEMM on TPU; XLA:GPU (JAX 0.11.2) and XLA:CPU expand it into a
              dense product over every group (measured on an H200: 15-30x the time at 256 experts vs 8).
  pallas      pallas_gmm.py, a Triton grouped matmul that reads each used group's matrix once per block of rows
              (a vector-matrix grid for <= 64 rows).
              NVIDIA GPU only, and not under a multi-device mesh (XLA cannot partition a Pallas call; the sharded
              MoE keeps ragged_dot). Differentiable through ragged_dot's backward (training: fast forward only).
  auto        on an NVIDIA GPU without a multi-device mesh: gather up to GATHER_MAX_ROWS rows (decode of <= 8
              tokens), pallas above (when its import and the shapes allow; else one log line and ragged_dot);
              ragged_dot on TPU and sharded GPUs; gather on CPU.

The GPU threshold is measured (H200, JAX 0.11.2, Kimi-Linear-48B, benchmarks/RESULTS.md): whole decode steps at
batch 1 and 8 (8 and 64 rows per MoE layer) took 9.4 / 9.5 ms with gather and 11.1 / 15.6 ms with pallas, while at
512 rows one expert product took 0.39 ms with pallas and 7.4 ms with gather (and a 4096-token prefill fell from
4.4 s with ragged_dot to 0.24 s, in two runs of benchmarks/model_decode.py).
"""

from __future__ import annotations

import importlib
import logging

import jax

from MaxText.kernels.grouped_matmul.naive import gather_matmul

CHOICES = ("auto", "ragged_dot", "gather", "pallas")
GATHER_MAX_ROWS = 64  # `auto` on one GPU: gather up to this many rows (batch * top_k), pallas above
log = logging.getLogger(__name__)
_logged: set[str] = set()


def pallas_unavailable_reason(rows_dtype, contract_dim: int, out_dim: int) -> str | None:
    """Why the Pallas kernel cannot run here (None when it can)."""
    backend = jax.default_backend()
    if backend != "gpu" or "rocm" in jax.devices()[0].platform:
        return f"the Pallas grouped matmul needs an NVIDIA GPU, and the default backend is {backend!r}"
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and mesh.size > 1:
        return f"a {mesh.size}-device mesh is current, and XLA cannot partition the Pallas grouped matmul"
    try:
        module = importlib.import_module("MaxText.kernels.grouped_matmul.pallas_gmm")
    except ImportError as e:  # a JAX without Pallas' Triton lowering
        return f"the Pallas grouped matmul does not import ({e})"
    return module.unsupported_reason(rows_dtype, contract_dim, out_dim)


def resolve(implementation: str, rows_dtype=None, contract_dim: int = 128, out_dim: int = 128,
            num_rows: int | None = None) -> str:
    """Maps a `moe_grouped_matmul` value to the implementation that runs: 'gather' | 'ragged_dot' | 'pallas'.
    `num_rows` (M) matters to `auto` on a GPU only; None means many rows."""
    if implementation not in CHOICES:
        raise ValueError(f"moe_grouped_matmul={implementation!r} is unknown; choose one of {CHOICES}")
    if implementation in ("gather", "ragged_dot"):
        return implementation
    if implementation == "auto" and jax.default_backend() == "cpu":
        return "gather"
    if implementation == "auto" and jax.default_backend() == "tpu":
        return "ragged_dot"
    reason = pallas_unavailable_reason(rows_dtype or "bfloat16", contract_dim, out_dim)
    if reason is None:
        few_rows = implementation == "auto" and num_rows is not None and num_rows <= GATHER_MAX_ROWS
        return "gather" if few_rows else "pallas"
    if implementation == "pallas":
        raise RuntimeError(f"moe_grouped_matmul=pallas was requested, but {reason}; use auto, ragged_dot or gather")
    if reason not in _logged:
        _logged.add(reason)
        log.info("moe_grouped_matmul=auto: ragged_dot, because %s", reason)
    return "ragged_dot"


def grouped_matmul(rows: jax.Array, weights: jax.Array, group_sizes: jax.Array, row_groups: jax.Array, *,
                   implementation: str = "auto", precision=None) -> jax.Array:
    """See the module docstring. `precision` applies to gather and ragged_dot; the Pallas kernel multiplies bf16
    operands in one tensor-core pass and fp32 ones in 3-pass tf32."""
    chosen = resolve(implementation, rows.dtype, rows.shape[1], weights.shape[2], rows.shape[0])
    if chosen == "pallas":
        from MaxText.kernels.grouped_matmul import pallas_gmm  # pylint: disable=import-outside-toplevel
        return pallas_gmm.grouped_matmul(rows, weights, group_sizes, row_groups)
    if chosen == "ragged_dot":
        return jax.lax.ragged_dot(rows, weights, group_sizes, precision=precision)
    return gather_matmul(rows, weights, row_groups, precision=precision)
