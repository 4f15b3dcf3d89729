"""MoE grouped matmul on one GPU: the Pallas kernel against XLA's ragged_dot and the gather path, same run, same
inputs, at Kimi-Linear-48B's expert shapes (256 experts, top-8, emb 2304, expert width 1024, bf16).

    python benchmarks/grouped_matmul.py [--out DIR] [--tokens 1 8 64 512 4096]

For each token count, tokens route to top-8 distinct experts uniformly at random; rows are sorted by expert. Times
(median of back-to-back calls, kda_kernels.time_jax) the Pallas kernel (and, up to 64 rows, where it runs its
vector-matrix `rows` grid, its `tiles` grid too), ragged_dot and gather on the gate/up shape (K 2304 -> N 1024) and the down shape
(K 1024 -> N 2304); reports the weight bytes of the experts in use / time; checks every implementation against the
fp32 gather oracle (computed over chunks of rows; relative L2 <= 1e-2). Gather is timed up to 512 rows (it
materializes one [K, N] matrix per row). Writes grouped_matmul.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.kda_kernels import rel_l2, time_jax  # noqa: E402
from MaxText.kernels.grouped_matmul import pallas_gmm  # noqa: E402
from MaxText.kernels.grouped_matmul.naive import gather_matmul  # noqa: E402

EXPERTS, TOP_K, EMB, WIDTH = 256, 8, 2304, 1024
GATHER_MAX_ROWS = 512
ORACLE_CHUNK = 256  # rows per gather of the oracle


def routed_rows(rng, tokens: int, contract: int):
    """Sorted rows of `tokens` tokens x top-8 distinct uniform experts: rows [M, K] bf16, group_sizes [E], row
    groups [M], distinct experts in use."""
    experts = np.stack([rng.choice(EXPERTS, TOP_K, replace=False) for _ in range(tokens)]).reshape(-1)
    row_groups = np.sort(experts).astype(np.int32)
    rows = jnp.asarray(rng.normal(size=(row_groups.size, contract)), jnp.bfloat16)
    sizes = np.bincount(row_groups, minlength=EXPERTS).astype(np.int32)
    return rows, jnp.asarray(sizes), jnp.asarray(row_groups), int((sizes > 0).sum())


def oracle(rows, weights, row_groups):
    """fp32 gather product over chunks of rows (one [K, N] matrix per row would not fit for long prefills)."""
    pad = -rows.shape[0] % ORACLE_CHUNK
    r = jnp.pad(rows.astype(jnp.float32), ((0, pad), (0, 0))).reshape(-1, ORACLE_CHUNK, rows.shape[1])
    g = jnp.pad(row_groups, (0, pad)).reshape(-1, ORACLE_CHUNK)
    out = jax.lax.map(lambda a: gather_matmul(a[0], weights, a[1], precision=jax.lax.Precision.HIGHEST), (r, g))
    return out.reshape(-1, weights.shape[2])[:rows.shape[0]]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 512, 4096])
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "device": jax.devices()[0].device_kind, "jax": jax.__version__, "command": " ".join(sys.argv)}
    print(json.dumps(env), flush=True)
    results, ok = [], True
    for name, contract, out_dim in (("gate/up", EMB, WIDTH), ("down", WIDTH, EMB)):
        weights = jnp.asarray(rng.normal(size=(EXPERTS, contract, out_dim)) / np.sqrt(contract), jnp.bfloat16)
        weights_f32 = weights.astype(jnp.float32)
        for tokens in args.tokens:
            rows, sizes, row_groups, used = routed_rows(rng, tokens, contract)
            want = jax.jit(oracle)(rows, weights_f32, row_groups)
            impls = {"pallas": jax.jit(lambda r, w, s, g: pallas_gmm.grouped_matmul(r, w, s, g))}
            if rows.shape[0] <= pallas_gmm.ROWWISE_MAX_ROWS:  # pallas ran its `rows` grid: time `tiles` as well
                impls["pallas_tiles"] = jax.jit(lambda r, w, s, g: pallas_gmm.grouped_matmul(r, w, s, g,
                                                                                             rowwise_max_rows=0))
            impls["ragged_dot"] = jax.jit(lambda r, w, s, g: jax.lax.ragged_dot(r, w, s))
            if rows.shape[0] <= GATHER_MAX_ROWS:
                impls["gather"] = jax.jit(lambda r, w, s, g: gather_matmul(r, w, g))
            weight_bytes = used * contract * out_dim * 2
            row = {"shape": name, "tokens": tokens, "rows": int(rows.shape[0]), "experts_used": used}
            for impl, fn in impls.items():
                err = rel_l2(fn(rows, weights, sizes, row_groups), want)
                seconds = time_jax(fn, rows, weights, sizes, row_groups)
                ok &= err <= 1e-2
                row[impl] = {"us": seconds * 1e6, "rel_l2": err, "expert_weight_TBps": weight_bytes / seconds / 1e12}
            results.append(row)
            print(f"  {name} tokens={tokens} rows={row['rows']} experts={used}: " + ", ".join(
                f"{impl} {r['us']:.1f} us ({r['expert_weight_TBps']:.2f} TB/s, err {r['rel_l2']:.1e})"
                for impl, r in row.items() if isinstance(r, dict)), flush=True)
    print("\n| shape | tokens | rows | experts used | pallas us | pallas tiles us | ragged_dot us | gather us | "
          "pallas expert-weight TB/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        cell = lambda impl: f"{r[impl]['us']:.1f}" if impl in r else "-"  # noqa: E731
        print(f"| {r['shape']} | {r['tokens']} | {r['rows']} | {r['experts_used']} | {cell('pallas')} | "
              f"{cell('pallas_tiles')} | {cell('ragged_dot')} | {cell('gather')} | "
              f"{r['pallas']['expert_weight_TBps']:.2f} |")
    print("correctness: all within 1e-2 relative L2" if ok else "CORRECTNESS FAILURE", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "grouped_matmul.json"), "w") as f:
        json.dump({"env": env, "results": results, "ok": ok}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
