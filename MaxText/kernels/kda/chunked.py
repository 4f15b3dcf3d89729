"""Chunk-parallel KDA in plain JAX (XLA): the WY representation of the delta rule, one scan step per chunk.

Within a chunk of C tokens, with G the in-chunk cumulative log-decay (G_i = g_1 + ... + g_i, per key channel):
    A_kk[i, j] = beta_i * sum_c k_i[c] k_j[c] exp(G_i[c] - G_j[c])      (j < i)
    A_qk[i, j] =          sum_c q_i[c] k_j[c] exp(G_i[c] - G_j[c])      (j <= i)
    (I + A_kk) [u | w] = [beta v | beta k exp(G)]                        (unit lower-triangular solve)
and across chunks, from the state S at the chunk's start:
    v_new = u - w S;   o = (q exp(G)) S + A_qk v_new;   S = exp(G_C) S + (k exp(G_C - G))^T v_new.

Exactness for very negative gates: no factor exp(G_i) * exp(-G_j) is ever formed (it overflows once the decay
inside a chunk passes ~-88). Pairs inside a 16-token sub-chunk use exp(G_i - G_j) per channel directly; pairs
across sub-chunks go through the first token r of the row's sub-chunk, exp(G_i - G_r) * exp(G_r - G_j), both
exponents <= 0 because j < r <= i and the log-decays are <= 0.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from MaxText.kernels.kda.common import HIGHEST, prepare_inputs, segment_ids_or_zeros

SUB_CHUNK = 16


def _intra_chunk_scores(q, k, G, sub_chunk):
    """A_qk (lower, with diagonal) and K K^T decay scores (strictly lower) for each chunk.

    q, k, G: [..., C, K] float32 -> two [..., C, C] arrays.
    """
    *lead, chunk, head_dim = q.shape
    n_sub = chunk // sub_chunk
    qs, ks, Gs = (x.reshape(*lead, n_sub, sub_chunk, head_dim) for x in (q, k, G))  # [..., n, s, K]

    # Pairs inside one sub-chunk: exact per-channel relative decay.
    rel = Gs[..., :, None, :] - Gs[..., None, :, :]  # [..., n, s(i), s(j), K]
    lower = jnp.tril(jnp.ones((sub_chunk, sub_chunk), bool))
    decay = jnp.exp(jnp.where(lower[..., None], rel, -jnp.inf))
    qk_diag = jnp.einsum("...ic,...jc,...ijc->...ij", qs, ks, decay, precision=HIGHEST)
    kk_diag = jnp.einsum("...ic,...jc,...ijc->...ij", ks, ks, decay, precision=HIGHEST)

    # Pairs across sub-chunks: reference r = first token of the row's sub-chunk.
    G_ref = Gs[..., :, :1, :]  # [..., n, 1, K]
    row_decay = jnp.exp(Gs - G_ref)  # [..., n, s, K], exponents <= 0
    col_before_ref = jnp.arange(chunk)[None, :] < (jnp.arange(n_sub) * sub_chunk)[:, None]  # [n, C]
    col_decay = jnp.exp(jnp.where(col_before_ref[..., None], G_ref - G[..., None, :, :], -jnp.inf))  # [..., n, C, K]
    k_cols = k[..., None, :, :] * col_decay
    qk_off = jnp.einsum("...nic,...njc->...nij", qs * row_decay, k_cols, precision=HIGHEST)  # [..., n, s, C]
    kk_off = jnp.einsum("...nic,...njc->...nij", ks * row_decay, k_cols, precision=HIGHEST)

    eye = jnp.eye(n_sub, dtype=q.dtype)[:, None, :, None]  # places [n, s, s] blocks on the diagonal
    def assemble(off, diag):
        full = off.reshape(*lead, n_sub, sub_chunk, n_sub, sub_chunk) + diag[..., :, :, None, :] * eye
        return full.reshape(*lead, chunk, chunk)

    strict = jnp.tril(jnp.ones((chunk, chunk), bool), -1)
    return assemble(qk_off, qk_diag), jnp.where(strict, assemble(kk_off, kk_diag), 0.0)


def _solve_unit_lower(strict_lower, rhs):
    """Solves (I + N) X = rhs for strictly lower-triangular N [..., C, C] with matmuls only (no LAPACK call, so XLA
    runs and differentiates it on any backend).

    (I + N)^-1 is built by recursive doubling of its diagonal blocks: with the inverses Ta, Tb of two neighbouring
    s x s diagonal blocks, the 2s x 2s block's inverse is [[Ta, 0], [-Tb N_ba Ta, Tb]] -- log2(C) levels of batched
    matmuls, as stable as forward substitution. (The shorter nilpotent product (I - N)(I + N^2)(I + N^4)... is not:
    for near-identical keys N^32 reaches ~1e17 and fp32 cancellation destroys the result.)
    """
    n = strict_lower.shape[-1]
    size = 1 << max(n - 1, 0).bit_length()  # next power of two >= C; zero padding keeps the top-left block
    lead = strict_lower.shape[:-2]
    N = jnp.pad(strict_lower, [(0, 0)] * len(lead) + [(0, size - n), (0, size - n)])
    inverse = jnp.ones(lead + (size, 1, 1), strict_lower.dtype)  # [..., blocks, s, s], s = 1
    s = 1
    while s < size:
        pairs = size // (2 * s)
        blocks = jnp.swapaxes(N.reshape(lead + (size // s, s, size // s, s)), -3, -2)  # [..., row blk, col blk, s, s]
        idx = jnp.arange(pairs)
        below = blocks[..., 2 * idx + 1, 2 * idx, :, :]  # [..., pairs, s, s]: N_ba of each pair
        upper, lower = inverse[..., 0::2, :, :], inverse[..., 1::2, :, :]
        corner = -jnp.einsum("...ij,...jk,...kl->...il", lower, below, upper, precision=HIGHEST)
        inverse = jnp.concatenate([jnp.concatenate([upper, jnp.zeros_like(upper)], axis=-1),
                                   jnp.concatenate([corner, lower], axis=-1)], axis=-2)  # [..., pairs, 2s, 2s]
        s *= 2
    inverse = inverse[..., 0, :n, :n]
    return jnp.einsum("...ij,...jd->...id", inverse, rhs, precision=HIGHEST)


@functools.partial(jax.jit, static_argnames="chunk_size")
def _chunked_forward(q, k, v, g, beta, initial_state, segment_ids, chunk_size):
    """q (pre-scaled), k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]; segment_ids: [B, T] int; float32.

    The state restarts from zero wherever the segment id changes (initial_state feeds each row's first segment).
    Returns (o [B, T, H, V], final state [B, H, K, V]).
    """
    batch, seq_len, num_heads, head_k = q.shape
    head_v = v.shape[-1]
    pad = (-seq_len) % chunk_size
    if pad:  # zero k/v/beta and zero log-decay: padded steps neither decay nor update the state
        q, k, v, g, beta = (jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)) for x in (q, k, v, g, beta))
        segment_ids = jnp.pad(segment_ids, [(0, 0), (0, pad)], mode="edge")
    n_chunks = (seq_len + pad) // chunk_size

    def to_chunks(x):  # [B, T, H, D] -> [N, B, H, C, D]
        x = x.reshape(batch, n_chunks, chunk_size, num_heads, -1)
        return jnp.transpose(x, (1, 0, 3, 2, 4))

    q, k, v, g = (to_chunks(x) for x in (q, k, v, g))
    beta = to_chunks(beta[..., None])  # [N, B, H, C, 1]
    seg = jnp.transpose(segment_ids.reshape(batch, n_chunks, 1, chunk_size, 1), (1, 0, 2, 3, 4))  # [N, B, 1, C, 1]
    seg_prev = jnp.concatenate([seg[:1, ..., :1, :], seg[:-1, ..., -1:, :]], axis=0)  # [N, B, 1, 1, 1]
    same_segment = seg == jnp.swapaxes(seg, -1, -2)  # [N, B, 1, C, C]
    continues = (seg == seg_prev).astype(jnp.float32)  # [N, B, 1, C, 1]: token sees the incoming state
    in_last = (seg == seg[..., -1:, :]).astype(jnp.float32)  # [N, B, 1, C, 1]: token reaches the outgoing state

    G = jnp.cumsum(g, axis=-2)  # [N, B, H, C, K]
    sub_chunk = min(SUB_CHUNK, chunk_size)
    # [N*B, H, C, K] in, [N, B, H, C, C] out: a leading axis of size 1 (one chunk) crashed XLA:CPU's gradient here
    scores = _intra_chunk_scores(*(x.reshape(-1, *x.shape[2:]) for x in (q, k, G)), sub_chunk)
    A_qk, A_kk = (jnp.where(same_segment, a.reshape(q.shape[:-1] + (chunk_size,)), 0.0) for a in scores)
    rhs = jnp.concatenate([beta * v, beta * k * jnp.exp(G)], axis=-1)  # [N, B, H, C, V + K]
    uw = _solve_unit_lower(beta * A_kk, rhs)
    u, w = uw[..., :head_v], continues * uw[..., head_v:]

    def step(state, xs):  # state: [B, H, K, V]
        q_c, k_c, G_c, u_c, w_c, A_qk_c, continues_c, in_last_c = xs
        v_new = u_c - jnp.einsum("bhck,bhkv->bhcv", w_c, state, precision=HIGHEST)
        o_c = (jnp.einsum("bhck,bhkv->bhcv", continues_c * q_c * jnp.exp(G_c), state, precision=HIGHEST)
               + jnp.einsum("bhij,bhjv->bhiv", A_qk_c, v_new, precision=HIGHEST))
        G_last = G_c[..., -1:, :]  # [B, H, 1, K]
        carried = continues_c[..., -1:, :] * jnp.exp(G_last)[..., 0, :, None]  # [B, H, K, 1]
        state = (state * carried
                 + jnp.einsum("bhck,bhcv->bhkv", in_last_c * k_c * jnp.exp(G_last - G_c), v_new, precision=HIGHEST))
        return state, o_c

    xs = (q, k, G, u, w, A_qk, continues, in_last)
    final_state, o = jax.lax.scan(step, initial_state, xs)  # o: [N, B, H, C, V]
    o = jnp.transpose(o, (1, 0, 3, 2, 4)).reshape(batch, n_chunks * chunk_size, num_heads, head_v)
    return o[:, :seq_len], final_state


def _unpack_index(cu_seqlens):
    """Host-side gather plan for a pack: token index per (sequence, step), validity, and the inverse map."""
    cu = np.asarray(cu_seqlens, np.int64)
    lengths = np.diff(cu)
    max_len = max(int(lengths.max()), 1)
    steps = np.arange(max_len)
    valid = steps[None, :] < lengths[:, None]  # [N, L]
    gather = np.where(valid, cu[:-1, None] + steps[None, :], 0)  # [N, L]
    seq_ids = np.repeat(np.arange(len(lengths)), lengths)
    inverse = seq_ids * max_len + (np.arange(cu[-1]) - cu[seq_ids])  # packed token -> flat [N * L] index
    return gather, valid, inverse


def chunked_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None,
                cu_seqlens=None, chunk_size=64, segment_ids=None):
    """fla-style chunked KDA; returns (o [B, T, H, V] in q's dtype, final state [N, H, K, V] float32 or None).

    `cu_seqlens` must be concrete (a host array), as fla prepares its chunk indices on the host too.
    `segment_ids` [B, T] (our extension, for packed training rows; traceable): the state restarts from zero where
    the id changes along T.
    """
    if chunk_size < 1 or (chunk_size > SUB_CHUNK and chunk_size % SUB_CHUNK):
        raise ValueError(f"chunk_size={chunk_size}: must be a multiple of {SUB_CHUNK}, or a positive value below it")
    if cu_seqlens is not None and isinstance(cu_seqlens, jax.core.Tracer):
        raise ValueError("chunked_kda needs cu_seqlens as a concrete array (it plans the pack on the host); got a "
                         "traced value -- pass it as a static numpy array, or use the naive implementation")
    x = prepare_inputs(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                       use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                       A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu_seqlens, segment_ids=segment_ids)
    if cu_seqlens is None:
        o, final_state = _chunked_forward(*x, segment_ids_or_zeros(segment_ids, x.q.shape[:2]), chunk_size)
    else:
        gather, valid, inverse = _unpack_index(cu_seqlens)
        mask = jnp.asarray(valid)

        def unpack(t, fill_mask):  # [1, T, H, D] -> [N, L, H, D], zero outside each sequence
            out = t[0][gather]
            return jnp.where(fill_mask.reshape(fill_mask.shape + (1,) * (out.ndim - 2)), out, 0.0)

        q_, k_, v_, g_, beta_ = (unpack(t, mask) for t in (x.q, x.k, x.v, x.g, x.beta))
        o, final_state = _chunked_forward(q_, k_, v_, g_, beta_, x.initial_state,
                                          jnp.zeros(gather.shape, jnp.int32), chunk_size)
        o = o.reshape(-1, *o.shape[2:])[jnp.asarray(inverse)][None]
    return o.astype(q.dtype), (final_state if output_final_state else None)
