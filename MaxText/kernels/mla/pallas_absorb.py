"""MLA's absorbed query at decode in one Pallas (Triton lowering) launch.

    q_latent [M, H, R], q_rope [M, H, P] = absorb_query(q [M, H * (nope + P)], kv_b [H * (nope + v), R],
                                                        row_scale [M, 1] | None, num_heads=H, nope=..., v_dim=...)

    q_latent[m, h] = q_nope[m, h] @ W_uk[h]   with W_uk[h] = kv_b[h * (nope + v) : h * (nope + v) + nope]  [nope, R]
    q_rope[m, h]   = q[m, h, nope:]

`kv_b` is kv_b_proj's kernel as stored with `dense_kernel_layout: out_in` (torch's [out, in]): each head's W_uk rows
are read in place. With `row_scale` (the deferred input norm's 1 / rms, float32), q is first scaled and rounded to its
dtype, as `linears.scale_rows` does before the einsum. The product accumulates in float32 and is rounded to q's dtype
(XLA's einsum at DEFAULT precision does the same, in another order).

At batch-1 decode XLA makes this a scale / convert fusion, a reduction fusion for the einsum and a slice fusion for
q_rope, one after the other on the layer's dependent chain; here it is one launch of (rows, heads, R / block_r)
programs, each reading its head's [nope, block_r] slice of W_uk. Runs under `interpret=True` on CPU (the tests do).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from MaxText.kernels.mla.pallas_decode import power_of_two

BLOCK_R = 64
NUM_WARPS = 4


def _absorb_kernel(q_ref, w_ref, *rest, nope, rope, v_dim, block_r, scaled):
    scale_ref, (latent_ref, rope_ref) = (rest[0], rest[1:]) if scaled else (None, rest)
    row, head, block = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    q_start = head * (nope + rope)

    def scaled_q(start, size):  # [size] float32, rounded to q's dtype after the scaling as scale_rows rounds
        q = q_ref[row, pl.ds(start, size)]
        if scale_ref is None:
            return q.astype(jnp.float32)
        return (q.astype(jnp.float32) * scale_ref[row]).astype(q_ref.dtype).astype(jnp.float32)

    q_nope = scaled_q(q_start, nope)  # [nope]
    cols = pl.ds(block * block_r, block_r)
    w_uk = w_ref[pl.ds(head * (nope + v_dim), nope), cols].astype(jnp.float32)  # [nope, block_r]
    latent_ref[row, head, cols] = jnp.sum(q_nope[:, None] * w_uk, axis=0).astype(latent_ref.dtype)

    @pl.when(block == 0)
    def _():
        rope_ref[row, head, :] = scaled_q(q_start + nope, rope).astype(rope_ref.dtype)


def unsupported_reason(nope: int, rope: int, rank: int) -> str | None:
    """None when the kernel takes these head sizes (Triton's block shapes are powers of two)."""
    for name, dim in (("qk_nope_head_dim", nope), ("qk_rope_head_dim", rope), ("kv_lora_rank", rank)):
        if not power_of_two(dim):
            return f"the Pallas MLA query absorption needs {name} to be a power of two, got {dim}"
    return None


def absorb_query(q: jax.Array, kv_b: jax.Array, row_scale: jax.Array | None, *, num_heads: int, nope: int,
                 v_dim: int, block_r: int = BLOCK_R, num_warps: int = NUM_WARPS,
                 interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """See the module docstring. q [M, H * (nope + P)]; kv_b [H * (nope + v), R]; row_scale [M, 1] float32 or None.
    Returns (q_latent [M, H, R], q_rope [M, H, P]) in q's dtype."""
    rows, width = q.shape
    rope = width // num_heads - nope
    rank = kv_b.shape[1]
    if width != num_heads * (nope + rope) or rope < 1 or kv_b.shape[0] != num_heads * (nope + v_dim):
        raise ValueError(f"expected q [M, H * (nope + rope)] and kv_b [H * (nope + v), R] with H={num_heads}, "
                         f"nope={nope}, v={v_dim}; got q {q.shape}, kv_b {kv_b.shape}")
    if row_scale is not None and row_scale.shape != (rows, 1):
        raise ValueError(f"expected row_scale [M, 1] = {(rows, 1)}, got {row_scale.shape}")
    reason = unsupported_reason(nope, rope, rank)
    if reason:
        raise ValueError(reason)
    if not power_of_two(block_r):
        raise ValueError(f"block_r={block_r} must be a power of two")
    block_r = min(block_r, rank)
    scaled = row_scale is not None
    kernel = functools.partial(_absorb_kernel, nope=nope, rope=rope, v_dim=v_dim, block_r=block_r, scaled=scaled)
    operands = (q, kv_b.astype(q.dtype)) + ((row_scale.reshape(rows).astype(jnp.float32),) if scaled else ())
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((rows, num_heads, rank), q.dtype),
                   jax.ShapeDtypeStruct((rows, num_heads, rope), q.dtype)),
        grid=(rows, num_heads, rank // block_r),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="mla_absorb_query",
    )(*operands)
