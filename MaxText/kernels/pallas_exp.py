"""The exponential used inside the Pallas (Triton lowering) kernels.

`jnp.exp` in a Pallas Triton kernel lowers to libdevice's `__nv_expf` (float32): an accurate range reduction of
about nine instructions around one MUFU.EX2 per element. `exp` here is `exp2(x log2 e)`, which lowers to one
multiply and one MUFU.EX2 (`ex2.approx`, ~2 ulp), as Triton's own `tl.exp` does. The KDA prefill kernels use it
(diag, scores, wu, recurrence) on a natural-log G (fp32 inputs; with bf16 inputs they keep G in base 2 and call
exp2 directly: `pallas_chunk`'s base2): `diag` and `scores` evaluate many exponentials per loaded
element and are bound by their instruction count (Nsight Compute: `diag` at 74% of the SM's issue rate); their SASS
falls from 448 to 328 (`diag`) and from 2704 to 2072 (`scores`) instructions (benchmarks/kernel_resources.py,
sm_90a). H200, B=8, T=4096, each kernel timed with both in one run (benchmarks/RESULTS.md): diag 0.922 vs 1.034 ms,
scores 1.050 vs 1.091, wu 0.750 vs 1.055, recurrence unchanged; the prefill's error vs the naive oracle unchanged
(rel. L2 4.1e-3). The memory-bound decode kernels keep `jnp.exp`.
"""

from __future__ import annotations

import jax.numpy as jnp

LOG2E = 1.4426950408889634  # log2(e)


def exp(x):
    """e^x as exp2(x log2 e) (float32 inputs in the kernels; relative error ~1e-7 plus |x| * 6e-8 from the
    multiply's rounding)."""
    return jnp.exp2(x * LOG2E)
