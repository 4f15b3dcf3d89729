"""RMSNorm of a few rows in one Triton kernel (Pallas): one program per row reads the row once, reduces its squares
in float32 and writes the scaled row. XLA makes a norm of a decode step's rows two kernels (the reduction, then the
scaling), each ~1 us of a dependent chain.

    rms_norm(x [M, D], scale [D], epsilon) -> [M, D] in x's dtype, as naive.rms_norm (the row padded to a power of
    two with masked loads; float32 sum of squares, HF's casts)
    add_rms_norm(x [M, D], update [M, D], scale [D], epsilon) -> (normed, summed) as naive.add_rms_norm: the
    residual stream's add (summed = x + update, rounded to x's dtype, also written out) in the norm's own kernel,
    so that the add is no kernel of its own before the norm

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


def residual_sum(x, update):
    """naive.add_rms_norm's add inside a kernel: the update cast to x's dtype, added in float32, the sum rounded to
    x's dtype."""
    return (x.astype(jnp.float32) + update.astype(x.dtype).astype(jnp.float32)).astype(x.dtype)


def inverse_rms(row, dim: int, epsilon: float):
    """1 / rms of a float32 row of `dim` values (zeros past them) inside a kernel: a scalar."""
    return jax.lax.rsqrt(jnp.sum(row * row) / dim + epsilon)


def scaled_norm(row, inv, scale, dtype):
    """The norm of (a block of) a float32 row with its `inverse_rms`, HF's casts: (row * inv) in `dtype` times the
    scale in `dtype`."""
    return scale.astype(dtype) * (row * inv).astype(dtype)


def load_row(ref, row, dim: int, block: int):
    """Row `row` of a [M, dim] ref as [block] values (block: dim padded to a power of two; zeros past dim)."""
    return pltriton.load(ref.at[row, pl.ds(0, block)], mask=jnp.arange(block) < dim, other=0)


def _kernel(*refs, dim, block, epsilon, adds_update):
    """refs: x, [update], scale, out, [summed] (the bracketed ones with `adds_update`)."""
    if adds_update:
        x_ref, update_ref, scale_ref, out_ref, summed_ref = refs
    else:
        x_ref, scale_ref, out_ref = refs
    row = pl.program_id(0)
    inside = jnp.arange(block) < dim  # [BD] the row's values (block: dim padded to a power of two)
    x = load_row(x_ref, row, dim, block)
    if adds_update:
        x = residual_sum(x, load_row(update_ref, row, dim, block))
        pltriton.store(summed_ref.at[row, pl.ds(0, block)], x, mask=inside)
    x = x.astype(jnp.float32)
    scale = pltriton.load(scale_ref.at[pl.ds(0, block)], mask=inside, other=0)
    pltriton.store(out_ref.at[row, pl.ds(0, block)], scaled_norm(x, inverse_rms(x, dim, epsilon), scale,
                                                                 out_ref.dtype), mask=inside)


def _norm_call(x, update, scale, epsilon, interpret):
    """The launch: `update` None for a plain norm (returns normed), else (normed, summed)."""
    if x.ndim != 2 or scale.shape != (x.shape[1],):
        raise ValueError(f"expected x [M, D] and scale [D], got {x.shape} and {scale.shape}")
    if update is not None and update.shape != x.shape:
        raise ValueError(f"expected update of x's shape {x.shape}, got {update.shape}")
    reason = unsupported_reason(x.dtype, x.shape[1])
    if reason:
        raise ValueError(reason)
    num_rows, dim = x.shape
    block = 1 << (dim - 1).bit_length()  # the row padded to a power of two
    adds_update = update is not None
    out_shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return pl.pallas_call(
        functools.partial(_kernel, dim=dim, block=block, epsilon=epsilon, adds_update=adds_update),
        out_shape=(out_shape, out_shape) if adds_update else out_shape,
        grid=(num_rows,),
        compiler_params=pltriton.CompilerParams(num_warps=4 if block <= 4096 else 8, num_stages=1),
        interpret=interpret,
        name="add_rms_norm" if adds_update else "rms_norm",
    )(*((x, update, scale) if adds_update else (x, scale)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def rms_norm(x: jax.Array, scale: jax.Array, epsilon: float, interpret: bool = False) -> jax.Array:
    """See the module docstring."""
    return _norm_call(x, None, scale, epsilon, interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def add_rms_norm(x: jax.Array, update: jax.Array, scale: jax.Array, epsilon: float,
                 interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """See the module docstring."""
    return _norm_call(x, update, scale, epsilon, interpret)


def _backward_of(oracle):
    """The custom VJP's backward pass: the oracle's, at the forward's arrays."""
    def backward(epsilon, interpret, arrays, cotangent):
        del interpret
        _, vjp = jax.vjp(functools.partial(oracle, epsilon=epsilon), *arrays)
        return vjp(cotangent)
    return backward


rms_norm.defvjp(lambda x, scale, epsilon, interpret: (rms_norm(x, scale, epsilon, interpret), (x, scale)),
                _backward_of(naive.rms_norm))
add_rms_norm.defvjp(lambda x, update, scale, epsilon, interpret: (
    add_rms_norm(x, update, scale, epsilon, interpret), (x, update, scale)), _backward_of(naive.add_rms_norm))
