"""RMSNorm as in HF `KimiLinearRMSNorm`: normalize in float32, cast back to the input dtype, multiply by `scale`."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from MaxText.kernels.rms_norm import rms_norm


class RMSNorm(nn.Module):
    """y = scale * (x / sqrt(mean(x^2) + eps)), the normalization computed in float32.

    The normalized value is cast to x's dtype before the multiply (HF semantics), so the output has x's dtype
    when `scale` (stored in `weight_dtype`) is cast to it. Param: `scale` [features], initialized to ones. Computed
    by `config.norm_kernel` (MaxText/kernels/rms_norm: a Pallas kernel for a batch-1 decode step's row on a GPU).
    """
    config: ml_collections.FrozenConfigDict
    epsilon: float | None = None  # None: config.normalization_layer_epsilon
    scale_axis: str | None = "embed"  # logical axis name of the scale vector

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        eps = self.config.normalization_layer_epsilon if self.epsilon is None else self.epsilon
        scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, (self.scale_axis,)),
                           (x.shape[-1],), jnp.dtype(self.config.weight_dtype))
        return rms_norm(x, scale, epsilon=eps, implementation=self.config.norm_kernel)
