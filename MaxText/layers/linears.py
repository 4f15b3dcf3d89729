"""Dense projections with logical partitioning, and the SwiGLU MLP (`gate_proj`, `up_proj`, `down_proj`)."""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from MaxText.kernels.grouped_matmul import dense_matmul


def matmul_precision(config: ml_collections.FrozenConfigDict) -> jax.lax.Precision:
    """HIGHEST for float32 activations (no TF32 / bf16 passes on accelerators), DEFAULT otherwise."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(config.dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


def kernel_init(config: ml_collections.FrozenConfigDict):
    """Normal(0, param_init_std) initializer used by every dense kernel of a random-init model."""
    return nn.initializers.normal(stddev=config.param_init_std)


def create_kernel(module: nn.Module, shape: Sequence[int], kernel_axes: Sequence[str | None]) -> jax.Array:
    """Creates `module`'s `kernel` param (weight_dtype) and returns it in config.dtype as [in, out] (`shape`, logical
    axes `kernel_axes`). config.dense_kernel_layout says how the param is stored: in_out as `shape`; out_in as its
    transpose [out, in] (torch's Linear.weight), returned transposed: XLA reads it in place inside its products,
    whose one-row form (batch-1 decode) then streams each output's weights contiguously."""
    config = module.config
    out_in = config.dense_kernel_layout == "out_in"
    stored_shape, stored_axes = tuple(shape), tuple(kernel_axes)
    if out_in:
        stored_shape, stored_axes = stored_shape[::-1], stored_axes[::-1]
    kernel = module.param("kernel", nn.with_logical_partitioning(kernel_init(config), stored_axes), stored_shape,
                          jnp.dtype(config.weight_dtype)).astype(config.dtype)
    return kernel.T if out_in else kernel


class DenseKernel(nn.Module):
    """Holds one `kernel` param of `shape` and returns it in the activation dtype.

    For a projection used in more than one way (MLA's kv_b_proj is applied directly in prefill and absorbed into q
    and o in decode), so that its param is created in exactly one place.
    """
    config: ml_collections.FrozenConfigDict
    shape: Sequence[int]
    kernel_axes: Sequence[str | None]

    @nn.compact
    def __call__(self) -> jax.Array:
        return create_kernel(self, self.shape, self.kernel_axes)


class Dense(nn.Module):
    """y = x @ kernel with kernel [in, features], no bias (stored as config.dense_kernel_layout says: create_kernel).

    x is cast to `config.dtype`, the kernel is stored in `config.weight_dtype`; y has `config.dtype`. The product is
    XLA's, or at decode on one GPU a Pallas kernel (config key `dense_matmul`, MaxText/kernels/grouped_matmul).
    """
    config: ml_collections.FrozenConfigDict
    features: int
    kernel_axes: Sequence[str | None] = ("embed", None)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return project(self.config, x, create_kernel(self, (x.shape[-1], self.features), self.kernel_axes))


def dense_matmul_choice(config: ml_collections.FrozenConfigDict) -> str:
    """The `dense_matmul` implementation the projections ask for: config.dense_matmul, but XLA's product for `auto`
    with kernels stored out_in (the Pallas kernel reads [in, out] kernels: it would get a transposed copy)."""
    if config.dense_kernel_layout == "out_in" and config.dense_matmul == "auto":
        return "xla"
    return config.dense_matmul


def project(config: ml_collections.FrozenConfigDict, x: jax.Array, kernel):
    """x (cast to config.dtype) @ kernel, or a tuple of products for a tuple of kernels, by `dense_matmul_choice`."""
    return dense_matmul(x.astype(config.dtype), kernel, implementation=dense_matmul_choice(config),
                        precision=matmul_precision(config), grid=config.dense_matmul_grid,
                        pad_rows=config.dense_pad_rows,
                        row_reduce_max_elements=config.dense_row_reduce_max_elements)


def scale_rows(y: jax.Array, row_scale: jax.Array | None) -> jax.Array:
    """y [..., N] times row_scale [..., 1] (float32, e.g. a deferred norm's inverse_rms) in y's dtype; y when None."""
    if row_scale is None:
        return y
    return (y.astype(jnp.float32) * row_scale).astype(y.dtype)


def project_together(config: ml_collections.FrozenConfigDict, x: jax.Array, kernels) -> tuple[jax.Array, ...]:
    """x @ each of several same-shape kernels: with `config.fused_projections` one `dense_matmul` call for all (the
    Pallas kernel: one launch), else one call each."""
    if config.fused_projections:
        return project(config, x, tuple(kernels))
    return tuple(project(config, x, kernel) for kernel in kernels)


def dense_together(config: ml_collections.FrozenConfigDict, x: jax.Array, features: int,
                   kernel_axes: Sequence[str | None], names: Sequence[str]) -> tuple[jax.Array, ...]:
    """x @ kernel for several projections of the same x with the same shape, each a `Dense(config, features,
    kernel_axes, name=name)` of the calling (compact) module: the same params (`name/kernel`) and products, by
    `project_together`."""
    kernels = tuple(DenseKernel(config, (x.shape[-1], features), kernel_axes, name=name)() for name in names)
    return project_together(config, x, kernels)


class MLP(nn.Module):
    """SwiGLU: down_proj(silu(gate_proj(x)) * up_proj(x)) on x [..., emb_dim], intermediate size `intermediate_dim`.

    `kernels()` returns the three kernels (for a caller that multiplies them itself: the MoE's shared expert as rows
    of the routed experts' kernels)."""
    config: ml_collections.FrozenConfigDict
    intermediate_dim: int

    def setup(self):
        dim, inner = self.config.emb_dim, self.intermediate_dim
        self.gate_proj = DenseKernel(self.config, (dim, inner), ("embed", "mlp"))
        self.up_proj = DenseKernel(self.config, (dim, inner), ("embed", "mlp"))
        self.down_proj = DenseKernel(self.config, (inner, dim), ("mlp", "embed"))

    def kernels(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(gate_proj [D, I], up_proj [D, I], down_proj [I, D]) in the activation dtype."""
        return self.gate_proj(), self.up_proj(), self.down_proj()

    def __call__(self, x: jax.Array) -> jax.Array:
        gate_kernel, up_kernel, down_kernel = self.kernels()
        gate, up = project_together(self.config, x, (gate_kernel, up_kernel))  # [..., I] each
        return project(self.config, nn.silu(gate) * up, down_kernel)
