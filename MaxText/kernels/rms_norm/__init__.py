"""RMSNorm (config key `norm_kernel`): HF `KimiLinearRMSNorm`, the decoder's input / post-attention / final norms
and MLA's kv_a_layernorm.

    y = rms_norm(x, scale, epsilon=1e-6, implementation="auto")
    x [..., D], scale [D]  ->  y [..., D] in x's dtype: normalized in float32, cast to x's dtype, times scale
    y, summed = add_rms_norm(x, update, scale, epsilon=1e-6, implementation="auto")
    the residual stream's add first: summed = x + update in x's dtype (update [..., D] cast to it), y = its norm

Implementations:
  xla     naive.rms_norm, the oracle: plain JAX, any backend (on a GPU XLA makes a decode step's norm two kernels:
          the reduction, then the scaling).
  pallas  pallas_norm.py: one Triton kernel, one program per row (add_rms_norm: the add in the same kernel).
          NVIDIA GPU, no multi-device mesh, bf16 / f32 rows of at most 16384 values. Differentiable (the oracle's
          backward).
  auto    pallas for at most PALLAS_MAX_ROWS rows (a batch-1 decode step) where it runs (else one log line), xla
          for more rows and on other backends; the default.
"""

from __future__ import annotations

import math

import jax

from MaxText.kernels.grouped_matmul import pallas_kernel_reason, pallas_or_fallback
from MaxText.kernels.rms_norm import naive

CHOICES = ("auto", "xla", "pallas")
# auto: the Pallas kernel up to this many rows, XLA's fusions above. 48B decode on an H200 (one process, JAX 0.11.2):
# batch 1 2.821 / 2.778 vs 2.824 ms per token with XLA's, 675 vs 722 launches, the same tokens and a bit-identical
# cache; batch 8 6.377 / 6.390 vs 6.353 ms (and other rounding).
PALLAS_MAX_ROWS = 1


def pallas_unavailable_reason(dtype, dim: int) -> str | None:
    """Why the Pallas RMSNorm cannot run here (None when it can)."""
    return pallas_kernel_reason("Pallas RMSNorm", "MaxText.kernels.rms_norm.pallas_norm", dtype, dim)


def resolve(implementation: str, dtype, dim: int, num_rows: int) -> str:
    """Maps a `norm_kernel` value to 'xla' | 'pallas' for `num_rows` rows of `dim` values."""
    if implementation not in CHOICES:
        raise ValueError(f"norm_kernel={implementation!r} is unknown; choose one of {CHOICES}")
    if implementation == "xla" or (implementation == "auto" and (num_rows > PALLAS_MAX_ROWS
                                                                 or jax.default_backend() != "gpu")):
        return "xla"
    return pallas_or_fallback("norm_kernel", implementation, pallas_unavailable_reason(dtype, dim), "xla",
                              "auto or xla")


def rms_norm(x: jax.Array, scale: jax.Array, *, epsilon: float, implementation: str = "auto") -> jax.Array:
    """See the module docstring."""
    rows = math.prod(x.shape[:-1])
    if resolve(implementation, x.dtype, x.shape[-1], rows) == "pallas":
        from MaxText.kernels.rms_norm import pallas_norm  # pylint: disable=import-outside-toplevel
        return pallas_norm.rms_norm(x.reshape(rows, x.shape[-1]), scale, epsilon).reshape(x.shape)
    return naive.rms_norm(x, scale, epsilon)


def add_rms_norm(x: jax.Array, update: jax.Array, scale: jax.Array, *, epsilon: float,
                 implementation: str = "auto") -> tuple[jax.Array, jax.Array]:
    """See the module docstring."""
    if update.shape != x.shape:
        raise ValueError(f"add_rms_norm: update has shape {update.shape}, expected x's {x.shape}")
    rows = math.prod(x.shape[:-1])
    if resolve(implementation, x.dtype, x.shape[-1], rows) == "pallas":
        from MaxText.kernels.rms_norm import pallas_norm  # pylint: disable=import-outside-toplevel
        normed, summed = pallas_norm.add_rms_norm(x.reshape(rows, x.shape[-1]), update.reshape(rows, x.shape[-1]),
                                                  scale, epsilon)
        return normed.reshape(x.shape), summed.reshape(x.shape)
    return naive.add_rms_norm(x, update, scale, epsilon)
