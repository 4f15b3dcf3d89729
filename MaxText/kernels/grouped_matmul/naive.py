"""The oracle: each sorted row times its own group's weight matrix, gathered per row."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def gather_matmul(rows: jax.Array, weights: jax.Array, row_groups: jax.Array, *, precision=None) -> jax.Array:
    """rows [M, K], weights [E, K, N], row_groups [M] int32 -> [M, N]: row m times weights[row_groups[m]].

    Work M*K*N whatever E, on any backend; it reads one [K, N] matrix per row (a group's matrix once per row of it),
    so it suits CPU and few rows, not long GPU prefills."""
    return jnp.einsum("mk,mkn->mn", rows, jnp.take(weights, row_groups, axis=0), precision=precision)
