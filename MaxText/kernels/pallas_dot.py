"""The matrix product used inside the Pallas (Triton lowering) kernels."""

from __future__ import annotations

from jax import lax
import jax.numpy as jnp


def dot(a, b, *, trans_b=False, precise=True, interpret=False):
    """a [M, K] x b [K, N] (or b [N, K] with trans_b) accumulated in float32. `precise` (fp32 operands) uses 3-pass
    tf32 on the GPU (about fp32 accuracy) and exact fp32 when interpreting; otherwise one tensor-core pass in the
    operands' dtype (bf16)."""
    dims = (((1,), (1 if trans_b else 0,)), ((), ()))
    if not precise:
        return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)
    precision = lax.Precision.HIGHEST if interpret else lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)
