"""Pallas (Triton lowering) MLA attention in the latent space for decode (flash-decoding over the cache).

    out_latent [B, T, H, R] = latent_attention(q_latent [B, T, H, R], q_rope [B, T, H, P], keys [B, S, R + P],
                                               query_positions [B, T], key_valid [B, S], scale=...)

The same math as naive.latent_attention. The cache is cut into runs of `blocks_per_run` blocks of `block_s` positions;
one program per (batch row, run) holds all T * H query rows (every head reads the same latent keys: the cache is read
once per row, not once per head; `block_h` splits the rows over several programs, 16 rows each by default for one
batch row of one token: `default_block_h`), streams its blocks with an online
softmax (scores and accumulator in float32, the probabilities multiplied by the keys in the inputs' dtype on the tensor
cores) and writes its running max, sum and accumulator; a second kernel combines the runs (one program per query row and
block of 128 latent columns). A run stops at the last query position (later blocks are never read). The cache length S
need not be a multiple of `block_s`: the last block is read from S - block_s and its positions before the block's own
start are masked.

The XLA version (naive.py) is ~12 kernels per MLA layer at decode (two score products, slices and a pad of the
cache, masked max / sum reductions, the probabilities' product in split pieces and their sum); this is two.

Runs under `interpret=True` on CPU (the tests do).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from MaxText.kernels.pallas_dot import dot

MMA_ROWS = 16  # the tensor cores' least tile height: the query rows are padded up to it
# Tiles measured on an H200 (JAX 0.11.2; 48B shapes: H 32, R 512, P 64, S 4213 at position 4096; bf16; a jitted
# chain of 20 calls, the combine included, as benchmarks/mla_decode.py --sweep times them; benchmarks/RESULTS.md,
# thirteenth session): blocks of 32 positions, 4 warps, 3 stages; runs for about TARGET_PROGRAMS programs but at
# least MIN_BLOCKS_PER_RUN blocks each (B=1: 66 runs 13.7 us vs 16.0 with 33 and 22.1 with 16; B=64: 4 runs 118 us
# vs 146 with 2). With these defaults vs XLA (benchmarks/mla_decode.py): B=1 11.1 vs 17.0 us, B=8 30.8 vs 39.8,
# B=64 122 vs 197.
BLOCK_S = 32
NUM_WARPS, NUM_STAGES = 4, 3
TARGET_PROGRAMS = 256
MIN_BLOCKS_PER_RUN = 2  # (each run adds [T*H, R] float32 partials for the combine to read)


def power_of_two(n: int) -> bool:
    """Whether n is a power of two >= 1 (Triton's block shapes must be)."""
    return n >= 1 and not n & (n - 1)


def default_block(num_keys: int) -> int:
    """Cache positions per block: BLOCK_S, or the largest power of two <= S for a shorter cache (at least MMA_ROWS,
    the tensor cores' K, for the probabilities' product)."""
    return min(BLOCK_S, 1 << (max(num_keys, 1).bit_length() - 1))


def unsupported_reason(dtype, rank: int, rope: int, num_keys: int) -> str | None:
    """None when the kernel takes these shapes: bf16 / fp32 inputs, R and P powers of two >= 16 (Triton's block
    shapes and the tensor cores' K), a cache of at least MMA_ROWS positions."""
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        return f"the Pallas MLA decode takes bfloat16 or float32 inputs, got {jnp.dtype(dtype)}"
    for name, dim in (("kv_lora_rank", rank), ("qk_rope_head_dim", rope)):
        if dim < 16 or not power_of_two(dim):
            return f"the Pallas MLA decode needs {name} to be a power of two >= 16, got {dim}"
    if num_keys < MMA_ROWS:
        return f"the Pallas MLA decode needs a cache of at least {MMA_ROWS} positions, got {num_keys}"
    return None


def padded_rows(num_rows: int) -> int:
    """A batch row's query rows (T * H) padded to a power of two >= MMA_ROWS (padding rows see nothing)."""
    return max(MMA_ROWS, 1 << (num_rows - 1).bit_length())


def default_block_h(batch: int, num_rows: int) -> int:
    """Query rows per program: MMA_ROWS (16) for one batch row of at most 32 query rows (one token of the 48B model's
    32 heads), so that twice the programs share the cache's runs; else all of a batch row's rows (padded). Measured
    on an H200 (48B shapes, 4206 cached positions at position 4096, bf16; a chain of 14 calls over 14 distinct caches,
    so that they stream from HBM as the model's 7 layers do, as `benchmarks/mla_decode.py --caches 14` times it;
    benchmarks/RESULTS.md, thirty-fourth session): 10.48 / 10.52 us per call with 16 rows vs 12.51 / 12.54 with all
    32, bit-identical outputs. Other batches and verify-sized T were not timed with it."""
    return MMA_ROWS if batch == 1 and num_rows <= 32 else padded_rows(num_rows)


def default_runs(batch: int, num_blocks: int) -> int:
    """Runs per batch row: about TARGET_PROGRAMS programs in all, at least MIN_BLOCKS_PER_RUN blocks each."""
    return max(1, min(-(-TARGET_PROGRAMS // batch), -(-num_blocks // MIN_BLOCKS_PER_RUN)))


def _decode_kernel(qpos_ref, valid_ref, q_ref, q_rope_ref, keys_ref, max_ref, sum_ref, acc_ref, *, rank, rope,
                   block_s, blocks_per_run, block_h, num_keys, scale, precise, interpret):
    group, row, run = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows = pl.ds(group * block_h, block_h)  # this program's query rows
    q, q_rope = q_ref[row, rows], q_rope_ref[row, rows]  # [M, R], [M, P]
    qpos = qpos_ref[row, rows]  # [M]: each query row's position (-1: a padding row, sees nothing)
    first = run * blocks_per_run * block_s
    # This run's blocks that start at or before the last query position (a cache past it is never read).
    blocks = jnp.clip((jnp.max(qpos) - first) // block_s + 1, 0, blocks_per_run)

    def body(i, carry):
        running_max, running_sum, acc = carry
        block_start = first + i * block_s
        start = jnp.minimum(block_start, num_keys - block_s)  # inside the cache; positions before block_start masked
        keys = pl.ds(start, block_s)
        c = keys_ref[row, keys, pl.ds(0, rank)]  # [BS, R]
        k_rot = keys_ref[row, keys, pl.ds(rank, rope)]  # [BS, P]
        positions = start + jnp.arange(block_s)
        visible = ((positions >= block_start)[None, :] & (valid_ref[row, keys] != 0)[None, :]
                   & (positions[None, :] <= qpos[:, None]))  # [M, BS]
        scores = (dot(q, c, trans_b=True, precise=precise, interpret=interpret)
                  + dot(q_rope, k_rot, trans_b=True, precise=precise, interpret=interpret)) * scale  # [M, BS]
        scores = jnp.where(visible, scores, -jnp.inf)
        new_max = jnp.maximum(running_max, jnp.max(scores, axis=1))  # [M]
        safe_max = jnp.where(new_max == -jnp.inf, 0.0, new_max)  # rows that have seen nothing yet stay at zero
        probs = jnp.exp(scores - safe_max[:, None])  # [M, BS], zero where masked
        rescale = jnp.exp(running_max - safe_max)  # [M]
        acc = acc * rescale[:, None] + dot(probs.astype(c.dtype), c, precise=precise, interpret=interpret)
        return new_max, running_sum * rescale + jnp.sum(probs, axis=1), acc

    num_rows = q.shape[0]
    init = (jnp.full((num_rows,), -jnp.inf, jnp.float32), jnp.zeros((num_rows,), jnp.float32),
            jnp.zeros((num_rows, rank), jnp.float32))
    running_max, running_sum, acc = lax.fori_loop(0, blocks, body, init)
    max_ref[row, run, rows] = running_max
    sum_ref[row, run, rows] = running_sum
    acc_ref[row, run, rows] = acc


def _combine_kernel(max_ref, sum_ref, acc_ref, out_ref, *, runs, stored_runs, block_r):
    """One program per (batch row, query row, block of R columns): the runs' states -> softmax(scores) c."""
    row, query, col_block = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    written = jnp.arange(stored_runs) < runs  # the state arrays have a power-of-two run axis; the rest is unwritten
    run_max = pltriton.load(max_ref.at[row, :, query], mask=written, other=-jnp.inf)  # [RUNS]
    run_sum = pltriton.load(sum_ref.at[row, :, query], mask=written, other=0.0)
    cols = pl.ds(col_block * block_r, block_r)
    run_acc = pltriton.load(acc_ref.at[row, :, query, cols], mask=written[:, None], other=0.0)  # [RUNS, BR]
    best = jnp.max(run_max)
    weight = jnp.exp(run_max - jnp.where(best == -jnp.inf, 0.0, best))  # zero for runs that saw nothing
    total = jnp.maximum(jnp.sum(weight * run_sum), jnp.finfo(jnp.float32).tiny)  # a row that saw nothing: zeros
    out_ref[row, query, cols] = (jnp.sum(weight[:, None] * run_acc, axis=0) / total).astype(out_ref.dtype)


def combine_runs(run_max, run_sum, run_acc, runs: int, dtype, *, block_r: int = 128, num_warps: int = 4,
                 interpret: bool = False):
    """The first `runs` of the runs' online-softmax states [B, RUNS, M] (max, sum) and [B, RUNS, M, R] -> [B, M, R]
    in `dtype`, one Pallas launch; a row that saw no key is zero."""
    batch, stored_runs, num_rows, rank = run_acc.shape
    block_r = min(block_r, rank)
    return pl.pallas_call(
        functools.partial(_combine_kernel, runs=runs, stored_runs=stored_runs, block_r=block_r),
        out_shape=jax.ShapeDtypeStruct((batch, num_rows, rank), dtype),
        grid=(batch, num_rows, rank // block_r),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="mla_latent_combine",
    )(run_max, run_sum, run_acc)


def latent_attention(q_latent, q_rope, keys, query_positions, key_valid, *, scale: float, block_s: int | None = None,
                     runs: int | None = None, block_h: int | None = None, num_warps: int = NUM_WARPS,
                     num_stages: int = NUM_STAGES, interpret: bool = False):
    """See the module docstring. block_s: cache positions per block, a power of two in [MMA_ROWS, S] (None:
    `default_block`); runs: runs per batch row (None: `default_runs`); block_h: query rows per program, a power of
    two >= MMA_ROWS (None: `default_block_h`; fewer than a batch row's T * H rows make more programs, each run's
    blocks then read by every group of rows, side by side in the launch order)."""
    batch, num_tokens, num_heads, rank = q_latent.shape
    num_keys = keys.shape[1]
    rope = keys.shape[2] - rank
    if q_rope.shape != (batch, num_tokens, num_heads, rope) or keys.shape[0] != batch:
        raise ValueError(f"expected q_rope [B, T, H, P] = {(batch, num_tokens, num_heads, rope)} and keys [B, S, R + P]"
                         f" with B={batch}, R={rank}; got q_rope {q_rope.shape}, keys {keys.shape}")
    if query_positions.shape != (batch, num_tokens) or key_valid.shape != (batch, num_keys):
        raise ValueError(f"expected query_positions [B, T] = {(batch, num_tokens)} and key_valid [B, S] = "
                         f"{(batch, num_keys)}; got {query_positions.shape} and {key_valid.shape}")
    reason = unsupported_reason(q_latent.dtype, rank, rope, num_keys)
    if reason:
        raise ValueError(reason)
    block_s = default_block(num_keys) if block_s is None else block_s
    if not MMA_ROWS <= block_s <= num_keys or not power_of_two(block_s):
        raise ValueError(f"block_s={block_s} must be a power of two in [{MMA_ROWS}, S={num_keys}]")
    num_blocks = -(-num_keys // block_s)
    runs = default_runs(batch, num_blocks) if runs is None else runs
    blocks_per_run = -(-num_blocks // runs)
    runs = -(-num_blocks // blocks_per_run)
    num_rows = num_tokens * num_heads  # a batch row's query rows, together
    padded = padded_rows(num_rows)
    block_h = default_block_h(batch, num_rows) if block_h is None else min(block_h, padded)
    if block_h < MMA_ROWS or not power_of_two(block_h):
        raise ValueError(f"block_h={block_h} must be a power of two >= {MMA_ROWS}")
    pad = ((0, 0), (0, padded - num_rows), (0, 0))
    q = jnp.pad(q_latent.reshape(batch, num_rows, rank), pad)  # [B, M, R]
    qr = jnp.pad(q_rope.astype(q_latent.dtype).reshape(batch, num_rows, rope), pad)  # [B, M, P]
    qpos = jnp.pad(jnp.repeat(query_positions.astype(jnp.int32), num_heads, axis=1), pad[:2],
                   constant_values=-1)  # [B, M]
    kernel = functools.partial(_decode_kernel, rank=rank, rope=rope, block_s=block_s, blocks_per_run=blocks_per_run,
                               block_h=block_h, num_keys=num_keys, scale=scale,
                               precise=q_latent.dtype == jnp.float32, interpret=interpret)
    stored_runs = 1 << (runs - 1).bit_length()  # a power of two (Triton's block shapes) for the combine's loads
    state = jax.ShapeDtypeStruct((batch, stored_runs, padded), jnp.float32)
    run_max, run_sum, run_acc = pl.pallas_call(
        kernel,
        out_shape=(state, state, jax.ShapeDtypeStruct((batch, stored_runs, padded, rank), jnp.float32)),
        grid=(padded // block_h, batch, runs),  # row groups fastest: a run's groups launch side by side
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="mla_latent_decode",
    )(qpos, key_valid.astype(jnp.int8), q, qr, keys.astype(q_latent.dtype))
    out = combine_runs(run_max, run_sum, run_acc, runs, q_latent.dtype, interpret=interpret)[:, :num_rows]
    return out.reshape(batch, num_tokens, num_heads, rank)
