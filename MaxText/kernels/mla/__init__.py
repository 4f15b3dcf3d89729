"""MLA's attention in the latent space at decode (config key `mla_kernel`): the absorbed queries against the
latent cache.

    out_latent = latent_attention(q_latent, q_rope, keys, query_positions, key_valid, scale=...,
                                  implementation="auto")
    q_latent [B, T, H, R], q_rope [B, T, H, P], keys [B, S, R + P] (the cache: normalized latent c, then k_rot),
    query_positions [B, T] int32, key_valid [B, S] bool  ->  out_latent [B, T, H, R] in q_latent's dtype

    scores = (q_latent . c + q_rope . k_rot) * scale over the positions s <= the query's with key_valid;
    out_latent = softmax(scores) c (float32 softmax; a query that sees nothing gets zeros).

At batch-1 decode the Pallas path also forms the absorbed query in one launch (`absorb_query`, pallas_absorb.py: q_nope
times each head's W_uk rows of kv_b_proj as stored, and q_rope) where the kernels are stored out_in; else XLA's
einsum.

Implementations:
  xla     naive.latent_attention, the oracle: XLA einsums (at `precision`) and a masked softmax. Any backend; on a
          GPU ~12 kernels per MLA layer and step, and the cache read several times (slices, a pad).
  pallas  pallas_decode.py: one Triton kernel, the cache read once per batch row for all heads, split into runs
          over the cache (flash-decoding) whose online-softmax states XLA combines. NVIDIA GPU, no multi-device
          mesh; R and P powers of two >= 16.
  auto    pallas where it runs, else xla (one log line); the default.
"""

from __future__ import annotations

import jax

from MaxText.kernels.grouped_matmul import pallas_kernel_reason, pallas_or_fallback
from MaxText.kernels.mla.naive import latent_attention as naive_latent_attention

CHOICES = ("auto", "xla", "pallas")


def pallas_unavailable_reason(dtype, rank: int, rope: int, num_keys: int) -> str | None:
    """Why the Pallas MLA decode cannot run here (None when it can)."""
    return pallas_kernel_reason("Pallas MLA decode", "MaxText.kernels.mla.pallas_decode", dtype, rank, rope,
                                num_keys)


def resolve(implementation: str, dtype, rank: int, rope: int, num_keys: int) -> str:
    """Maps an `mla_kernel` value to 'xla' | 'pallas' for these shapes."""
    if implementation not in CHOICES:
        raise ValueError(f"mla_kernel={implementation!r} is unknown; choose one of {CHOICES}")
    if implementation == "xla":
        return "xla"
    return pallas_or_fallback("mla_kernel", implementation, pallas_unavailable_reason(dtype, rank, rope, num_keys),
                              "xla", "auto or xla")


def latent_attention(q_latent: jax.Array, q_rope: jax.Array, keys: jax.Array, query_positions: jax.Array,
                     key_valid: jax.Array, *, scale: float, implementation: str = "auto",
                     precision=None) -> jax.Array:
    """See the module docstring. `precision` applies to xla's einsums."""
    rank = q_latent.shape[-1]
    if resolve(implementation, q_latent.dtype, rank, keys.shape[-1] - rank, keys.shape[1]) == "pallas":
        from MaxText.kernels.mla import pallas_decode  # pylint: disable=import-outside-toplevel
        return pallas_decode.latent_attention(q_latent, q_rope, keys, query_positions, key_valid, scale=scale)
    return naive_latent_attention(q_latent, q_rope, keys, query_positions, key_valid, scale=scale,
                                  precision=precision)


# `absorb_query` for at most this many token rows (B * T): each program reads its head's W_uk slice for one row, so
# W_uk is read once per row; timed on an H200 at batch-1 decode only (benchmarks/RESULTS.md, thirty-eighth session).
# More rows keep XLA's einsum, which reads it once for all of them.
ABSORB_MAX_ROWS = 1


def absorb_in_kernel(implementation: str, dense_kernel_layout: str, nope: int, rope: int, rank: int,
                     rows: int) -> bool:
    """Whether the layer forms the absorbed query of `rows` token rows with `absorb_query`: the resolved
    `implementation` is pallas, the kernels are stored out_in (kv_b_proj's W_uk rows read in place), the kernel takes
    the head sizes and there are at most ABSORB_MAX_ROWS rows."""
    if implementation != "pallas" or dense_kernel_layout != "out_in" or rows > ABSORB_MAX_ROWS:
        return False  # (decided before the import: the Pallas module is only loaded where it may run)
    from MaxText.kernels.mla import pallas_absorb  # pylint: disable=import-outside-toplevel
    return pallas_absorb.unsupported_reason(nope, rope, rank) is None


def absorb_query(q: jax.Array, row_scale: jax.Array | None, kv_b: jax.Array, *, num_heads: int, nope: int,
                 v_dim: int) -> tuple[jax.Array, jax.Array]:
    """q [B, T, H * (nope + P)] before the deferred input norm's row_scale [B, T, 1] (None: no scaling), kv_b_proj's
    kernel as stored [H * (nope + v), R] -> (q_latent [B, T, H, R], q_rope [B, T, H, P]) in q's dtype, in one Pallas
    launch (pallas_absorb.absorb_query)."""
    from MaxText.kernels.mla import pallas_absorb  # pylint: disable=import-outside-toplevel
    batch, num_tokens, width = q.shape
    rows = batch * num_tokens
    q_latent, q_rope = pallas_absorb.absorb_query(
        q.reshape(rows, width), kv_b, None if row_scale is None else row_scale.reshape(rows, 1),
        num_heads=num_heads, nope=nope, v_dim=v_dim)  # [M, H, R], [M, H, P]
    return (q_latent.reshape(batch, num_tokens, num_heads, -1), q_rope.reshape(batch, num_tokens, num_heads, -1))
