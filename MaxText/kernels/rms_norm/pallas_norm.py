"""RMSNorm of a few rows in one Triton kernel (Pallas): one program per row reads the row once, reduces its squares
in float32 and writes the scaled row. XLA makes a norm of a decode step's rows two kernels (the reduction, then the
scaling), each ~1 us of a dependent chain.

    rms_norm(x [M, D], scale [D], epsilon) -> [M, D] in x's dtype, as naive.rms_norm (the row padded to a power of
    two with masked loads; float32 sum of squares, HF's casts)
    add_rms_norm(x [M, D], update, scale [D], epsilon) -> (normed, summed) as naive.add_rms_norm: the residual
    stream's add (summed = x + update, rounded to x's dtype, also written out) in the norm's own kernel, so that
    the add is no kernel of its own before the norm. update: [M, D], or terms (naive.combine_terms: rows [M, D]
    or weighted rows [M, R, D] with weights [M, R], e.g. the MoE's expert outputs and shared expert): the weighted
    sum is the kernel's too

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


def _load_row(ref, index, block, inside):
    """ref[index..., :block] with the values past the row's end masked to zero."""
    return pltriton.load(ref.at[(*index, pl.ds(0, block))], mask=inside, other=0)


def _kernel(*refs, dim, block, epsilon, term_rows):
    """refs: x, then per term its rows (and weights when term_rows[i] is a count of weighted rows, not None), scale,
    out, then summed when there are terms."""
    x_ref, refs = refs[0], refs[1:]
    row = pl.program_id(0)
    inside = jnp.arange(block) < dim  # [BD] the row's values (block: dim padded to a power of two)
    x = _load_row(x_ref, (row,), block, inside)
    update = None
    for num_rows in term_rows:  # naive.combine_terms: each term rounded to x's dtype, the terms added in order
        if num_rows is None:
            (rows_ref, *refs) = refs
            term = _load_row(rows_ref, (row,), block, inside).astype(x.dtype)
        else:
            (rows_ref, weights_ref, *refs) = refs
            acc = jnp.zeros((block,), jnp.float32)
            for r in range(num_rows):
                weight = weights_ref[row, r].astype(jnp.float32)
                acc = acc + weight * _load_row(rows_ref, (row, jnp.int32(r)), block, inside).astype(jnp.float32)
            term = acc.astype(x.dtype)
        update = term if update is None else (update.astype(jnp.float32) + term.astype(jnp.float32)).astype(x.dtype)
    scale_ref, out_ref, *summed_ref = refs
    if update is not None:  # naive.add_rms_norm: the sum in float32, rounded to x's dtype, the norm taken of it
        x = (x.astype(jnp.float32) + update.astype(jnp.float32)).astype(x.dtype)
        pltriton.store(summed_ref[0].at[row, pl.ds(0, block)], x, mask=inside)
    x = x.astype(jnp.float32)
    normed = (x * jax.lax.rsqrt(jnp.sum(x * x) / dim + epsilon)).astype(out_ref.dtype)
    scale = _load_row(scale_ref, (), block, inside).astype(out_ref.dtype)
    pltriton.store(out_ref.at[row, pl.ds(0, block)], scale * normed, mask=inside)


def _check_terms(x, terms):
    """The terms' shapes against x [M, D]: rows [M, D], or rows [M, R, D] with weights [M, R]."""
    for rows, weights in terms:
        want = x.shape if weights is None else (x.shape[0], weights.shape[-1], x.shape[1])
        if rows.shape != want or (weights is not None and weights.shape != want[:2]):
            raise ValueError(f"expected update rows {want} (and weights {want[:2]}) for x {x.shape}, got rows "
                             f"{rows.shape}" + ("" if weights is None else f" and weights {weights.shape}"))


def _norm_call(x, terms, scale, epsilon, interpret):
    """The launch: `terms` () for a plain norm (returns normed), else (normed, summed)."""
    if x.ndim != 2 or scale.shape != (x.shape[1],):
        raise ValueError(f"expected x [M, D] and scale [D], got {x.shape} and {scale.shape}")
    _check_terms(x, terms)
    reason = unsupported_reason(x.dtype, x.shape[1])
    if reason:
        raise ValueError(reason)
    num_rows, dim = x.shape
    block = 1 << (dim - 1).bit_length()  # the row padded to a power of two
    term_rows = tuple(None if weights is None else weights.shape[-1] for _, weights in terms)
    term_arrays = [array for term in terms for array in term if array is not None]
    out_shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return pl.pallas_call(
        functools.partial(_kernel, dim=dim, block=block, epsilon=epsilon, term_rows=term_rows),
        out_shape=(out_shape, out_shape) if terms else out_shape,
        grid=(num_rows,),
        compiler_params=pltriton.CompilerParams(num_warps=4 if block <= 4096 else 8, num_stages=1),
        interpret=interpret,
        name="add_rms_norm" if terms else "rms_norm",
    )(x, *term_arrays, scale)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def rms_norm(x: jax.Array, scale: jax.Array, epsilon: float, interpret: bool = False) -> jax.Array:
    """See the module docstring."""
    return _norm_call(x, (), scale, epsilon, interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def add_rms_norm(x: jax.Array, update, scale: jax.Array, epsilon: float,
                 interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """See the module docstring."""
    return _norm_call(x, naive.as_terms(update), scale, epsilon, interpret)


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
