"""RMSNorm of a few rows in one Triton kernel (Pallas): one program per row reads the row once, reduces its squares
in float32 and writes the scaled row. XLA makes a norm of a decode step's rows two kernels (the reduction, then the
scaling), each ~1 us of a dependent chain.

    rms_norm(x [M, D], scale [D], epsilon) -> [M, D] in x's dtype, as naive.rms_norm (the row padded to a power of
    two with masked loads; float32 sum of squares, HF's casts)

Differentiable: the backward pass is the oracle's (XLA). Runs under `interpret=True` on CPU (the tests do).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from MaxText.kernels.rms_norm import naive

MAX_DIM = 16384  # one program holds the whole row in registers


def unsupported_reason(dtype, dim: int) -> str | None:
    """None when the kernel takes rows of this dtype and width."""
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        return f"the Pallas RMSNorm takes bfloat16 or float32 rows, got {jnp.dtype(dtype)}"
    if not 1 <= dim <= MAX_DIM:
        return f"the Pallas RMSNorm holds a row of at most {MAX_DIM} values, got {dim}"
    return None


def _kernel(x_ref, scale_ref, out_ref, *, dim, block, epsilon):
    row = pl.program_id(0)
    inside = jnp.arange(block) < dim  # [BD] the row's values (block: dim padded to a power of two)
    x = pltriton.load(x_ref.at[row, pl.ds(0, block)], mask=inside, other=0).astype(jnp.float32)
    normed = (x * jax.lax.rsqrt(jnp.sum(x * x) / dim + epsilon)).astype(out_ref.dtype)
    scale = pltriton.load(scale_ref.at[pl.ds(0, block)], mask=inside, other=0).astype(out_ref.dtype)
    pltriton.store(out_ref.at[row, pl.ds(0, block)], scale * normed, mask=inside)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def rms_norm(x: jax.Array, scale: jax.Array, epsilon: float, interpret: bool = False) -> jax.Array:
    """See the module docstring."""
    if x.ndim != 2 or scale.shape != (x.shape[1],):
        raise ValueError(f"expected x [M, D] and scale [D], got {x.shape} and {scale.shape}")
    reason = unsupported_reason(x.dtype, x.shape[1])
    if reason:
        raise ValueError(reason)
    num_rows, dim = x.shape
    block = 1 << (dim - 1).bit_length()  # the row padded to a power of two
    return pl.pallas_call(
        functools.partial(_kernel, dim=dim, block=block, epsilon=epsilon),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(num_rows,),
        compiler_params=pltriton.CompilerParams(num_warps=4 if block <= 4096 else 8, num_stages=1),
        interpret=interpret,
        name="rms_norm",
    )(x, scale)


def _rms_norm_fwd(x, scale, epsilon, interpret):
    return rms_norm(x, scale, epsilon, interpret), (x, scale)


def _rms_norm_bwd(epsilon, interpret, residuals, cotangent):
    del interpret
    _, vjp = jax.vjp(functools.partial(naive.rms_norm, epsilon=epsilon), *residuals)
    return vjp(cotangent)


rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)
