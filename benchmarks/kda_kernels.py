"""KDA kernel benchmark on one GPU: ours (Pallas, and XLA) against fla-core 0.6.0 (Triton), same run, same inputs.

    python benchmarks/kda_kernels.py [--out DIR] [--quick] [--sweep] [--no-jla] [--decode-batches B ...] [--pools N]
                                     [--tune [--ncu] [--tune-only WORD ...]]

Prefill (forward, H=32, K=V=128, bf16 q/k/v, fp32 log-decay g, l2norm in kernel, fp32 state out):
  ours pallas = pallas_ops.chunk_kda; ours xla = chunked.chunked_kda; fla = fla.ops.kda.chunk_kda;
  jla = jax-linear-attention 0.1.0 (optional). Every output is checked against the naive fp32 oracle on the same
  inputs (relative L2 error; the issue's bound for ours is 5e-3).
Decode (one token per row, in place on a state pool, gate / beta / l2norm in kernel; --sweep: block_v, warps and
the launch order (`columns_fastest`), tiles again with the KDA output norm in the launch (`_norm`, the model's path:
the norm's counters kept between steps, `counting_step`), each variant's one-step o checked against the reference;
and `state_traffic_probe`: the decode kernel's state loads and stores alone, the tiling's ceiling; --pools N: the
timed steps take N distinct pools in turn, so that at small batches they stream from HBM as the model's layers do,
not from L2):
  ours pallas = pallas_ops.packed_decode_kda; ours xla = packed_decode.packed_decode_kda_reference;
  fla = fla.ops.kda.fused_recurrent.fused_recurrent_kda_fwd(..., ssm_state_indices, inplace_final_state=True)
  (asserts that fla's pool changed). Correctness: 64 steps with fresh inputs vs the reference, max abs error;
  padding rows (-1) must leave the pool bit-identical and output zeros.

--tune: the prefill kernels one by one with their launch variants, and fla's per kernel (torch.profiler). With
--ncu, every launch runs untimed, twice, for Nsight Compute, e.g. `ncu --clock-control none -k regex:'kda|chunk|
recompute|l2norm|fused_recurrent' --section SpeedOfLight --section Occupancy --section LaunchStats -o DIR/kda
python3 benchmarks/kda_kernels.py --tune --ncu` (registers, occupancy and DRAM throughput of ours and fla's).

Timing: median after warm-up. JAX: a jitted call issued back to back many times, wall clock per block after a
device sync, median over blocks (decode: 64 steps inside one jit, per-step time = block / 64). torch:
triton.testing.do_bench (CUDA events, median; decode: a CUDA graph of 64 steps). Copy bandwidth: a large
device-to-device copy in the same run (bytes read + written / time). Prints a table, writes JSON to --out
(default $OUT or .).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from MaxText.kernels.kda import chunked, naive, packed_decode, pallas_ops  # noqa: E402

H, K, V = 32, 128, 128
PREFILL_SHAPES = [(1, 4096), (1, 16384), (1, 32768), (8, 4096)]
DECODE_BATCHES = [1, 8, 32, 64, 128, 256]
DECODE_STEPS = 64
# `scores` launch variants --tune times (keyword arguments of pallas_chunk.scores); the first is the default
SCORES_VARIANTS = tuple(dict(programs=p, num_warps=1, block_k=bk, num_stages=stages) for p, bk, stages in (
    ("halves", 16, 1), ("halves", 16, 3), ("halves", 16, 4), ("halves", 32, 3), ("chunk", 16, 3), ("chunk", 16, 4)))
DECODE_BLOCK_V, DECODE_WARPS = None, None  # defaults of pallas_ops.packed_decode_kda: by batch (decode_tile)
# --sweep's Triton decode tiles (block_v, num_warps, columns_fastest), and those also timed with the KDA output norm
# in the launch (the model's path: decode_tile's 32 columns for 1-3 rows, a head's 128 for 4-31, and the narrower
# and wider tiles beside them, for batches whose pools stream from HBM: --pools)
SWEEP_DECODE_TILES = ((64, 2, False), (64, 2, True), (64, 4, True), (128, 4, False), (128, 4, True), (128, 8, True),
                      (32, 4, True), (32, 4, False))
SWEEP_NORM_TILES = ((16, 2, False), (16, 4, False), (32, 2, False), (32, 4, False), (64, 4, False),
                    (128, 4, False))


def scores_variant_name(programs: str, num_warps: int, block_k: int, num_stages: int) -> str:
    return f"scores {programs} w{num_warps} block_k={block_k}" + (f" stages={num_stages}" if num_stages > 1 else "")


def log(*a):
    print(*a, flush=True)


def time_jax(fn, *args, target_s=0.05, blocks=7):
    """Median seconds per call of a jitted fn issued back to back (async dispatch keeps the GPU queue full)."""
    jax.block_until_ready(fn(*args))
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    one = max(time.perf_counter() - t, 1e-6)
    n = int(min(max(target_s / one, 3), 2000))
    times = []
    for _ in range(blocks):
        t = time.perf_counter()
        for _ in range(n):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t) / n)
    return statistics.median(times)


def time_torch(fn):
    import triton
    return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median") * 1e-3


def rel_l2(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def to_jax(t):
    return jnp.array(jax.dlpack.from_dlpack(t.contiguous()), copy=True)


def copy_bandwidth():
    import torch
    x = torch.empty(2 ** 29, dtype=torch.float32, device="cuda").normal_()  # 2 GiB
    y = torch.empty_like(x)
    s = time_torch(lambda: y.copy_(x))
    jx = jnp.ones((2 ** 29,), jnp.float32)
    copy = jax.jit(lambda a: a * 1.0 + 0.0)  # one fused read + write
    sj = time_jax(copy, jx)
    # The same read + write in place (the decode kernel's access pattern), buffer donated.
    in_place = jax.jit(lambda a: a * 0.5 + 1.0, donate_argnums=0)
    holder = [jx]

    def step():
        holder[0] = in_place(holder[0])
        return holder[0]
    si = time_jax(step)
    log(f"in-place update bandwidth (jax, donated): {2 * 2 ** 31 / si / 1e12:.2f} TB/s")
    del x, y, jx, holder
    return 2 * 2 ** 31 / s, 2 * 2 ** 31 / sj


# ------------------------------------------------------------------------------------------------- prefill
def prefill_inputs(B, T, seed):
    import torch
    gen = torch.Generator(device="cuda").manual_seed(seed)
    bf = torch.bfloat16
    q = torch.randn(B, T, H, K, device="cuda", dtype=bf, generator=gen)
    k = torch.randn(B, T, H, K, device="cuda", dtype=bf, generator=gen)
    v = torch.randn(B, T, H, V, device="cuda", dtype=bf, generator=gen)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, K, device="cuda", generator=gen))  # fp32 log-decay
    g[..., :8] = -20.0  # strongly negative channels: the exactness hard case
    beta = torch.randn(B, T, H, device="cuda", generator=gen).sigmoid().to(bf)
    return q, k, v, g, beta


def bench_prefill(B, T, args, results):
    import torch
    from fla.ops.kda import chunk_kda as fla_chunk_kda
    q, k, v, g, beta = prefill_inputs(B, T, seed=B * 100003 + T)
    jq, jk, jv, jg, jb = (to_jax(t) for t in (q, k, v, g, beta))
    kw = dict(use_qk_l2norm_in_kernel=True, output_final_state=True)
    row = {"B": B, "T": T}

    # The oracle on the same inputs cast to fp32 (exact): it computes in fp32 and then returns an fp32 output too,
    # instead of one rounded to bf16. One scan per shape.
    ref = jax.jit(lambda *a: naive.naive_recurrent_kda(*[x.astype(jnp.float32) for x in a], **kw))
    o_ref, s_ref = (np.asarray(x) for x in ref(jq, jk, jv, jg, jb))

    variants = {"pallas": {}}  # the defaults of pallas_ops.chunk_kda
    if args.sweep:
        variants = {f"pallas_bv{bv}_w{nw}": dict(block_v=bv, num_warps=nw) for bv in (32, 64) for nw in (4, 8)}
    for name, opts in variants.items():
        fn = jax.jit(lambda *a, o=opts: pallas_ops.chunk_kda(*a, **kw, **o))
        if name != "pallas" and B * T > 4096 and not name.endswith("w4"):
            continue  # sweep the warps only at the smallest shape
        o, s = fn(jq, jk, jv, jg, jb)
        row[f"{name}_err_o"], row[f"{name}_err_state"] = rel_l2(o, o_ref), rel_l2(s, s_ref)
        row[f"{name}_s"] = time_jax(fn, jq, jk, jv, jg, jb)
        log(f"  prefill B={B} T={T} {name}: {row[f'{name}_s'] * 1e3:.3f} ms, rel L2 o {row[f'{name}_err_o']:.2e}, "
            f"state {row[f'{name}_err_state']:.2e}")
    if not args.sweep and T * B <= 4096:
        fn = jax.jit(lambda *a: chunked.chunked_kda(*a, **kw))
        o, s = fn(jq, jk, jv, jg, jb)
        row["xla_err_o"], row["xla_s"] = rel_l2(o, o_ref), time_jax(fn, jq, jk, jv, jg, jb, blocks=3)
        log(f"  prefill B={B} T={T} xla: {row['xla_s'] * 1e3:.3f} ms, rel L2 {row['xla_err_o']:.2e}")

    scale = K ** -0.5
    fla_fn = lambda: fla_chunk_kda(q, k, v, g, beta, scale=scale, output_final_state=True,  # noqa: E731
                                   use_qk_l2norm_in_kernel=True)
    with torch.no_grad():
        o_f, s_f = fla_fn()
        torch.cuda.synchronize()
        row["fla_err_o"] = rel_l2(o_f.float().cpu().numpy(), o_ref)
        row["fla_err_state"] = rel_l2(s_f.float().cpu().numpy(), s_ref)
        row["fla_s"] = time_torch(fla_fn)
        # The same wall-clock block method as ours, for the record.
        fla_fn(); torch.cuda.synchronize()
        blocks = []
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(20):
                fla_fn()
            torch.cuda.synchronize()
            blocks.append((time.perf_counter() - t) / 20)
        row["fla_wallclock_s"] = statistics.median(blocks)
    log(f"  prefill B={B} T={T} fla: {row['fla_s'] * 1e3:.3f} ms "
        f"(wall-clock blocks {row['fla_wallclock_s'] * 1e3:.3f}),"
        f" rel L2 o {row['fla_err_o']:.2e}")

    if args.jla:
        try:
            from jla.ops.mosaic_gpu.kda import kda as jla_kda
            fn = jax.jit(lambda q_, k_, v_, g_, b_: jla_kda(q_, k_, v_, g_, b_, use_qk_l2norm=True,
                                                          output_final_state=True))
            o, _ = fn(jq, jk, jv, jg, jb)
            row["jla_err_o"], row["jla_s"] = rel_l2(o, o_ref), time_jax(fn, jq, jk, jv, jg, jb)
            log(f"  prefill B={B} T={T} jla: {row['jla_s'] * 1e3:.3f} ms, rel L2 {row['jla_err_o']:.2e}")
        except Exception as e:  # noqa: BLE001 -- optional peer
            row["jla_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            log(f"  jla failed: {row['jla_error']}")
    results.append(row)
    del q, k, v, g, beta
    torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------- decode
def decode_inputs(key, B, S):
    ks = jax.random.split(key, 5)
    bf = jnp.bfloat16
    mixed = jax.random.normal(ks[0], (B, 2 * H * K + H * V), jnp.float32).astype(bf)
    a = (2.0 * jax.random.normal(ks[1], (B, H * K), jnp.float32)).astype(bf)
    b = jax.random.normal(ks[2], (B, H), jnp.float32).astype(bf)
    A_log = jnp.log(jax.random.uniform(ks[3], (H,), jnp.float32, 1.0, 16.0))
    dt_bias = jax.random.normal(ks[4], (H * K,), jnp.float32)
    return mixed, a, b, A_log, dt_bias


def decode_correctness(B, block_v, kernel=None):
    """64 steps of fresh inputs, pallas (`kernel`: pallas_ops.packed_decode_kda's; default its choice) vs reference;
    padding rows checked bit-identical. Returns a dict."""
    S = 2 * B + 3
    key = jax.random.PRNGKey(B)
    pool = jax.random.normal(key, (S, H, K, V), jnp.float32) * 0.1
    slots = np.random.default_rng(B).permutation(S)[:B].astype(np.int32)
    if B >= 4:
        slots[1] = slots[-1] = -1  # padding rows
    slots = jnp.asarray(slots)
    untouched = np.setdiff1d(np.arange(S), np.asarray(slots))
    pool0 = np.asarray(pool)
    ref_pool, our_pool = pool, jnp.array(pool, copy=True)
    # Both sides output fp32 (the 1e-4 bound is on the fp32 result, not on bf16-rounded outputs).
    ours = jax.jit(lambda *a: pallas_ops.packed_decode_kda(*a, num_heads=H, head_dim=K, block_v=block_v,
                                                           kernel=kernel, out_dtype=jnp.float32), donate_argnums=(5,))
    ref = jax.jit(lambda *a: packed_decode.packed_decode_kda_reference(*a, num_heads=H, head_dim=K,
                                                                       out_dtype=jnp.float32))
    err, pad_zero = 0.0, True
    for step in range(DECODE_STEPS):
        inputs = decode_inputs(jax.random.fold_in(key, step), B, S)
        o_r, ref_pool = ref(*inputs, ref_pool, slots)
        o, our_pool = ours(*inputs, our_pool, slots)
        assert o.dtype == o_r.dtype == jnp.float32
        err = max(err, float(jnp.max(jnp.abs(o - o_r))))
        if B >= 4:
            pad_zero &= bool(jnp.all(o[1] == 0) & jnp.all(o[-1] == 0))
    err_state = float(jnp.max(jnp.abs(our_pool - ref_pool)))
    identical = bool(np.array_equal(np.asarray(our_pool)[untouched], pool0[untouched]))
    return {"max_abs_err_o": err, "max_abs_err_state": err_state, "padding_pool_bit_identical": identical,
            "padding_output_zero": pad_zero, "untouched_rows": int(untouched.size)}


def fla_decode_step(mixed, a, b, A_log, dt_bias, pool, slots):
    """fla's in-place decode step on our packed inputs (q, k, v split out of the packed row, contiguous: its kernel
    wants [B, 1, H, D]). Returns (fla's pool: a torch copy of `pool`, updated in place by each step; the step)."""
    import torch
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    B = mixed.shape[0]
    t_mixed = torch.from_dlpack(mixed)
    q = t_mixed[:, :H * K].reshape(B, 1, H, K).contiguous()
    k = t_mixed[:, H * K:2 * H * K].reshape(B, 1, H, K).contiguous()
    v = t_mixed[:, 2 * H * K:].reshape(B, 1, H, V).contiguous()
    t_a = torch.from_dlpack(a).reshape(B, 1, H, K).contiguous()
    t_b = torch.from_dlpack(b).reshape(B, 1, H).contiguous()
    t_alog, t_dtb = torch.from_dlpack(A_log).contiguous(), torch.from_dlpack(dt_bias).contiguous()
    t_slots = torch.from_dlpack(slots).to(torch.int32).contiguous()
    pool_t = torch.from_dlpack(pool).clone()

    def step():
        return fused_recurrent_kda_fwd(q, k, v, t_a, t_b, A_log=t_alog, dt_bias=t_dtb, initial_state=pool_t,
                                       scale=K ** -0.5, inplace_final_state=True, ssm_state_indices=t_slots,
                                       use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                       use_beta_sigmoid_in_kernel=True)
    return pool_t, step


def state_traffic_probe(pool, slots, *, block_v, num_warps, columns_fastest=False, interpret=False):
    """The packed decode kernel's state traffic without its math: the same grid (row, head, block of block_v value
    columns, in `pallas_decode.item_grid`'s order) and the same in-place slot addressing, each program loading its
    [K, block_v] fp32 slice of pool row slots[b] and storing it back times 0.5. Its time is what the decode kernel's
    tiling allows (the gap to the copy bandwidth is the tiling's, the rest the math's). Returns the pool (aliased:
    donate it for a true in-place run)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltriton
    from MaxText.kernels.kda import pallas_decode
    _, heads, head_k, head_v = pool.shape

    def kernel(slot_ref, pool_ref, out_ref):
        row, head, vblk = pallas_decode.item_ids(columns_fastest)
        slot, cols = slot_ref[row], pl.ds(vblk * block_v, block_v)
        out_ref[slot, head, :, cols] = pool_ref[slot, head, :, cols] * 0.5  # [K, BV]

    grid = pallas_decode.item_grid(slots.shape[0], heads, head_v // block_v, columns_fastest)
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(pool.shape, pool.dtype), grid=grid,
                          input_output_aliases={1: 0},
                          compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
                          interpret=interpret, name="state_traffic_probe")(slots, pool)


def decode_problem(B):
    """The timed decode step's inputs at batch B: (mixed, a, b, A_log, dt_bias), slots (a permutation of a B-row
    pool) and a function making the pool's starting state [B, H, K, V] fp32."""
    key = jax.random.PRNGKey(1000 + B)
    slots = jnp.asarray(np.random.default_rng(B).permutation(B).astype(np.int32))
    return decode_inputs(key, B, B), slots, lambda: jax.random.normal(key, (B, H, K, V), jnp.float32) * 0.1


def ncu_decode(B):
    """--tune --ncu: our default decode kernel twice, then fla's three times (the first autotunes), at batch B."""
    import torch
    inputs, slots, initial_pool = decode_problem(B)
    pool = initial_pool()
    _, fla_step = fla_decode_step(*inputs, pool, slots)
    step = jax.jit(lambda *x: pallas_ops.packed_decode_kda(*x, num_heads=H, head_dim=K), donate_argnums=(5,))
    for _ in range(2):
        _, pool = jax.block_until_ready(step(*inputs, pool, slots))
    with torch.no_grad():
        for _ in range(3):
            fla_step()
        torch.cuda.synchronize()
    log(f"  ncu: ran decode B={B}: ours twice, then fla three times")


def tile_name(block_v, num_warps, columns_fastest):
    return f"pallas_bv{block_v}_w{num_warps}" + ("_cols" if columns_fastest else "")


def tile_options(block_v, num_warps, columns_fastest):
    return dict(kernel="triton", block_v=block_v, num_warps=num_warps, columns_fastest=columns_fastest)


def decode_out_norm_inputs(B):
    """The KDA output norm's inputs at batch B (packed_decode_kda's out_gate, out_norm_scale, out_norm_eps)."""
    rng = np.random.default_rng(B)
    return dict(out_gate=jnp.asarray(rng.standard_normal((B, H * V)), jnp.bfloat16),
                out_norm_scale=jnp.asarray(1.0 + 0.3 * rng.standard_normal(V), jnp.float32), out_norm_eps=1e-5)


def decode_step_error(B, options):
    """Max abs difference of one decode step's o (packed_decode_kda with `options`, from decode_problem(B)'s pool)
    from the reference's on the same inputs (the output norm too where `options` has it)."""
    inputs, slots, initial_pool = decode_problem(B)
    norm = {key: options[key] for key in ("out_gate", "out_norm_scale", "out_norm_eps") if key in options}
    o, _ = jax.jit(lambda *x: pallas_ops.packed_decode_kda(*x, num_heads=H, head_dim=K, **options))(
        *inputs, initial_pool(), slots)
    o_ref, _ = packed_decode.packed_decode_kda_reference(*inputs, initial_pool(), slots, num_heads=H, head_dim=K,
                                                         **norm)
    return float(jnp.max(jnp.abs(o.astype(jnp.float32) - o_ref.astype(jnp.float32))))


def counting_step(options):
    """A decode step with the KDA output norm as the model runs it: the norm's counters (`norm_counts`, [B, H] int32)
    kept between steps beside the pool, so that no zeros are made and copied before each launch. The step's "pool"
    is the pair (pool, counts)."""
    def step(mixed, a, b, A_log, dt_bias, pool_and_counts, slots):
        pool, counts = pool_and_counts
        o, pool, counts = pallas_ops.packed_decode_kda(mixed, a, b, A_log, dt_bias, pool, slots, num_heads=H,
                                                       head_dim=K, norm_counts=counts, **options)
        return o, (pool, counts)
    return step


def decode_loop(step_fn, steps=DECODE_STEPS):
    """The timed decode loop: run(pools, mixed, a, b, A_log, dt_bias, slots) -> (pools, acc), jitted with `pools` (a
    tuple of distinct state pools) donated; `steps` unrolled calls of step_fn (one launch each, no while-loop round
    trips), step i on pools[i % len(pools)]; acc sums each step's o[0, 0, 0] so that no step is dropped."""
    def run(pools, mixed, a, b, A_log, dt_bias, slots):
        pools, acc = list(pools), jnp.float32(0)
        for i in range(steps):
            o, pools[i % len(pools)] = step_fn(mixed, a, b, A_log, dt_bias, pools[i % len(pools)], slots)
            acc = acc + o[0, 0, 0].astype(jnp.float32)
        return tuple(pools), acc
    return jax.jit(run, donate_argnums=(0,))


def bench_decode(B, args, results, copy_bw):
    import torch
    (mixed, a, b, A_log, dt_bias), slots, initial_pool = decode_problem(B)
    row = {"B": B}
    state_bytes = 2 * B * H * K * V * 4

    row["kernel"] = "triton" if args.sweep else pallas_ops.decode_kernel(B, K, V)
    variants = {"pallas": dict(block_v=DECODE_BLOCK_V, num_warps=DECODE_WARPS)}
    if row["kernel"] != "triton":  # the Triton kernel's time beside the chosen one's
        variants["pallas_triton"] = dict(kernel="triton")
    if args.sweep:  # Triton tiles: block_v, warps; cols: a head's value blocks launched side by side
        variants = {tile_name(*tile): tile_options(*tile) for tile in SWEEP_DECODE_TILES}
        norm = decode_out_norm_inputs(B)  # the model's path: the KDA output norm in the decode launch
        variants.update({tile_name(*tile) + "_norm": dict(tile_options(*tile), **norm)
                         for tile in SWEEP_NORM_TILES})
    for name, options in variants.items():  # every variant's one-step o against the reference's
        row[f"{name}_err_o"] = decode_step_error(B, options)
    counting = {name for name, c in variants.items() if "out_norm_eps" in c}  # their steps carry (pool, counts)
    impls = {name: (counting_step(c) if name in counting else
                    lambda *x, c=c: pallas_ops.packed_decode_kda(*x, num_heads=H, head_dim=K, **c))
             for name, c in variants.items()}
    if args.sweep:  # the same tiles' state traffic without the math (o: a constant, for the loop's accumulator)
        for bv, nw, cols in ((64, 2, False), (64, 2, True)):
            impls[f"probe_bv{bv}_w{nw}" + ("_cols" if cols else "")] = lambda *x, bv=bv, nw=nw, cols=cols: (
                jnp.zeros((B, H, V), jnp.float32),
                state_traffic_probe(x[5], x[6], block_v=bv, num_warps=nw, columns_fastest=cols))
    impls["xla"] = lambda *x: packed_decode.packed_decode_kda_reference(*x, num_heads=H, head_dim=K)
    for name, step in impls.items():
        run = decode_loop(step)
        holder = [tuple((initial_pool(), jnp.zeros((B, H), jnp.int32)) if name in counting else initial_pool()
                        for _ in range(args.pools))]

        def call():
            holder[0], acc = run(holder[0], mixed, a, b, A_log, dt_bias, slots)
            return acc
        row[f"{name}_s"] = time_jax(lambda: call(), target_s=0.03) / DECODE_STEPS
        row[f"{name}_state_bw"] = state_bytes / row[f"{name}_s"]
        checked = f", o max abs err vs reference {row[f'{name}_err_o']:.1e}" if f"{name}_err_o" in row else ""
        log(f"  decode B={B} {name}: {row[f'{name}_s'] * 1e6:.2f} us/step, state traffic "
            f"{row[f'{name}_state_bw'] / 1e12:.2f} TB/s ({row[f'{name}_state_bw'] / copy_bw:.0%} of copy){checked}")

    fla_steps = [fla_decode_step(mixed, a, b, A_log, dt_bias, initial_pool(), slots) for _ in range(args.pools)]
    pool_t, fla_step = fla_steps[0]
    with torch.no_grad():
        before = pool_t.clone()
        o_f, _ = fla_step()
        torch.cuda.synchronize()
        assert not torch.equal(before, pool_t), "fla did not update the pool in place"
        # fla's one-step result vs our reference from the same starting pool.
        o_r, p_r = packed_decode.packed_decode_kda_reference(mixed, a, b, A_log, dt_bias,
                                                             jnp.asarray(jax.dlpack.from_dlpack(before)), slots,
                                                             num_heads=H, head_dim=K)
        row["fla_err_o"] = float(np.abs(o_f.float().cpu().numpy().reshape(B, H, V) - np.asarray(o_r, np.float32)).max())
        row["fla_err_state"] = float((pool_t - torch.from_dlpack(p_r)).abs().max())
        for _ in range(3):
            fla_step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(DECODE_STEPS):
                fla_steps[i % args.pools][1]()
        row["fla_s"] = time_torch(graph.replay) / DECODE_STEPS
    row["fla_state_bw"] = state_bytes / row["fla_s"]
    log(f"  decode B={B} fla: {row['fla_s'] * 1e6:.2f} us/step, state traffic {row['fla_state_bw'] / 1e12:.2f} TB/s"
        f" ({row['fla_state_bw'] / copy_bw:.0%} of copy); err o {row['fla_err_o']:.1e}")
    results.append(row)


def tune_prefill(ncu=False, only=None):
    """Times the prefill kernels separately for launch variants (B=8, T=4096), then fla's kernels on the same
    inputs (torch.profiler), then exits. ncu: each variant runs twice untimed (and fla's chunk_kda three times,
    then both decode kernels: `ncu_decode`), for Nsight Compute to profile every launch; the log names the
    launches in order. only: the variants whose name contains one of these words (fla's kernels: "fla"; with ncu,
    the decode kernels: "decode")."""
    from MaxText.kernels.kda import pallas_chunk
    B, T = 8, 4096
    q, k, v, g, beta = (to_jax(t).reshape(B * T, *t.shape[2:]) for t in prefill_inputs(B, T, seed=1))
    intra_kw = dict(scale=K ** -0.5, l2norm=True, gate=False)

    def wanted(name):
        return not only or any(word in name for word in only)

    def timed(name, fn, *args):
        if not wanted(name):
            return
        jitted = jax.jit(fn)
        try:
            if ncu:
                for _ in range(2):
                    jax.block_until_ready(jitted(*args))
                log(f"  ncu: ran twice: {name}")
            else:
                log(f"  tune B={B} T={T} {name}: {time_jax(jitted, *args) * 1e3:.3f} ms")
        except Exception as e:  # noqa: BLE001
            log(f"  tune {name} failed: {type(e).__name__}: {str(e)[:300]}")

    timed("prepare", lambda *a: pallas_chunk.prepare(*a, None, None, l2norm=True, gate=False), q, k, g)
    for warps in (2, 8):
        timed(f"prepare warps={warps}", lambda *a, w=warps: pallas_chunk.prepare(*a, None, None, l2norm=True,
                                                                                  gate=False, num_warps=w), q, k, g)
    qn, kn, G = jax.jit(lambda *a: pallas_chunk.prepare(*a, None, None, l2norm=True, gate=False))(q, k, g)
    # base2=False: the natural-log G (the fp32 inputs' units), exp2 with a multiply per element (the bf16 default
    # before base2)
    G_nat = jax.jit(lambda *a: pallas_chunk.prepare(*a, None, None, l2norm=True, gate=False, base2=False))(q, k, g)[2]
    for heads, warps in ((4, 1), (2, 1)):
        timed(f"diag heads={heads} warps={warps}",
              lambda *a, h=heads, w=warps: pallas_chunk.diag(*a, scale=K ** -0.5, heads_per_program=h, num_warps=w),
              qn, kn, G)
    timed("diag base2=False", lambda *a: pallas_chunk.diag(*a, scale=K ** -0.5, base2=False), qn, kn, G_nat)
    diag_blocks = jax.jit(lambda *a: pallas_chunk.diag(*a, scale=K ** -0.5))(qn, kn, G)
    for options in SCORES_VARIANTS:
        timed(scores_variant_name(**options), lambda *a, o=options: pallas_chunk.scores(*a, scale=K ** -0.5, **o),
              qn, kn, G, diag_blocks)
    timed("scores base2=False", lambda *a: pallas_chunk.scores(*a, scale=K ** -0.5, base2=False),
          qn, kn, G_nat, diag_blocks)
    _, akk = jax.jit(lambda *a: pallas_chunk.scores(*a, scale=K ** -0.5))(qn, kn, G, diag_blocks)
    timed("wy_inverse", lambda *a: pallas_chunk.wy_inverse(*a, dtype=jnp.bfloat16), akk, beta)
    inverse = jax.jit(lambda *a: pallas_chunk.wy_inverse(*a, dtype=jnp.bfloat16))(akk, beta)
    for warps, stages in ((4, 2), (8, 2), (4, 3), (8, 3)):
        timed(f"wu num_warps={warps} num_stages={stages}",
              lambda *a, w=warps, s=stages: pallas_chunk.wu(*a, scale=K ** -0.5, num_warps=w, num_stages=s),
              qn, kn, G, v, beta, inverse)
    timed("wu base2=False", lambda *a: pallas_chunk.wu(*a, scale=K ** -0.5, base2=False),
          qn, kn, G_nat, v, beta, inverse)
    intermediates = jax.jit(lambda *a: pallas_chunk.intra(*a, None, None, **intra_kw))(q, k, v, g, beta)
    for rows in (B, 1):  # all rows, and the first row alone (B=1: few programs, the serial chain dominates)
        seq = [x[:, :rows * T] for x in intermediates[:5]] + [intermediates[5][:, :rows * T // 64]]
        h0 = jnp.ones((rows, H, K, V), jnp.float32)
        offs = jnp.arange(rows + 1, dtype=jnp.int32) * (T // 64)
        for bv, nw, ns in ((64, 4, 3), (32, 4, 3), (32, 8, 3)):
            f = lambda *a, bv=bv, w=nw, s=ns: pallas_chunk.recurrence(*a, out_dtype=jnp.bfloat16, block_v=bv,  # noqa
                                                                      num_warps=w, num_stages=s)
            timed(f"recurrence rows={rows} bv={bv} warps={nw} stages={ns}", f, *seq, h0, offs)
    if wanted("fla"):
        guarded(fla_prefill_kernels, B, T, ncu=ncu)
    if ncu and wanted("decode"):
        for batch in (64, 256):
            guarded(ncu_decode, batch)


def fla_prefill_kernels(B, T, calls=5, top=12, ncu=False):
    """fla's chunk_kda on the tune inputs under torch.profiler: device time per kernel and call (the per-stage
    target for ours). ncu: three plain calls (the first one autotunes)."""
    import torch
    from fla.ops.kda import chunk_kda as fla_chunk_kda
    q, k, v, g, beta = prefill_inputs(B, T, seed=1)

    def call():
        return fla_chunk_kda(q, k, v, g, beta, scale=K ** -0.5, output_final_state=True, use_qk_l2norm_in_kernel=True)
    with torch.no_grad():
        for _ in range(3):
            call()
        torch.cuda.synchronize()
    if ncu:
        log(f"  ncu: ran three times: fla chunk_kda B={B} T={T}")
        return
    with torch.no_grad():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                call()
            torch.cuda.synchronize()
    events = prof.key_averages()
    def device_us(event):  # torch >= 2.4 names it device_time_total, older ones cuda_time_total
        return event.device_time_total if hasattr(event, "device_time_total") else event.cuda_time_total
    log(f"  tune B={B} T={T} fla chunk_kda, all kernels: {sum(device_us(e) for e in events) / calls / 1e3:.3f} ms")
    for e in sorted(events, key=device_us, reverse=True)[:top]:
        log(f"  tune B={B} T={T} fla {e.key[:90]}: {device_us(e) / calls / 1e3:.3f} ms ({e.count // calls} per call)")
    from fla.ops.kda import chunk_intra, chunk_intra_token_parallel, wy_fast
    for kernel in (chunk_intra_token_parallel.chunk_kda_fwd_kernel_intra_token_parallel,
                   chunk_intra.chunk_kda_fwd_kernel_inter_solve_fused, wy_fast.recompute_w_u_fwd_kda_kernel):
        chain = [kernel]  # Heuristics -> Autotuner -> JITFunction, each wrapping the next as .fn
        while hasattr(chain[-1], "fn"):
            chain.append(chain[-1].fn)
        best = next((getattr(k, "best_config") for k in chain if hasattr(k, "best_config")), "?")
        log(f"  tune fla {getattr(chain[-1], '__name__', chain[-1])} autotuned to: {best}")


def guarded(fn, *args, **kwargs):
    """Runs one benchmark piece; a failure is printed (with its traceback) and the run goes on."""
    import traceback
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        return {"error": f"{type(e).__name__}: {str(e)[:500]}"}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--quick", action="store_true", help="first prefill and decode shapes only")
    parser.add_argument("--sweep", action="store_true", help="time kernel tile variants instead of the defaults")
    parser.add_argument("--no-jla", dest="jla", action="store_false", help="skip jax-linear-attention")
    parser.add_argument("--skip-prefill", action="store_true")
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument("--tune", action="store_true",
                        help="time the prefill kernels separately and fla's (torch.profiler), then exit")
    parser.add_argument("--ncu", action="store_true",
                        help="with --tune: run every kernel variant a few times untimed, for Nsight Compute")
    parser.add_argument("--tune-only", nargs="+", default=None, metavar="WORD",
                        help="with --tune: only the variants whose name contains one of these words (e.g. scores "
                             "fla)")
    parser.add_argument("--pools", type=int, default=1,
                        help="distinct state pools the timed decode steps take in turn, for every kernel and fla "
                             "(1: every step updates the same pool, which stays in L2 at small batches; ~20 stream "
                             "them from HBM, as the model's layers read their own pools)")
    parser.add_argument("--decode-batches", type=int, nargs="+", default=None,
                        help=f"decode batch sizes to time (default {DECODE_BATCHES}; --quick: the first two)")
    args = parser.parse_args()
    if args.tune_only and not args.tune:
        parser.error("--tune-only needs --tune")
    if args.pools < 1:
        parser.error(f"--pools must be >= 1, got {args.pools}")
    if args.tune:
        return tune_prefill(ncu=args.ncu, only=args.tune_only)
    import torch
    import triton
    import fla
    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "gpu": torch.cuda.get_device_name(), "jax": jax.__version__, "torch": torch.__version__,
           "triton": triton.__version__, "fla": getattr(fla, "__version__", "?"), "python": platform.python_version(),
           "command": " ".join(sys.argv)}
    log(json.dumps(env))
    copy_bw, copy_bw_jax = copy_bandwidth()
    log(f"device copy bandwidth (read + write): torch {copy_bw / 1e12:.2f} TB/s, jax {copy_bw_jax / 1e12:.2f} TB/s")
    prefill, decode, checks = [], [], {}
    if not args.skip_decode:
        for B in ([8] if args.quick else [1, 8, 64, 256]):
            for kernel in sorted({pallas_ops.decode_kernel(B, K, V), "triton"}):
                checks[f"decode_B{B}_{kernel}"] = c = guarded(decode_correctness, B, DECODE_BLOCK_V, kernel)
                log(f"decode check B={B} {kernel}: {c}")
        for B in args.decode_batches or (DECODE_BATCHES[:2] if args.quick else DECODE_BATCHES):
            guarded(bench_decode, B, args, decode, copy_bw)
    if not args.skip_prefill:
        for B, T in (PREFILL_SHAPES[:1] if args.quick else PREFILL_SHAPES):
            guarded(bench_prefill, B, T, args, prefill)

    log("\n## prefill (forward, H=32, K=V=128, bf16, ms; ratio = ours / fla)")
    log("| B x T | pallas | xla chunked | fla chunk_kda | jla | pallas/fla | rel L2 pallas | rel L2 fla |")
    log("|---|---|---|---|---|---|---|---|")
    for r in prefill:
        p = r.get("pallas_s", min((r[x] for x in r if x.startswith("pallas") and x.endswith("_s")), default=None))
        f = lambda key: f"{r[key] * 1e3:.3f}" if key in r else "-"  # noqa: E731
        log(f"| {r['B']} x {r['T']} | {p * 1e3:.3f} | {f('xla_s')} | {f('fla_s')} | {f('jla_s')} | "
            f"{p / r['fla_s']:.2f} | {r.get('pallas_err_o', float('nan')):.1e} | {r['fla_err_o']:.1e} |")
    log("\n## decode (per layer per step, in place, us; traffic = state bytes read + written / time)")
    log(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s")
    log("| B | pallas | kernel | xla | fla | pallas/fla | pallas traffic (% copy) | fla traffic (% copy) |")
    log("|---|---|---|---|---|---|---|---|")
    for r in decode:
        p = r.get("pallas_s", min((r[x] for x in r if x.startswith("pallas") and x.endswith("_s")), default=None))
        bw = 2 * r["B"] * H * K * V * 4 / p
        log(f"| {r['B']} | {p * 1e6:.2f} | {r.get('kernel', '-')} | {r['xla_s'] * 1e6:.2f} | {r['fla_s'] * 1e6:.2f} | "
            f"{p / r['fla_s']:.2f} | "
            f"{bw / 1e12:.2f} TB/s ({bw / copy_bw:.0%}) | {r['fla_state_bw'] / 1e12:.2f} TB/s "
            f"({r['fla_state_bw'] / copy_bw:.0%}) |")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "kda_kernels.json")
    with open(path, "w") as fh:
        json.dump({"env": env, "copy_bw": copy_bw, "copy_bw_jax": copy_bw_jax, "prefill": prefill,
                   "decode": decode, "decode_checks": checks}, fh, indent=1)
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
