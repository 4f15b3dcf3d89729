"""The oracle: each sorted row times its own group's weight matrix, gathered per row."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def silu_glu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """SiLU(gate) * up, the SwiGLU's hidden activation, in the inputs' (float32) precision (`glu`: applied to the
    float32 accumulators inside the kernels, or to the summed K splits' partial products after them)."""
    return gate * up / (1.0 + jnp.exp(-gate))


def token_rows(tokens: jax.Array, rows_per_token: int, extra_rows: bool) -> jax.Array:
    """The product rows that `rows_per_token` stands for: each token's row `rows_per_token` times (token-major, rows
    [T * rows_per_token, K]), then with `extra_rows` every token once more (rows [T * (rows_per_token + 1), K]: an
    MoE's shared-expert rows)."""
    rows = jnp.repeat(tokens, rows_per_token, axis=0)
    return jnp.concatenate([rows, tokens]) if extra_rows else rows


def gather_matmul(rows: jax.Array, weights: jax.Array, row_groups: jax.Array, *, precision=None,
                  weights_out_in: bool = False) -> jax.Array:
    """rows [M, K], weights [E, K, N] ([E, N, K] with weights_out_in), row_groups [M] int32 -> [M, N]: row m times
    weights[row_groups[m]].

    Work M*K*N whatever E, on any backend; it reads one [K, N] matrix per row (a group's matrix once per row of it),
    so it suits CPU and few rows, not long GPU prefills."""
    return jnp.einsum("mk,mnk->mn" if weights_out_in else "mk,mkn->mn", rows, jnp.take(weights, row_groups, axis=0),
                      precision=precision)


def rows_out_in(rows: jax.Array, weights: tuple, row_groups: jax.Array, *, extra_weights: tuple = (),
                rows_per_token: int = 0, glu: bool = False, precision=None) -> tuple:
    """The oracle of `pallas_rows_out_in`: weights stored [E, N, K] (each group's matrix as torch's Linear.weight).
    rows [M, K] (or with rows_per_token [T, K] tokens: row r < T * rows_per_token reads token r // rows_per_token,
    the T rows after them token r - T * rows_per_token), weights: a tuple of [E, N, K] arrays, extra_weights: () or
    one [X, N, K] array per weight array, row_groups [L] int32 (rows from L on are of group E: extra matrix 0) ->
    one [M, N] product per weight array in rows' dtype (glu: the one array SiLU(gate) * up, computed in float32)."""
    if rows_per_token:
        rows = token_rows(rows, rows_per_token, bool(extra_weights))
    num_groups = weights[0].shape[0]
    groups = jnp.concatenate([row_groups, jnp.full((rows.shape[0] - row_groups.shape[0],), num_groups,
                                                   row_groups.dtype)])
    matrices = [jnp.concatenate([w, x]) for w, x in zip(weights, extra_weights)] if extra_weights else weights
    outs = [gather_matmul(rows.astype(jnp.float32), m.astype(jnp.float32), groups, precision=precision,
                          weights_out_in=True) for m in matrices]  # [E (+ X), N, K] each
    if glu:
        return (silu_glu(*outs).astype(rows.dtype),)
    return tuple(out.astype(rows.dtype) for out in outs)
