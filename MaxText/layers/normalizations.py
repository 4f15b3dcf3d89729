"""RMSNorm as in HF `KimiLinearRMSNorm`: normalize in float32, cast back to the input dtype, multiply by `scale`."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from MaxText.kernels.rms_norm import add_rms_norm, rms_norm
from MaxText.kernels.rms_norm.naive import inverse_rms, residual_add


class RMSNorm(nn.Module):
    """y = scale * (x / sqrt(mean(x^2) + eps)), the normalization computed in float32.

    The normalized value is cast to x's dtype before the multiply (HF semantics), so the output has x's dtype
    when `scale` (stored in `weight_dtype`) is cast to it. Param: `scale` [features], initialized to ones. Computed
    by `config.norm_kernel` (MaxText/kernels/rms_norm: a Pallas kernel for a batch-1 decode step's row on a GPU).

    `__call__(x, update=None)`: with an `update` (the output of the block before the norm), the residual stream's add
    comes first and the call returns (norm(x + update), x + update), the sum in x's dtype; with
    `config.norm_adds_residual` the Pallas kernel does the add itself (one kernel instead of an add and a norm).

    `__call__(x, deferred=True)` returns the norm in two factors for a caller whose next step is linear in each row
    (projections): (scale * x in x's dtype, inverse_rms(x) [..., 1] float32); the products of the first times the
    second are the products of the norm (float rounding aside), and the products need not wait for the reduction.
    """
    config: ml_collections.FrozenConfigDict
    epsilon: float | None = None  # None: config.normalization_layer_epsilon
    scale_axis: str | None = "embed"  # logical axis name of the scale vector

    @nn.compact
    def __call__(self, x: jax.Array, update: jax.Array | None = None, *, deferred: bool = False):
        cfg = self.config
        eps = cfg.normalization_layer_epsilon if self.epsilon is None else self.epsilon
        scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, (self.scale_axis,)),
                           (x.shape[-1],), jnp.dtype(cfg.weight_dtype))
        if deferred:
            if update is not None:
                raise ValueError("RMSNorm(deferred=True) takes no update: add it to x first")
            return scale.astype(x.dtype) * x, inverse_rms(x, eps)
        if update is None:
            return rms_norm(x, scale, epsilon=eps, implementation=cfg.norm_kernel)
        if cfg.norm_adds_residual:
            return add_rms_norm(x, update, scale, epsilon=eps, implementation=cfg.norm_kernel)
        summed = residual_add(x, update)  # XLA's add, then the norm's own kernel
        return rms_norm(summed, scale, epsilon=eps, implementation=cfg.norm_kernel), summed
