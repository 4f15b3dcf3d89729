"""Pallas (Triton lowering) chunked KDA prefill forward: two kernels, the math of `chunked.py`.

Tokens are laid out flat, `[Ttot, H, D]`, every sequence starting on a chunk boundary (the wrapper in
`pallas_ops.chunk_kda` pads each sequence to a multiple of C = 64 tokens), so no chunk straddles two sequences.

1. `intra` -- one program per (chunk, head), fully parallel. In registers, per 16-token sub-chunk and 32-channel
   slab: optional l2norm of q and k, optional gate `-exp(A_log) * softplus(g + dt_bias)`, the chunk-local
   cumulative log-decay G (cumsum), and the decayed scores
       A_qk[i, j] = sum_c q_ic k_jc exp(G_ic - G_jc)  (j <= i),   A_kk[i, j] = same with k_i  (j < i).
   Pairs inside a sub-chunk use exact per-channel decays (a [16, 16, 32] block of exponentials); pairs across
   sub-chunks I > J factor through the end of sub-chunk J: (q_i e^{G_i - G_endJ}) . (k_j e^{G_endJ - G_j}),
   both exponents <= 0, so nothing overflows for any gate. It then inverts T = (I + diag(beta) A_kk)^-1 blockwise
   (forward substitution on the 16x16 diagonal blocks, then the off-diagonal blocks) and writes, in bf16,
       w = T (beta k e^G),  u = T (beta v),  qg = scale q e^G,  kg = k e^{G_last - G},  A_qk (scaled q),
   plus G_last (fp32) per chunk.
2. `recurrence` -- one program per (value block of BV columns, head, sequence), serial over the sequence's
   chunks, state S [K, BV] fp32 in registers:
       v_new = u - w S;  o = qg S + A_qk v_new;  S = e^{G_last} S + kg^T v_new
   (with bf16 inputs S enters the tensor-core products as bf16, as in fla-core, accumulating in fp32; with fp32
   inputs every intermediate stays fp32 and the products use 3-pass tf32, about fp32 accuracy).

Both kernels run under `interpret=True` on CPU (the tests do, at small shapes).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from MaxText.kernels.kda.common import L2NORM_EPS, SOFTPLUS_THRESHOLD

CHUNK = 64  # C: tokens per chunk
SUB = 16  # tokens per sub-chunk (exact per-channel decays inside)
NSUB = CHUNK // SUB
SLAB = 32  # key channels per register slab in `intra`
F32, BF16 = jnp.float32, jnp.bfloat16


def _dot(a, b, *, trans_b=False, precise=True, interpret=False):
    """fp32 product; `precise` uses 3-pass tf32 on the GPU (about fp32 accuracy), exact fp32 when interpreting."""
    dims = (((1,), (1 if trans_b else 0,)), ((), ()))
    if not precise:
        return lax.dot_general(a, b, dims, preferred_element_type=F32)
    precision = lax.Precision.HIGHEST if interpret else lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=F32)


def _row(x, r):
    """Row r (traced) of a [n, m] array as a [m] vector, by a masked sum (no register indexing in Triton)."""
    rows = jnp.arange(x.shape[0], dtype=jnp.int32)[:, None]
    return jnp.sum(jnp.where(rows == r, x, 0.0), axis=0)


def _unit_lower_inverse(a):
    """(I + a)^-1 for a strictly lower-triangular [n, n] fp32 `a`, by forward substitution over the rows."""
    n = a.shape[0]
    rows = jnp.arange(n, dtype=jnp.int32)[:, None]
    eye = (rows == jnp.arange(n, dtype=jnp.int32)[None, :]).astype(F32)

    def body(r, x):  # rows < r of x are final; row r becomes e_r - sum_c a[r, c] x[c]
        a_r = _row(a, r)  # [n]
        update = jnp.sum(a_r[:, None] * x, axis=0)  # [n]
        return x - jnp.where(rows == r, update[None, :], 0.0)

    return lax.fori_loop(1, n, body, eye)


def _intra_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, alog_ref, dtb_ref,
                  qg_ref, kg_ref, w_ref, u_ref, aqk_ref, glast_ref, *,
                  head_k, head_v, scale, l2norm, gate, slab, interpret):
    chunk, head = pl.program_id(0), pl.program_id(1)
    t0 = chunk * CHUNK
    K, V = head_k, head_v
    slab = min(slab, K)
    dot = functools.partial(_dot, interpret=interpret)
    sub_rows = [pl.ds(t0 + SUB * i, SUB) for i in range(NSUB)]

    # Per-row factors: l2norm (fp32, eps inside the sqrt) and scale for q; beta.
    q_fac, k_fac, beta = [], [], []
    for rows in sub_rows:
        if l2norm:
            qf = q_ref[rows, head, :].astype(F32)  # [16, K]
            kf = k_ref[rows, head, :].astype(F32)
            q_fac.append(lax.rsqrt(jnp.sum(qf * qf, axis=1) + L2NORM_EPS) * scale)  # [16]
            k_fac.append(lax.rsqrt(jnp.sum(kf * kf, axis=1) + L2NORM_EPS))
        else:
            q_fac.append(jnp.full((SUB,), scale, F32))
            k_fac.append(jnp.ones((SUB,), F32))
        beta.append(beta_ref[rows, head].astype(F32))  # [16]
    decay_rate = jnp.exp(alog_ref[head].astype(F32)) if gate else None
    last_row = jnp.arange(SUB, dtype=jnp.int32)[:, None] == SUB - 1

    def slab_inputs(s):
        """q (scaled), k, G [16, slab] per sub-chunk and G at each sub-chunk's end [slab], for channel slab s."""
        cols = pl.ds(s * slab, slab)
        qs, ks, Gs, ends = [], [], [], []
        carry = jnp.zeros((slab,), F32)
        for i, rows in enumerate(sub_rows):
            qs.append(q_ref[rows, head, cols].astype(F32) * q_fac[i][:, None])
            ks.append(k_ref[rows, head, cols].astype(F32) * k_fac[i][:, None])
            g = g_ref[rows, head, cols].astype(F32)
            if gate:
                x = g + dtb_ref[head, cols].astype(F32)[None, :]
                softplus = jnp.where(x > SOFTPLUS_THRESHOLD, x,
                                     jnp.log1p(jnp.exp(jnp.minimum(x, SOFTPLUS_THRESHOLD))))
                g = -decay_rate * softplus
            G = jnp.cumsum(g, axis=0) + carry[None, :]
            carry = jnp.sum(jnp.where(last_row, G, 0.0), axis=0)
            Gs.append(G)
            ends.append(carry)
        return cols, qs, ks, Gs, ends

    ii = jnp.arange(SUB, dtype=jnp.int32)[:, None, None]
    jj = jnp.arange(SUB, dtype=jnp.int32)[None, :, None]
    on_or_below = ii >= jj  # [16, 16, 1]
    pairs = [(i, j) for i in range(NSUB) for j in range(i)]

    def score_step(s, acc):
        qk_d, kk_d, qk_o, kk_o = acc
        _, qs, ks, Gs, ends = slab_inputs(s)
        qk_d, kk_d = list(qk_d), list(kk_d)
        for i in range(NSUB):
            rel = Gs[i][:, None, :] - Gs[i][None, :, :]  # [16, 16, slab]
            decay = jnp.exp(jnp.where(on_or_below, rel, -jnp.inf))
            k_dec = ks[i][None, :, :] * decay
            qk_d[i] = qk_d[i] + jnp.sum(qs[i][:, None, :] * k_dec, axis=2)
            kk_d[i] = kk_d[i] + jnp.sum(ks[i][:, None, :] * k_dec, axis=2)
        qk_o, kk_o = list(qk_o), list(kk_o)
        rights = [ks[j] * jnp.exp(ends[j][None, :] - Gs[j]) for j in range(NSUB - 1)]  # [16, slab]
        for p, (i, j) in enumerate(pairs):
            left = jnp.exp(Gs[i] - ends[j][None, :])
            qk_o[p] = qk_o[p] + dot(qs[i] * left, rights[j], trans_b=True)
            kk_o[p] = kk_o[p] + dot(ks[i] * left, rights[j], trans_b=True)
        return tuple(qk_d), tuple(kk_d), tuple(qk_o), tuple(kk_o)

    zero = jnp.zeros((SUB, SUB), F32)
    acc = ((zero,) * NSUB, (zero,) * NSUB, (zero,) * len(pairs), (zero,) * len(pairs))
    qk_d, kk_d, qk_o, kk_o = lax.fori_loop(0, K // slab, score_step, acc)

    # A_qk to HBM (bf16), zero above the diagonal.
    for i in range(NSUB):
        for j in range(NSUB):
            block = qk_d[i] if i == j else (qk_o[pairs.index((i, j))] if j < i else zero)
            aqk_ref[head, sub_rows[i], pl.ds(SUB * j, SUB)] = block.astype(aqk_ref.dtype)

    # T = (I + diag(beta) A_kk)^-1, blockwise: T_ii by substitution, T_ij = -T_ii sum_{m=j}^{i-1} A_im T_mj.
    strict = jnp.arange(SUB, dtype=jnp.int32)[:, None] > jnp.arange(SUB, dtype=jnp.int32)[None, :]
    a_blk = {(i, i): beta[i][:, None] * jnp.where(strict, kk_d[i], 0.0) for i in range(NSUB)}
    a_blk.update({(i, j): beta[i][:, None] * kk_o[p] for p, (i, j) in enumerate(pairs)})
    inv = {(i, i): _unit_lower_inverse(a_blk[i, i]) for i in range(NSUB)}
    for gap in range(1, NSUB):
        for j in range(NSUB - gap):
            i = j + gap
            acc_ij = sum(dot(a_blk[i, m], inv[m, j]) for m in range(j, i))
            inv[i, j] = -dot(inv[i, i], acc_ij)

    # w = T (beta k e^G), qg, kg, G_last, per key slab.
    def out_step(s, carry):
        cols, qs, ks, Gs, ends = slab_inputs(s)
        g_last = ends[-1]
        kb = [beta[j][:, None] * ks[j] * jnp.exp(Gs[j]) for j in range(NSUB)]
        for i, rows in enumerate(sub_rows):
            qg_ref[head, rows, cols] = (qs[i] * jnp.exp(Gs[i])).astype(qg_ref.dtype)
            kg_ref[head, rows, cols] = (ks[i] * jnp.exp(g_last[None, :] - Gs[i])).astype(kg_ref.dtype)
            w = sum(dot(inv[i, j], kb[j]) for j in range(i + 1))
            w_ref[head, rows, cols] = w.astype(w_ref.dtype)
        glast_ref[head, chunk, cols] = g_last
        return carry

    lax.fori_loop(0, K // slab, out_step, 0)

    vslab = min(SLAB * 2, V)

    def u_step(s, carry):
        cols = pl.ds(s * vslab, vslab)
        vb = [beta[j][:, None] * v_ref[rows, head, cols].astype(F32) for j, rows in enumerate(sub_rows)]
        for i, rows in enumerate(sub_rows):
            u = sum(dot(inv[i, j], vb[j]) for j in range(i + 1))
            u_ref[head, rows, cols] = u.astype(u_ref.dtype)
        return carry

    lax.fori_loop(0, V // vslab, u_step, 0)


def intra(q, k, v, g, beta, A_log, dt_bias, *, scale, l2norm, gate, num_warps=4, slab=SLAB, interpret=False):
    """Kernel 1. q, k, g: [Ttot, H, K]; v: [Ttot, H, V]; beta: [Ttot, H]; Ttot a multiple of 64.

    Returns qg, kg, w [H, Ttot, K]; u [H, Ttot, V]; A_qk [H, Ttot, 64], all bf16 when q is bf16 (fp32 otherwise:
    the fp32 path keeps fp32 accuracy end to end); and G_last [H, Ttot/64, K] fp32.
    """
    inter = BF16 if q.dtype == BF16 else F32
    total, H, K = q.shape
    V = v.shape[-1]
    n_chunks = total // CHUNK
    A_log = jnp.zeros((H,), F32) if A_log is None else A_log.reshape(H).astype(F32)
    dt_bias = jnp.zeros((H * K,), F32) if dt_bias is None else dt_bias.reshape(H * K).astype(F32)
    kernel = functools.partial(_intra_kernel, head_k=K, head_v=V, scale=scale, l2norm=l2norm, gate=gate,
                               slab=slab, interpret=interpret)

    out_shape = (jax.ShapeDtypeStruct((H, total, K), inter), jax.ShapeDtypeStruct((H, total, K), inter),
                 jax.ShapeDtypeStruct((H, total, K), inter), jax.ShapeDtypeStruct((H, total, V), inter),
                 jax.ShapeDtypeStruct((H, total, CHUNK), inter), jax.ShapeDtypeStruct((H, n_chunks, K), F32))
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(n_chunks, H),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="kda_chunk_intra",
    )(q, k, v, g, beta, A_log, dt_bias.reshape(H, K))


def _recurrence_kernel(qg_ref, kg_ref, w_ref, u_ref, aqk_ref, glast_ref, h0_ref, offsets_ref, o_ref, ht_ref, *,
                       block_v, interpret):
    vblk, head, seq = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    cols = pl.ds(vblk * block_v, block_v)
    first, last = offsets_ref[seq], offsets_ref[seq + 1]
    low = qg_ref.dtype == BF16  # bf16 operands on the tensor cores; else fp32-accurate products

    def mm(a, b, trans_a=False):
        if low:  # bf16 operands, fp32 accumulation
            dims = (((0 if trans_a else 1,), (0,)), ((), ()))
            return lax.dot_general(a, b, dims, preferred_element_type=F32)
        a = a.T if trans_a else a
        return _dot(a, b, interpret=interpret)

    def body(c, state):  # state: [K, BV] fp32
        rows = pl.ds(c * CHUNK, CHUNK)
        s_op = state.astype(qg_ref.dtype)
        v_new = u_ref[head, rows, cols].astype(F32) - mm(w_ref[head, rows, :], s_op)  # [C, BV]
        v_op = v_new.astype(qg_ref.dtype)
        o = mm(qg_ref[head, rows, :], s_op) + mm(aqk_ref[head, rows, :], v_op)  # [C, BV]
        o_ref[rows, head, cols] = o.astype(o_ref.dtype)
        decay = jnp.exp(glast_ref[head, c, :])  # [K]
        return state * decay[:, None] + mm(kg_ref[head, rows, :], v_op, trans_a=True)

    state = lax.fori_loop(first, last, body, h0_ref[seq, head, :, cols])
    ht_ref[seq, head, :, cols] = state


def recurrence(qg, kg, w, u, aqk, g_last, initial_state, chunk_offsets, *, out_dtype, block_v=64, num_warps=4,
               num_stages=2, interpret=False):
    """Kernel 2. Intermediates from `intra`; initial_state [N, H, K, V] fp32; chunk_offsets [N + 1] int32 (the
    first chunk of each sequence). Returns o [Ttot, H, V] in out_dtype and the final states [N, H, K, V] fp32."""
    H, total, K = qg.shape
    V = u.shape[-1]
    n_seq = initial_state.shape[0]
    block_v = min(block_v, V)
    kernel = functools.partial(_recurrence_kernel, block_v=block_v, interpret=interpret)
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((total, H, V), out_dtype),
                   jax.ShapeDtypeStruct((n_seq, H, K, V), F32)),
        grid=(V // block_v, H, n_seq),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="kda_chunk_recurrence",
    )(qg, kg, w, u, aqk, g_last, initial_state, chunk_offsets)
