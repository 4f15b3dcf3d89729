"""MoE grouped matmul on one GPU: the Pallas kernel against XLA's ragged_dot and the gather path, same run, same
inputs, at Kimi-Linear-48B's expert shapes (256 experts, top-8, emb 2304, expert width 1024, bf16).

    python benchmarks/grouped_matmul.py [--out DIR] [--tokens 1 8 64 512 4096] [--sweep]

For each token count, tokens route to top-8 distinct experts uniformly at random (within --expert-pool experts per
layer, default all 256; --rows-per-token 9 adds a ninth, as the shared expert's row); rows are sorted by expert. Each
timed call runs the product for --layers independent layers (own weights, own routing) inside one jitted program, as
a decode step does: no weight is read twice, so the experts in use do not stay in the 50 MB L2 cache between calls,
and dispatch costs nothing per product. Reported time = median (kda_kernels.time_jax) / layers. Times the Pallas
kernel (and, up to 64 rows, where it runs its vector-matrix `rows` grid, its `tiles` grid too), ragged_dot (up to
512 rows: it reads every expert) and gather (up to 512 rows: it materializes one [K, N] matrix per row) on the
gate/up shape (K 2304 -> N 1024) and the down shape (K 1024 -> N 2304); reports the weight bytes of the experts in
use / time; checks every implementation against the fp32 gather oracle on the first layer (relative L2 <= 1e-2).
Then the MoE's SiLU(gate) * up as one call returning both products and XLA's activation vs the same call with glu (the
activation in the kernel on the `tiles` grid, one output; the `rows` grid launches once per array) vs, up to 16 rows,
the `rows` grid in one launch (rows_one_launch: each program multiplies its row by both arrays and applies the
activation; with --sweep, over its tile options). Then the dense projections of a decode step (q/k/v, o, shared expert,
lm_head) at --dense-rows rows: jnp.dot against the same kernel with one group (pallas_gmm.dense_matmul, config
`dense_matmul`). --sweep instead times the Pallas kernel's tile options (grid, block_n, block_k, split_k, num_warps) per
shape and token count, and the dense kernel's (block_k, block_n, least programs), and prints the fastest. --profile
lists each timed program's top device kernels (jax.profiler; XLA runs small programs as CUDA graphs, which a trace shows
as one op: set XLA_FLAGS=--xla_gpu_enable_command_buffer= for the kernels).
Writes grouped_matmul.json.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import shutil
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.kda_kernels import rel_l2, time_jax  # noqa: E402
from MaxText.kernels.grouped_matmul import glu_output, pallas_gmm  # noqa: E402
from MaxText.kernels.grouped_matmul.naive import gather_matmul  # noqa: E402

EXPERTS, TOP_K, EMB, WIDTH = 256, 8, 2304, 1024
# The dense projections of a decode step (config `dense_matmul`): name, K, N.
DENSE_SHAPES = (("kda q/k/v_proj", EMB, 4096), ("kda o_proj", 4096, EMB), ("kda f_b/g_b_proj", 128, 4096),
                ("kda b_proj", EMB, 32), ("shared gate/up", EMB, WIDTH), ("shared down", WIDTH, EMB),
                ("lm_head", EMB, 163840))
XLA_MAX_ROWS = 512  # ragged_dot and gather are timed up to this many rows
ORACLE_CHUNK = 256  # rows per gather of the oracle
# --sweep: the `rows` grid (rowwise_max_rows=64; timed up to 64 rows) and the `tiles` grid (0) over tile options
# (block_k is at most 128: pallas_gmm.BLOCK_CHOICES), then the `rows` grid with rows_mma (each row a 16-row
# tensor-core tile, the weight loads pipelined by Triton: cp.async stages in the offline SASS).
SPLITS = (1, 2, 3, 4, 6)  # K splits; those that do not divide a shape's K blocks are skipped
SWEEP = [dict(rowwise_max_rows=64, block_n=bn, block_k=bk, split_k=sk) for bn in (32, 64, 128) for bk in (64, 128)
         for sk in SPLITS] + [dict(rowwise_max_rows=0, block_n=bn, block_k=bk, split_k=sk) for bn in (32, 64, 128)
                              for bk in (64, 128) for sk in SPLITS] + [
    dict(rowwise_max_rows=rmr, block_n=64, block_k=128, split_k=2, num_warps=nw) for rmr in (64, 0) for nw in (2, 8)] + [
    dict(rowwise_max_rows=64, rows_mma=True, block_n=bn, block_k=128, split_k=sk, num_stages=st)
    for bn in (32, 64, 128) for sk in (1, 2, 3, 6) for st in (3, 4)]  # the rows grid on the tensor cores
# --sweep, the MoE's gate and up in one `rows` launch with SiLU(gate) * up (rows_one_launch, glu): each program both
# arrays' column block.
GLU_SWEEP = [dict(rows_mma=True, block_n=bn, block_k=128, split_k=sk, num_stages=st) for bn in (16, 32, 64)
             for sk in (1, 2, 3) for st in (3, 4)] + [
    dict(rows_mma=False, block_n=bn, block_k=128, split_k=sk, num_warps=nw) for bn in (32, 64) for sk in (1, 2, 3)
    for nw in (2, 4)]
# --sweep, dense projections: pallas_gmm.dense_matmul's tile options (min_programs 1: K never split, no partial sums
# to add), then its `rows` grid.
DENSE_SWEEP = [dict(block_k=bk, block_n=bn, min_programs=mp) for bk in (64, 128) for bn in (32, 64, 128)
               for mp in (1, 128, 256, 512)] + [dict(grid="rows", block_k=bk, block_n=bn, min_programs=mp)
                                             for bk in (64, 128) for bn in (32, 64) for mp in (256, 512)]


def random_weights(seed: int, count: int, shape: tuple[int, ...]) -> list[jax.Array]:
    """`count` bf16 weight arrays of `shape` (contraction on axis -2), N(0, 1 / K), made on the device."""
    return [(jax.random.normal(k, shape) / np.sqrt(shape[-2])).astype(jnp.bfloat16)
            for k in jax.random.split(jax.random.key(seed), count)]


def routed_rows(rng, tokens: int, contract: int, layers: int, pool: int = EXPERTS, per_token: int = TOP_K):
    """Per layer, sorted rows of `tokens` tokens x `per_token` (top-8) distinct experts drawn uniformly from a random
    `pool` of the experts (all of them: uniform routing; fewer: the concentrated routing a trained router shows):
    lists of rows [M, K] bf16, group_sizes [E], row groups [M]; and the distinct experts in use per layer (mean)."""
    rows, sizes, groups, used = [], [], [], []
    for _ in range(layers):
        candidates = rng.choice(EXPERTS, pool, replace=False)
        experts = np.stack([rng.choice(candidates, per_token, replace=False) for _ in range(tokens)]).reshape(-1)
        row_groups = np.sort(experts).astype(np.int32)
        rows.append(jnp.asarray(rng.normal(size=(row_groups.size, contract)), jnp.bfloat16))
        counts = np.bincount(row_groups, minlength=EXPERTS).astype(np.int32)
        sizes.append(jnp.asarray(counts))
        groups.append(jnp.asarray(row_groups))
        used.append(int((counts > 0).sum()))
    return rows, sizes, groups, float(np.mean(used))


def per_layer(impl):
    """One jitted program (XLA module jit_grouped_layers) applying impl to every layer's own inputs: called with one
    list per argument of impl, each holding that argument for every layer."""
    def grouped_layers(*inputs):
        return [impl(*layer) for layer in zip(*inputs)]
    return jax.jit(grouped_layers)


def time_impls(label: str, impls: dict, inputs: tuple, wants: list, weight_bytes: float, args) -> dict:
    """Times every implementation (per_layer programs over `inputs`, time / --layers) and checks the first layer's
    product(s) against `wants` (relative L2 <= 1e-2). Returns impl -> {us, rel_l2, ok, weight_TBps[,
    kernels_us_per_call]}; options that do not divide the shape (ValueError) are skipped. Prints one line (the 5
    fastest with --sweep)."""
    timed = {}
    for impl, fn in impls.items():
        program = per_layer(fn)
        try:
            got = program(*inputs)[0]
        except ValueError as e:  # a sweep option that does not divide this shape
            print(f"  skip {impl}: {e}")
            continue
        err = max(rel_l2(g, w) for g, w in zip(got if isinstance(got, tuple) else (got,), wants))
        seconds = time_jax(program, *inputs) / args.layers
        timed[impl] = {"us": seconds * 1e6, "rel_l2": err, "ok": err <= 1e-2,
                       "weight_TBps": weight_bytes / seconds / 1e12}
        if args.profile:
            timed[impl]["kernels_us_per_call"] = kernel_profile(program, inputs)
            print(f"  {label} {impl} kernels (us per call of {args.layers} layers): "
                  + "; ".join(f"{op} {us:.1f}" for op, us in timed[impl]["kernels_us_per_call"]), flush=True)
    shown = sorted(timed, key=lambda impl: timed[impl]["us"])[:5] if args.sweep else timed
    print(f"  {label}: " + ", ".join(f"{impl} {timed[impl]['us']:.1f} us ({timed[impl]['weight_TBps']:.2f} TB/s, "
                                     f"err {timed[impl]['rel_l2']:.1e})" for impl in shown), flush=True)
    return timed


def kernel_profile(fn, args, calls: int = 3, top: int = 6) -> list[tuple[str, float]]:
    """The device kernels of `calls` calls of fn (a per_layer program) under jax.profiler: the `top` HLO ops by
    time, as (op: kernel, microseconds per call)."""
    from benchmarks.model_decode import device_op_times, read_trace  # pylint: disable=import-outside-toplevel
    trace_dir = tempfile.mkdtemp(prefix="grouped_matmul_")
    try:
        with jax.profiler.trace(trace_dir):
            jax.block_until_ready([fn(*args) for _ in range(calls)])
        times = device_op_times(read_trace(trace_dir), "jit_grouped_layers",
                                accelerator=jax.default_backend() != "cpu")
    finally:
        shutil.rmtree(trace_dir, ignore_errors=True)
    ranked = sorted(times.nanoseconds.items(), key=lambda item: -item[1])[:top]
    return [(f"{op}: {times.kernels[op][:60]}", ns / calls / 1e3) for op, ns in ranked]


def oracle(rows, weights, row_groups):
    """fp32 gather product over chunks of rows (one [K, N] matrix per row would not fit for long prefills)."""
    pad = -rows.shape[0] % ORACLE_CHUNK
    r = jnp.pad(rows.astype(jnp.float32), ((0, pad), (0, 0))).reshape(-1, ORACLE_CHUNK, rows.shape[1])
    g = jnp.pad(row_groups, (0, pad)).reshape(-1, ORACLE_CHUNK)
    out = jax.lax.map(lambda a: gather_matmul(a[0], weights, a[1], precision=jax.lax.Precision.HIGHEST), (r, g))
    return out.reshape(-1, weights.shape[2])[:rows.shape[0]]


def bench_dense(args, rng) -> list[dict]:
    """The dense projections at --dense-rows rows: XLA's jnp.dot against the Pallas kernel with one group
    (pallas_gmm.dense_matmul; with --sweep, its DENSE_SWEEP options), --layers independent weights per timed
    program; weight bytes / time."""
    impls = {"xla": lambda x, w: jnp.dot(x, w)}
    if args.sweep:
        impls.update({json.dumps(opts): functools.partial(pallas_gmm.dense_matmul, **opts) for opts in DENSE_SWEEP})
    else:
        impls["pallas"] = pallas_gmm.dense_matmul
    rows_out = []
    for index, (name, contract, out_dim) in enumerate(DENSE_SHAPES):
        kernels = random_weights(100 + index, args.layers, (contract, out_dim))  # [K, N] per layer
        for num_rows in args.dense_rows:
            xs = [jnp.asarray(rng.normal(size=(num_rows, contract)), jnp.bfloat16) for _ in range(args.layers)]
            want = jnp.dot(xs[0].astype(jnp.float32), kernels[0].astype(jnp.float32),
                           precision=jax.lax.Precision.HIGHEST)
            row = {"shape": name, "K": contract, "N": out_dim, "rows": num_rows}
            row.update(time_impls(f"dense {name} [{num_rows}, {contract}] x [{contract}, {out_dim}]", impls,
                                  (xs, kernels), [want], contract * out_dim * 2, args))
            rows_out.append(row)
    if not args.sweep:
        print("\n| dense projection | rows | xla us | pallas us | xla weight TB/s | pallas weight TB/s |")
        print("|---|---|---|---|---|---|")
        for r in rows_out:
            print(f"| {r['shape']} ({r['K']} -> {r['N']}) | {r['rows']} | {r['xla']['us']:.1f} | "
                  f"{r['pallas']['us']:.1f} | {r['xla']['weight_TBps']:.2f} | {r['pallas']['weight_TBps']:.2f} |")
    return rows_out


def bench_gate_up_fusion(args, rng) -> list[dict]:
    """An MoE's SwiGLU hidden activation SiLU(rows Wg) * rows Wu (K 2304 -> N 1024 each), per token count: one Pallas
    call with both weight arrays returning both products, then XLA's activation (the MoE before glu), against the
    same call with glu (the `tiles` grid: one kernel reads each row block once for both and applies the activation,
    one output; the `rows` grid: one launch per array, the activation after), against, up to 16 rows, the `rows` grid
    in one launch (rows_one_launch: each program multiplies its row by both arrays' column block and applies the
    activation). With --sweep, the rows grid in one launch over GLU_SWEEP's tile options instead. Each result checked
    against the fp32 oracle; TB/s = weight bytes of both arrays' experts in use / time."""
    weights = random_weights(7, 2 * args.layers, (EXPERTS, EMB, WIDTH))
    gate_up = list(zip(weights[::2], weights[1::2]))  # per layer (gate, up) [E, K, N]
    oracle_weights = [w.astype(jnp.float32) for w in gate_up[0]]
    glu = functools.partial(pallas_gmm.grouped_matmul, glu=True)
    if args.sweep:
        impls = {json.dumps(opts): functools.partial(glu, rows_one_launch=True, **opts) for opts in GLU_SWEEP}
    else:
        impls = {"products + activation": lambda r, w, s, g: glu_output(*pallas_gmm.grouped_matmul(r, w, s, g),
                                                                        r.dtype),  # the MoE before glu
                 "glu": glu,  # at <= ROWWISE_MAX_ROWS rows: one `rows` launch per array, the activation after
                 "one launch": functools.partial(glu, rows_one_launch=True)}
    out = []
    for tokens in args.tokens:
        rows, sizes, groups, used = routed_rows(rng, tokens, EMB, args.layers, args.expert_pool,
                                                args.rows_per_token)
        if args.sweep and rows[0].shape[0] > pallas_gmm.ROWWISE_MAX_ROWS:  # GLU_SWEEP: the rows grid
            continue
        gate, up = (jax.jit(oracle)(rows[0], w, groups[0]) for w in oracle_weights)
        row = {"tokens": tokens, "rows": int(rows[0].shape[0]), "experts_used": used}
        rows_grid = row["rows"] <= pallas_gmm.ROWWISE_MAX_ROWS
        row.update(time_impls(f"gate+up (glu) tokens={tokens} rows={row['rows']}",
                              {name: fn for name, fn in impls.items() if rows_grid or name != "one launch"},
                              (rows, gate_up, sizes, groups), [jax.nn.silu(gate) * up], 2 * used * EMB * WIDTH * 2,
                              args))
        out.append(row)
    if args.sweep:
        return out
    print("\n| gate + up, SiLU(gate) * up | tokens | rows | products, then XLA's activation us | glu us | "
          "glu / products | rows grid, one launch us |")
    print("|---|---|---|---|---|---|---|")
    for r in out:
        print(f"| | {r['tokens']} | {r['rows']} | {r['products + activation']['us']:.1f} | {r['glu']['us']:.1f} | "
              f"{r['glu']['us'] / r['products + activation']['us']:.2f} | "
              + (f"{r['one launch']['us']:.1f} |" if "one launch" in r else "- |"))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 512, 4096])
    parser.add_argument("--layers", type=int, default=4, help="independent layers per timed program")
    parser.add_argument("--sweep", action="store_true", help="time the Pallas kernel's tile options instead")
    parser.add_argument("--dense-rows", type=int, nargs="*", default=[1, 8],
                        help="rows of the dense-projection comparison (none: skip it)")
    parser.add_argument("--expert-pool", type=int, default=EXPERTS,
                        help="route each layer's tokens within this many random experts (default all: uniform; "
                             "e.g. 48 gives batch 8 the ~37 distinct experts the 48B model's routers chose)")
    parser.add_argument("--rows-per-token", type=int, default=TOP_K,
                        help=f"distinct experts (rows) per token (default {TOP_K}, the routed top-k; {TOP_K + 1}: "
                             "the shared expert as one more row, as the 48B batch-1 decode step runs it with "
                             "moe_shared_in_routed)")
    parser.add_argument("--profile", action="store_true", help="also list each program's top device kernels")
    args = parser.parse_args()
    if not 1 <= args.rows_per_token <= args.expert_pool <= EXPERTS:
        parser.error(f"expected 1 <= --rows-per-token <= --expert-pool <= {EXPERTS}, got {args.rows_per_token} and "
                     f"{args.expert_pool}")
    rng = np.random.default_rng(0)
    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "device": jax.devices()[0].device_kind, "jax": jax.__version__, "command": " ".join(sys.argv)}
    print(json.dumps(env), flush=True)
    results = []
    for shape_index, (name, contract, out_dim) in enumerate((("gate/up", EMB, WIDTH), ("down", WIDTH, EMB))):
        weights = random_weights(shape_index, args.layers, (EXPERTS, contract, out_dim))  # [E, K, N] per layer
        weights_f32 = weights[0].astype(jnp.float32)
        for tokens in args.tokens:
            rows, sizes, groups, used = routed_rows(rng, tokens, contract, args.layers, args.expert_pool,
                                                    args.rows_per_token)
            want = jax.jit(oracle)(rows[0], weights_f32, groups[0])
            if args.sweep:
                impls = {json.dumps(opts): functools.partial(pallas_gmm.grouped_matmul, **opts) for opts in SWEEP
                         if opts["rowwise_max_rows"] == 0 or rows[0].shape[0] <= opts["rowwise_max_rows"]}
            else:
                impls = {"pallas": pallas_gmm.grouped_matmul}
                if rows[0].shape[0] <= pallas_gmm.ROWWISE_MAX_ROWS:  # pallas ran its `rows` grid: time `tiles` too
                    impls["pallas_tiles"] = functools.partial(pallas_gmm.grouped_matmul, rowwise_max_rows=0)
                if rows[0].shape[0] <= XLA_MAX_ROWS:
                    impls["ragged_dot"] = lambda r, w, s, g: jax.lax.ragged_dot(r, w, s)
                    impls["gather"] = lambda r, w, s, g: gather_matmul(r, w, g)
            row = {"shape": name, "tokens": tokens, "rows": int(rows[0].shape[0]), "experts_used": used}
            row.update(time_impls(f"{name} tokens={tokens} rows={row['rows']} experts={used:.1f}", impls,
                                  (rows, weights, sizes, groups), [want], used * contract * out_dim * 2, args))
            results.append(row)
    dense = bench_dense(args, rng)
    fusion = bench_gate_up_fusion(args, rng)
    ok = all(timed["ok"] for row in results + dense + fusion for timed in row.values() if isinstance(timed, dict))
    if not args.sweep:
        print("\n| shape | tokens | rows | experts used | pallas us | pallas tiles us | ragged_dot us | gather us | "
              "pallas expert-weight TB/s |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in results:
            cell = lambda impl: f"{r[impl]['us']:.1f}" if impl in r else "-"  # noqa: E731
            print(f"| {r['shape']} | {r['tokens']} | {r['rows']} | {r['experts_used']:.1f} | {cell('pallas')} | "
                  f"{cell('pallas_tiles')} | {cell('ragged_dot')} | {cell('gather')} | "
                  f"{r['pallas']['weight_TBps']:.2f} |")
    print("correctness: all within 1e-2 relative L2" if ok else "CORRECTNESS FAILURE", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "grouped_matmul.json"), "w") as f:
        json.dump({"env": env, "results": results, "dense": dense, "gate_up_fusion": fusion, "ok": ok}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
