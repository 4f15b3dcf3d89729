"""Pallas (Triton lowering) chunked KDA prefill forward: six kernels, the math of `chunked.py`.

Tokens are laid out flat, `[Ttot, H, D]`, every sequence starting on a chunk boundary (the wrapper in
`pallas_ops.chunk_kda` pads each sequence to a multiple of C = 64 tokens), so no chunk straddles two sequences.
Inside a chunk, with the chunk-local cumulative log-decay G (per channel, <= 0, decreasing):
    A_qk[i, j] = sum_c q_ic k_jc exp(G_ic - G_jc)  (j <= i),   A_kk[i, j] = same with k_i  (j < i).

1. `prepare` -- per (chunk, head): l2norm of q and k (optional), the gate `-exp(A_log) * softplus(g + dt_bias)`
   (optional) and G = cumsum over the chunk. Writes qn, kn (input dtype) and G (fp32), token-major.
2. `diag` -- token-parallel, per (token t, block of heads): the 16x16 diagonal blocks of A_qk / A_kk (pairs inside
   one 16-token sub-chunk), with exact per-channel decays e^{G_t - G_j} <= 1. One short program per token keeps
   the GPU full (a per-chunk loop over the 16 columns was latency bound: 4-8 ms at B=8, T=4096).
3. `scores` -- two programs per (chunk, head), rows {0, 1, 2} and {3}: pairs across sub-chunks I > J as
   tensor-core products accumulated over 16-channel blocks (a 3-stage pipelined loop), each sub-chunk's operands
   computed once per block,
   factored through the sub-chunk boundaries so that every exponent is <= 0 (nothing overflows for any gate);
   writes A_qk (scaled q) and the blocks j <= i of A_kk (fp32), the diagonal ones from `diag` (A_qk's masked above
   the diagonal; computing them here instead, one key column at a time, took 11.4 ms at B=8, T=4096 on an H200 vs
   1.0 + 1.5 ms).
4. `wy_inverse` -- per (chunk, head): T = (I + diag(beta) A_kk)^-1 (stored in q's dtype), built blockwise: the
   diagonal blocks by block size doubling (four steps of two tensor-core products), then the off-diagonal blocks.
   (Scores and inverse in one program per (chunk, head) took 3.5 ms at B=8, T=4096 on an H200, 4.1 ms with a
   parallel inverse of the diagonal blocks, and 2.1 ms accumulating all six off-diagonal pairs over 32-channel
   blocks as fla-core does (5.3 ms with 4 warps), vs 1.5 + 0.4 ms as two kernels: benchmarks/RESULTS.md.)
5. `wu` -- per (chunk, head), looping over blocks of 64 key / value columns: w = T (beta k e^G), u = T (beta v)
   ([64, 64] x [64, 64] products, bf16 operands with bf16 inputs as in fla-core), qg = scale q e^G,
   kg = k e^{G_last - G}, and G_last (fp32).
6. `recurrence` -- one program per (value block of BV columns, head, sequence), serial over the sequence's
   chunks, state S [K, BV] fp32 in registers:
       v_new = u - w S;  o = qg S + A_qk v_new;  S = e^{G_last} S + kg^T v_new
   (with bf16 inputs S enters the tensor-core products as bf16, as in fla-core, accumulating in fp32; with fp32
   inputs every intermediate stays fp32 and the products use 3-pass tf32, about fp32 accuracy).

Exponentials go through `pallas_exp.exp` (exp2 with a multiply: one MUFU.EX2 and one FMUL per element where
`jnp.exp` lowers to libdevice's ~9-instruction `__nv_expf`). With `base2` (the default for bf16 inputs) `prepare`
stores G in base 2, log2(e) G, and every decay is one exp2 of a difference, without the multiply (fla-core keeps
its cumulative gates in base 2 too); every kernel takes `base2` (default: its inputs are bf16), and they must
agree. fp32 inputs keep the natural G: scaling a large |G| costs |G| x 6e-8 of absolute error in every exponent
(an fp32 interpret test's final state moved from within 1e-5 to 1.8e-5 of the oracle), far below bf16's rounding.
Timed on an H200 (B=8, T=4096, bf16): scores 0.674 vs 0.711 ms, diag 0.892 vs 0.911, wu even. All run under
`interpret=True` on CPU (the tests do, at small shapes). Per-kernel times and the open gap to fla-core:
benchmarks/RESULTS.md (`python benchmarks/kda_kernels.py --tune`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from MaxText.kernels import pallas_exp
from MaxText.kernels.kda.common import L2NORM_EPS, thresholded_softplus
from MaxText.kernels.pallas_dot import dot as _dot

CHUNK = 64  # C: tokens per chunk
SUB = 16  # tokens per sub-chunk (exact per-channel decays inside)
NSUB = CHUNK // SUB
WU_BLOCK = 64  # key / value columns per `wu` program (fewer when K or V is smaller)
FEW_PROGRAMS = 128  # `recurrence` narrows its value blocks below this many programs (about an H200's 132 SMs)
F32, BF16 = jnp.float32, jnp.bfloat16


def _params(num_warps, num_stages=1):
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _reversed_grid(grid):
    """The launch grid and the kernel's program ids in `grid`'s order, reversed so that the last axis varies
    fastest: Pallas's Triton lowering makes grid axis 0 CUDA's x, whose blocks launch first, so the programs that
    share inputs (the sub-chunks of one (chunk, head)) run together and find them in L2."""
    return grid[::-1], lambda: tuple(pl.program_id(axis) for axis in range(len(grid)))[::-1]


def _exp_of_G(base2):
    """e^x for x a difference of G's as the kernels store them: exp2 when G is in base 2."""
    return jnp.exp2 if base2 else pallas_exp.exp


def _base2(base2, dtype):
    """A kernel's `base2`: as given, or by default whether its inputs are bf16."""
    return dtype == BF16 if base2 is None else base2


def _prepare_kernel(q_ref, k_ref, g_ref, alog_ref, dtb_ref, qn_ref, kn_ref, G_ref, *, l2norm, gate, base2):
    chunk, head = pl.program_id(0), pl.program_id(1)
    rows = pl.ds(chunk * CHUNK, CHUNK)
    for src, dst in ((q_ref, qn_ref), (k_ref, kn_ref)):
        x = src[rows, head, :].astype(F32)  # [C, K]
        if l2norm:
            x = x * lax.rsqrt(jnp.sum(x * x, axis=1) + L2NORM_EPS)[:, None]
        dst[rows, head, :] = x.astype(dst.dtype)
    g = g_ref[rows, head, :].astype(F32)
    if gate:
        g = -jnp.exp(alog_ref[head].astype(F32)) * thresholded_softplus(g + dtb_ref[pl.ds(head, 1), :].astype(F32))
    G_ref[rows, head, :] = jnp.cumsum(g, axis=0) * (pallas_exp.LOG2E if base2 else 1.0)


def prepare(q, k, g, A_log, dt_bias, *, l2norm, gate, num_warps=4, base2=None, interpret=False):
    """Kernel 1, one program per (chunk, head). q, k, g: [Ttot, H, K]. Returns qn, kn [Ttot, H, K] (l2-normed when
    `l2norm`, in q's dtype) and G [Ttot, H, K] fp32, the chunk-local cumulative log-decay (gate applied when `gate`),
    in base 2 (log2(e) G) when `base2` (default: q is bf16)."""
    total, H, K = q.shape
    A_log = jnp.zeros((H,), F32) if A_log is None else A_log.reshape(H).astype(F32)
    dt_bias = jnp.zeros((H, K), F32) if dt_bias is None else dt_bias.reshape(H, K).astype(F32)
    return pl.pallas_call(
        functools.partial(_prepare_kernel, l2norm=l2norm, gate=gate, base2=_base2(base2, q.dtype)),
        out_shape=(jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct(q.shape, F32)),
        grid=(total // CHUNK, H),
        compiler_params=_params(num_warps),
        interpret=interpret,
        name="kda_chunk_prepare",
    )(q, k, g, A_log, dt_bias)


def _diag_kernel(qn_ref, kn_ref, G_ref, aqk_ref, akk_ref, *, heads_per_program, scale, base2):
    t, head_block = pl.program_id(0), pl.program_id(1)
    heads = pl.ds(head_block * heads_per_program, heads_per_program)
    first = t - t % SUB  # first token of t's sub-chunk
    q_t = qn_ref[t, heads, :].astype(F32)  # [BH, K]
    k_t = kn_ref[t, heads, :].astype(F32)
    G_t = G_ref[t, heads, :]

    def score(j, carry):  # key token j <= t of the same sub-chunk: exact per-channel decay e^{G_t - G_j} <= 1
        k_dec = kn_ref[j, heads, :].astype(F32) * _exp_of_G(base2)(G_t - G_ref[j, heads, :])  # [BH, K]
        aqk_ref[heads, t, j - first] = jnp.sum(q_t * k_dec, axis=1) * scale  # [BH]
        akk_ref[heads, t, j - first] = jnp.sum(k_t * k_dec, axis=1)  # at j = t too: `scores` keeps j < t only
        return carry

    lax.fori_loop(first, t + 1, score, 0)  # the entries j > t stay unset: `scores` masks them


def diag(qn, kn, G, *, scale, heads_per_program=4, num_warps=1, base2=None, interpret=False):
    """Kernel 2, token-parallel: one program per (token t, block of heads). Returns the diagonal 16x16 blocks
    aqk_d[h, t, s] = scale sum_c q_tc k_jc e^{G_tc - G_jc} and akk_d (same with k_t) for the key j = (first token of
    t's sub-chunk) + s <= t, both [H, Ttot, 16] fp32; the entries j > t are unset (and akk_d's j = t is not zero):
    `scores` keeps j <= t of aqk_d and j < t of akk_d."""
    total, H, _ = qn.shape
    while H % heads_per_program:
        heads_per_program //= 2
    out = jax.ShapeDtypeStruct((H, total, SUB), F32)
    return pl.pallas_call(
        functools.partial(_diag_kernel, heads_per_program=heads_per_program, scale=scale,
                          base2=_base2(base2, qn.dtype)),
        out_shape=(out, out),
        grid=(total, H // heads_per_program),
        compiler_params=_params(num_warps),
        interpret=interpret,
        name="kda_chunk_diag",
    )(qn, kn, G)


def _pair_blocks(q_loc, k_loc, between, kr, dot, scale):
    """The [16, 16] blocks of A_qk (scaled) and A_kk for sub-chunks i > j, every exponent <= 0:
    (q_i e^{G_i - end_{i-1}} e^{end_{i-1} - end_j}) . (k_j e^{end_j - G_j}); q_loc, k_loc = q_i, k_i e^{G_i -
    end_{i-1}} [16, K]; between = e^{end_{i-1} - end_j} [1, K]; kr = k_j e^{end_j - G_j} [16, K]."""
    return dot(q_loc * between, kr, trans_b=True) * scale, dot(k_loc * between, kr, trans_b=True)


def _unit_lower_inverse(n, dot):
    """(I + n)^-1 of a strictly lower-triangular [16, 16] n, by block size doubling: with B the inverses of the
    diagonal blocks of size s (B = I for s = 1) and C the entries of n in the lower-left quarter of each diagonal
    block of size 2s, B - B C B inverts the blocks of size 2s ([[A, 0], [C, D]]^-1 = [[A^-1, 0], [-D^-1 C A^-1,
    D^-1]]). Eight tensor-core products instead of a 15-step serial forward substitution, and, unlike the Neumann
    product (I - n)(I + n^2)(I + n^4)(I + n^8), no intermediate larger than the inverse (n close to all-ones below
    the diagonal has n^8 entries ~ 3400: 5e-4 error in fp32)."""
    row, col = jnp.arange(SUB, dtype=jnp.int32)[:, None], jnp.arange(SUB, dtype=jnp.int32)[None, :]
    inverse = (row == col).astype(F32)
    size = 1
    while size < SUB:
        lower_left = (row // (2 * size) == col // (2 * size)) & (row // size > col // size)
        inverse = inverse - dot(dot(inverse, jnp.where(lower_left, n, 0.0)), inverse)
        size *= 2
    return inverse


def _row_operands(qn_ref, kn_ref, G_ref, head, t0, i, cols, exp):
    """Sub-chunk i's rows over the key channels `cols`: q_i and k_i times e^{G_i - end_{i-1}} (fp32, [16, BK]) and
    end_{i-1} [1, BK], G at the end of sub-chunk i - 1."""
    rows = pl.ds(t0 + SUB * i, SUB)
    end_prev = G_ref[pl.ds(t0 + SUB * i - 1, 1), head, cols]
    local = exp(G_ref[rows, head, cols] - end_prev)
    return qn_ref[rows, head, cols].astype(F32) * local, kn_ref[rows, head, cols].astype(F32) * local, end_prev


def _key_operand(kn_ref, G_ref, head, t0, j, cols, exp):
    """Key sub-chunk j over the key channels `cols`: k_j e^{end_j - G_j} (fp32, [16, BK]) and end_j [1, BK], G at
    the end of sub-chunk j."""
    key_rows = pl.ds(t0 + SUB * j, SUB)
    end_j = G_ref[pl.ds(t0 + SUB * j + SUB - 1, 1), head, cols]
    return kn_ref[key_rows, head, cols].astype(F32) * exp(end_j - G_ref[key_rows, head, cols]), end_j


def _store_score_rows(aqkd_ref, akkd_ref, aqk_ref, akk_ref, head, rows, i, pairs, scale):
    """Row sub-chunk i's [16, 64] of A_qk and A_kk: the pair blocks `pairs[j]` = (A_qk unscaled, A_kk) for j < i, the
    diagonal block from `diag` (A_qk's entries above the diagonal masked: `diag` leaves them unset; A_kk's stored as
    is: `wy_inverse` reads only its strictly lower part) and zeros in A_qk above."""
    row, col = jnp.arange(SUB, dtype=jnp.int32)[:, None], jnp.arange(SUB, dtype=jnp.int32)[None, :]
    for j in range(NSUB):
        block = pl.ds(SUB * j, SUB)
        if j < i:
            aqk_ref[head, rows, block] = (pairs[j][0] * scale).astype(aqk_ref.dtype)
            akk_ref[head, rows, block] = pairs[j][1]
        elif j == i:
            aqk_ref[head, rows, block] = jnp.where(col <= row, aqkd_ref[head, rows, :], 0.0).astype(aqk_ref.dtype)
            akk_ref[head, rows, block] = akkd_ref[head, rows, :]
        else:
            aqk_ref[head, rows, block] = jnp.zeros((SUB, SUB), aqk_ref.dtype)


def _score_rows(qn_ref, kn_ref, G_ref, head, t0, row_subchunks, *, block_k, dot, exp):
    """The pair blocks (A_qk unscaled, A_kk) [16, 16] fp32 of the rows `row_subchunks` against every key sub-chunk
    j < i, accumulated over blocks of block_k channels; each sub-chunk's operands (and their exponentials) computed
    once per channel block. Returns {(i, j): (A_qk, A_kk)}."""
    pairs = [(i, j) for i in row_subchunks for j in range(i)]
    if not pairs:
        return {}
    key_subchunks = sorted({j for _, j in pairs})

    def accumulate(kb, acc):
        cols = pl.ds(kb * block_k, block_k)
        keys = {j: _key_operand(kn_ref, G_ref, head, t0, j, cols, exp) for j in key_subchunks}  # (kr_j, end_j)
        out = list(acc)
        for i in sorted({i for i, _ in pairs}):
            q_loc, k_loc, end_prev = _row_operands(qn_ref, kn_ref, G_ref, head, t0, i, cols, exp)
            for j in range(i):
                n = pairs.index((i, j))
                part = _pair_blocks(q_loc, k_loc, exp(end_prev - keys[j][1]), keys[j][0], dot, 1.0)
                out[n] = (acc[n][0] + part[0], acc[n][1] + part[1])
        return tuple(out)

    zero = jnp.zeros((SUB, SUB), F32)
    acc = lax.fori_loop(0, qn_ref.shape[-1] // block_k, accumulate, tuple((zero, zero) for _ in pairs))
    return dict(zip(pairs, acc))


def _scores_kernel(qn_ref, kn_ref, G_ref, aqkd_ref, akkd_ref, aqk_ref, akk_ref, *, program_ids, row_groups, scale,
                   block_k, precise, base2, interpret):
    chunk, head, group = program_ids()
    t0 = chunk * CHUNK
    dot = functools.partial(_dot, precise=precise, interpret=interpret)
    for g, row_subchunks in enumerate(row_groups):
        @pl.when(group == g)
        def _rows():
            pairs = _score_rows(qn_ref, kn_ref, G_ref, head, t0, row_subchunks, block_k=block_k, dot=dot,
                                exp=_exp_of_G(base2))
            for i in row_subchunks:
                _store_score_rows(aqkd_ref, akkd_ref, aqk_ref, akk_ref, head, pl.ds(t0 + SUB * i, SUB), i,
                                  {j: pairs[i, j] for j in range(i)}, scale)


def _inverse_kernel(akk_ref, beta_ref, inverse_ref, *, precise, interpret):
    """T = (I + diag(beta) A_kk)^-1 of one chunk from the [16, 16] blocks of A_kk: the diagonal ones with
    fp32-accurate products (`_unit_lower_inverse` of beta_i A_ii), then T_ij = -T_ii sum_{m=j}^{i-1} (beta_i A_im)
    T_mj; zeros above the diagonal."""
    chunk, head = pl.program_id(0), pl.program_id(1)
    t0 = chunk * CHUNK
    dot = functools.partial(_dot, precise=precise, interpret=interpret)
    exact = functools.partial(_dot, precise=True, interpret=interpret)
    sub_rows = [pl.ds(t0 + SUB * i, SUB) for i in range(NSUB)]
    beta = [beta_ref[rows, head].astype(F32)[:, None] for rows in sub_rows]  # [16, 1]
    inv = {(i, i): _unit_lower_inverse(beta[i] * akk_ref[head, rows, pl.ds(SUB * i, SUB)], exact)
           for i, rows in enumerate(sub_rows)}
    for gap in range(1, NSUB):
        for j in range(NSUB - gap):
            i = j + gap
            inv[i, j] = -dot(inv[i, i], sum(dot(beta[i] * akk_ref[head, sub_rows[i], pl.ds(SUB * m, SUB)], inv[m, j])
                                            for m in range(j, i)))
    zero = jnp.zeros((SUB, SUB), F32)
    for i, rows in enumerate(sub_rows):
        for j in range(NSUB):
            inverse_ref[head, rows, pl.ds(SUB * j, SUB)] = (inv[i, j] if j <= i else zero).astype(inverse_ref.dtype)


SCORE_ROW_GROUPS = {  # `scores` programs per (chunk, head): the row sub-chunks each one computes
    "chunk": ((0, 1, 2, 3),),  # all six pairs in one program
    "halves": ((0, 1, 2), (3,)),  # three pairs each
    "rows": ((0,), (1,), (2,), (3,)),  # one program per row sub-chunk
}


def scores(qn, kn, G, diag_blocks, *, scale, num_warps=1, block_k=16, programs="halves", num_stages=3, base2=None,
           interpret=False):
    """Kernel 3: the [16, 16] score blocks of row sub-chunks i against key sub-chunks j < i (`_pair_blocks`,
    tensor-core products in tf32 with bf16 inputs, 3-pass tf32 with fp32, accumulated over blocks of block_k key
    channels, each sub-chunk's operands computed once per channel block) and the diagonal blocks from `diag_blocks`
    = `diag`'s (aqk_d, akk_d). programs: how the four row sub-chunks of a (chunk, head) split into programs
    (SCORE_ROW_GROUPS); a (chunk, head)'s programs, which read the same key sub-chunks, launch one after another
    (`_reversed_grid`).
    Returns A_qk [H, Ttot, 64] (scaled q, in qn's dtype; zero above the diagonal) and A_kk [H, Ttot, 64] fp32
    (blocks j < i and the strictly lower part of the diagonal blocks; the rest unset).
    num_stages: software pipelining of the channel-block loop (Triton prefetches the next block's operands while
    this one multiplies). H200, B=8, T=4096 (benchmarks/RESULTS.md): "halves" at 16 channels 0.711 ms with 3 stages
    (0.712 in another run), 0.770 with 4, 0.806 with 2, 1.050-1.088 with 1 (Nsight Compute, unpipelined: every
    layout waited on its loads, long-scoreboard stalls 60-73% of the cycles); "halves" at 32 channels 1.047 (3
    stages); "chunk" at 16 channels 0.755-0.764 (3-4 stages); "rows" 1.231 (2 stages); 2 warps replicate the 16 x 16
    tiles (1.72 ms unpipelined). Scores and `wy_inverse` in one program per (chunk, head), A_kk kept in registers:
    1.67 ms (108 bytes of spills) vs 0.71 + 0.33 as two kernels."""
    total, H, K = qn.shape
    block_k = min(block_k, K)
    if block_k < 16 or K % block_k:
        raise ValueError(f"block_k={block_k} must divide the key head dim K={K} and be >= 16")
    if programs not in SCORE_ROW_GROUPS:
        raise ValueError(f"programs={programs!r}: expected one of {sorted(SCORE_ROW_GROUPS)}")
    row_groups = SCORE_ROW_GROUPS[programs]
    grid, program_ids = _reversed_grid((total // CHUNK, H, len(row_groups)))
    kernel = functools.partial(_scores_kernel, program_ids=program_ids, row_groups=row_groups, scale=scale,
                               block_k=block_k, precise=qn.dtype == F32, base2=_base2(base2, qn.dtype),
                               interpret=interpret)
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((H, total, CHUNK), qn.dtype), jax.ShapeDtypeStruct((H, total, CHUNK), F32)),
        grid=grid, compiler_params=_params(num_warps, num_stages), interpret=interpret,
        name="kda_chunk_scores")(qn, kn, G, *diag_blocks)


def wy_inverse(akk, beta, *, dtype, num_warps=1, interpret=False):
    """Kernel 4, one program per (chunk, head): T = (I + diag(beta) A_kk)^-1 [H, Ttot, 64] (row t of its chunk's
    64 x 64 lower-triangular block), from the strictly lower part of `scores`' A_kk (nothing else is read).
    dtype: the q/k/v dtype; T is stored in it (`wu` multiplies bf16 inputs with bf16 operands) and with float32
    every product is fp32-accurate. H200, B=8, T=4096: 0.32 ms (0.61 storing fp32 T)."""
    H, total, _ = akk.shape
    return pl.pallas_call(
        functools.partial(_inverse_kernel, precise=dtype == F32, interpret=interpret),
        out_shape=jax.ShapeDtypeStruct((H, total, CHUNK), dtype), grid=(total // CHUNK, H),
        compiler_params=_params(num_warps), interpret=interpret, name="kda_chunk_inverse")(akk, beta)


def _wu_columns(refs, inverse, beta, chunk, head, block, *, head_k, head_v, block_cols, scale, dot, exp):
    """One block of `block_cols` key / value columns of `wu` for one (chunk, head): inverse [C, C] and beta [C, 1]
    loaded by the caller."""
    qn_ref, kn_ref, G_ref, v_ref, qg_ref, kg_ref, w_ref, u_ref, glast_ref = refs
    rows, cols = pl.ds(chunk * CHUNK, CHUNK), pl.ds(block * block_cols, block_cols)

    @pl.when(block < head_k // block_cols)
    def _key_columns():
        G = G_ref[rows, head, cols]  # [C, BW]
        g_last = G_ref[pl.ds(chunk * CHUNK + CHUNK - 1, 1), head, cols]  # [1, BW]
        glast_ref[head, pl.ds(chunk, 1), cols] = g_last
        e_G = exp(G)
        qg_ref[head, rows, cols] = (qn_ref[rows, head, cols].astype(F32) * e_G * scale).astype(qg_ref.dtype)
        k = kn_ref[rows, head, cols].astype(F32)
        kg_ref[head, rows, cols] = (k * exp(g_last - G)).astype(kg_ref.dtype)
        w_ref[head, rows, cols] = dot(inverse, (beta * k * e_G).astype(inverse.dtype)).astype(w_ref.dtype)

    @pl.when(block < head_v // block_cols)
    def _value_columns():
        v = (beta * v_ref[rows, head, cols].astype(F32)).astype(inverse.dtype)
        u_ref[head, rows, cols] = dot(inverse, v).astype(u_ref.dtype)


def _wu_kernel(qn_ref, kn_ref, G_ref, v_ref, beta_ref, inverse_ref, qg_ref, kg_ref, w_ref, u_ref, glast_ref, *,
               num_blocks, precise, base2, interpret, **columns):
    chunk, head = pl.program_id(0), pl.program_id(1)
    rows = pl.ds(chunk * CHUNK, CHUNK)
    dot = functools.partial(_dot, precise=precise, interpret=interpret)
    beta = beta_ref[rows, head].astype(F32)[:, None]  # [C, 1]
    inverse = inverse_ref[head, rows, :]  # [C, C], in the products' operand dtype
    refs = (qn_ref, kn_ref, G_ref, v_ref, qg_ref, kg_ref, w_ref, u_ref, glast_ref)

    def one_block(block, carry):
        _wu_columns(refs, inverse, beta, chunk, head, block, dot=dot, exp=_exp_of_G(base2), **columns)
        return carry

    lax.fori_loop(0, num_blocks, one_block, 0)


def wu(qn, kn, G, v, beta, inverse, *, scale, num_warps=None, num_stages=2, base2=None, interpret=False):
    """Kernel 5, one program per (chunk, head), reading T once and looping over blocks of WU_BLOCK key / value
    columns (pipelined over num_stages, as fla-core's recompute_w_u): w = T (beta k e^G), u = T (beta v) ([64, 64]
    x [64, WU_BLOCK] products with T's dtype as operands: bf16 with bf16 inputs, as in fla-core; fp32-accurate with
    fp32), qg = scale q e^G, kg = k e^{G_last - G}. Column blocks keep fp32 tiles within shared memory (whole
    [64, 128] fp32 tiles asked for 360 KB of an H200's 227 KB). num_warps defaults to 8 with bf16 inputs, 4 with
    fp32. H200, B=8, T=4096 (benchmarks/RESULTS.md): 0.726-0.729 ms at 8 warps vs 0.750 at 4 in two runs (3 stages
    no faster); an fp32 T (tf32 products) 1.05 at 4 warps, 1.51 at 8; a program per column block with tf32 products
    1.15.
    base2: G (and the returned G_last) in base 2, as `prepare` writes it (default: qn is bf16).
    Returns qg, kg, w [H, Ttot, K]; u [H, Ttot, V] (in qn's dtype) and G_last [H, Ttot/64, K] fp32."""
    total, H, K = qn.shape
    V = v.shape[-1]
    dtype = qn.dtype
    if num_warps is None:
        num_warps = 8 if dtype == BF16 else 4
    block_cols = min(WU_BLOCK, K, V)  # K, V in SUPPORTED_HEAD_DIMS (powers of two): it divides both
    kernel = functools.partial(_wu_kernel, num_blocks=max(K, V) // block_cols, precise=dtype == F32,
                               base2=_base2(base2, dtype), interpret=interpret, head_k=K, head_v=V,
                               block_cols=block_cols, scale=scale)
    out_shape = (jax.ShapeDtypeStruct((H, total, K), dtype), jax.ShapeDtypeStruct((H, total, K), dtype),
                 jax.ShapeDtypeStruct((H, total, K), dtype), jax.ShapeDtypeStruct((H, total, V), dtype),
                 jax.ShapeDtypeStruct((H, total // CHUNK, K), F32))
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(total // CHUNK, H),
        compiler_params=_params(num_warps, num_stages),
        interpret=interpret,
        name="kda_chunk_wu",
    )(qn, kn, G, v, beta, inverse)


def intra(q, k, v, g, beta, A_log, dt_bias, *, scale, l2norm, gate, num_warps=1, diag_heads=4, diag_warps=1,
          wu_warps=None, interpret=False):
    """Kernels 1-5: everything inside a chunk. q, k, g: [Ttot, H, K]; v: [Ttot, H, V]; beta: [Ttot, H]; Ttot a
    multiple of 64; q, k, v bf16 (tf32 / bf16 tensor-core products) or fp32 (fp32-accurate products).
    Returns the inputs of `recurrence`: qg, kg, w [H, Ttot, K]; u [H, Ttot, V]; A_qk [H, Ttot, 64]; G_last."""
    if q.dtype not in (F32, BF16):
        raise ValueError(f"the Pallas chunk kernels take bfloat16 or float32 q/k/v, got {q.dtype}")
    qn, kn, G = prepare(q, k, g, A_log, dt_bias, l2norm=l2norm, gate=gate, interpret=interpret)
    diag_blocks = diag(qn, kn, G, scale=scale, heads_per_program=diag_heads, num_warps=diag_warps,
                       interpret=interpret)
    aqk, akk = scores(qn, kn, G, diag_blocks, scale=scale, num_warps=num_warps, interpret=interpret)
    inverse = wy_inverse(akk, beta, dtype=q.dtype, num_warps=num_warps, interpret=interpret)
    qg, kg, w, u, g_last = wu(qn, kn, G, v.astype(q.dtype), beta, inverse, scale=scale, num_warps=wu_warps,
                              interpret=interpret)
    return qg, kg, w, u, aqk, g_last


def _recurrence_kernel(qg_ref, kg_ref, w_ref, u_ref, aqk_ref, glast_ref, h0_ref, offsets_ref, o_ref, ht_ref, *,
                       block_v, base2, interpret):
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
        decay = _exp_of_G(base2)(glast_ref[head, c, :])  # [K]
        return state * decay[:, None] + mm(kg_ref[head, rows, :], v_op, trans_a=True)

    state = lax.fori_loop(first, last, body, h0_ref[seq, head, :, cols])
    ht_ref[seq, head, :, cols] = state


def recurrence_block_v(num_seqs: int, num_heads: int, head_v: int) -> int:
    """Value columns per `recurrence` program: 64, or 32 where 64 would leave fewer than FEW_PROGRAMS programs
    (H200, H = 32, V = 128, T = 4096: one sequence 0.116 ms with 32 vs 0.139 with 64; eight 0.881 vs 0.560)."""
    return 32 if num_seqs * num_heads * max(1, head_v // 64) < FEW_PROGRAMS else 64


def recurrence(qg, kg, w, u, aqk, g_last, initial_state, chunk_offsets, *, out_dtype, block_v=None, num_warps=4,
               num_stages=None, base2=None, interpret=False):
    """Kernel 6. Intermediates from `intra`; initial_state [N, H, K, V] fp32; chunk_offsets [N + 1] int32 (the
    first chunk of each sequence). Returns o [Ttot, H, V] in out_dtype and the final states [N, H, K, V] fp32.
    block_v defaults to `recurrence_block_v` (the serial chunk loop runs once per program: few sequences want more,
    narrower programs).
    num_stages (software pipelining of the chunk loop's loads) defaults to 3 for bf16 inputs and 1 for fp32: one
    stage of fp32 tiles is ~128 KB at K = 128, BV = 64, and 3 stages asked for 352 KB of an H200's 227 KB.
    base2: g_last in base 2, as `wu` returns it (default: qg is bf16)."""
    H, total, K = qg.shape
    V = u.shape[-1]
    n_seq = initial_state.shape[0]
    block_v = min(block_v or recurrence_block_v(n_seq, H, V), V)
    if num_stages is None:
        num_stages = 3 if qg.dtype == BF16 else 1
    kernel = functools.partial(_recurrence_kernel, block_v=block_v, base2=_base2(base2, qg.dtype),
                               interpret=interpret)
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((total, H, V), out_dtype),
                   jax.ShapeDtypeStruct((n_seq, H, K, V), F32)),
        grid=(V // block_v, H, n_seq),
        compiler_params=_params(num_warps, num_stages),
        interpret=interpret,
        name="kda_chunk_recurrence",
    )(qg, kg, w, u, aqk, g_last, initial_state, chunk_offsets)
