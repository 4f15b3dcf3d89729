"""Chains of dependent one-row products (a batch-1 decode step's projections), by the kernels' layout.

    python benchmarks/product_chain.py [--dim 3072] [--products 16] [--repeat 4] [--out DIR]

Why: a batch-1 decode step is ~380 dependent launches, and a weight-streaming launch in such a chain reads its
weight well below the copy bandwidth (benchmarks/RESULTS.md, issue 8). Each chain multiplies one bf16 row by
`--products` distinct [dim, dim] bf16 kernels in turn (each product's input is the previous product's output; the
kernels together are larger than the GPU's L2), `--repeat` times over in one jitted program so that the host's
dispatch of the program stays hidden behind the device's work, with the CUDA-graph order of the decode programs
(`decode_graph_scheduling: concurrent`). Implementations:
  pallas   the project's dense kernel (pallas_gmm.dense_matmul; config `dense_matmul: pallas`), kernels [K, N];
  xla_kn   XLA's jnp.dot, kernels [K, N] (the params' layout);
  xla_nk   XLA's jnp.dot, kernels stored [N, K] (each output's weights contiguous: HF's checkpoint layout);
  xla_nk_m2  as xla_nk with the row and a zero row as a [2, K] operand: XLA then emits its GEMM (cuBLAS or a Triton
           GEMM, autotuned) instead of rewriting the one-row product as a reduction fusion.
Time = median seconds per call (kda_kernels.time_jax) / products in the call; bandwidth = weight bytes / time. Every
chain is checked against the same chain in float32 HIGHEST (max abs error relative to the result's largest value,
<= 5e-2: bf16 rounding over the chain). On CPU the Pallas kernel runs in interpret mode (a smoke run). Prints one
line per implementation and writes product_chain.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.kda_kernels import time_jax  # noqa: E402
from MaxText.inference.compile_options import GRAPH_SCHEDULING_OPTION  # noqa: E402
from MaxText.kernels.grouped_matmul import pallas_gmm  # noqa: E402

IMPLEMENTATIONS = ("pallas", "xla_kn", "xla_nk", "xla_nk_m2")
STORED_NK = ("xla_nk", "xla_nk_m2")  # the forms that take the kernels stored [N, K]
ERROR_BOUND = 5e-2


def product(implementation: str, row: jax.Array, kernel: jax.Array, interpret: bool) -> jax.Array:
    """row [K] bf16 times one kernel ([K, N], or [N, K] for STORED_NK) -> [N] bf16."""
    if implementation == "pallas":
        return pallas_gmm.dense_matmul(row[None], kernel, interpret=interpret)[0]
    if implementation == "xla_kn":
        return jnp.dot(row, kernel)
    if implementation == "xla_nk":
        return jnp.dot(kernel, row)
    if implementation == "xla_nk_m2":
        rows = jnp.stack([row, jnp.zeros_like(row)])  # [2, K]
        return jnp.einsum("mk,nk->mn", rows, kernel)[0]
    raise ValueError(f"implementation {implementation!r}: expected one of {IMPLEMENTATIONS}")


def chain(implementation: str, repeat: int, interpret: bool):
    """(row [K], kernels) -> the row multiplied by every kernel in turn, `repeat` times over."""
    def run(row, kernels):
        for _ in range(repeat):
            for kernel in kernels:
                row = product(implementation, row, kernel, interpret)
        return row
    return run


def reference(row: jax.Array, kernels: list[jax.Array], repeat: int) -> np.ndarray:
    """The chain in float32 HIGHEST, kernels [K, N]."""
    out = row.astype(jnp.float32)
    for _ in range(repeat):
        for kernel in kernels:
            out = jnp.dot(out, kernel.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return np.asarray(out)


def measure(implementation: str, row, kernels, kernels_nk, repeat: int, want: np.ndarray) -> dict:
    """Times one implementation's chain and checks it against `want` (the `reference` chain)."""
    interpret = jax.default_backend() == "cpu"
    weights = kernels_nk if implementation in STORED_NK else kernels
    compiled = jax.jit(chain(implementation, repeat, interpret)).lower(row, weights).compile(
        {GRAPH_SCHEDULING_OPTION: "CONCURRENT"} if jax.default_backend() == "gpu" else None)
    got = np.asarray(compiled(row, weights), np.float32)
    error = float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))
    products = repeat * len(kernels)
    seconds = time_jax(compiled, row, weights) / products
    weight_bytes = kernels[0].size * kernels[0].dtype.itemsize
    return {"implementation": implementation, "products": products, "us_per_product": seconds * 1e6,
            "weight_TBps": weight_bytes / seconds / 1e12, "rel_max_error": error, "ok": error <= ERROR_BOUND}


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=3072, help="K = N of every kernel (3072: 18.9 MB in bf16)")
    parser.add_argument("--products", type=int, default=16, help="distinct kernels in the chain")
    parser.add_argument("--repeat", type=int, default=4, help="times the chain runs over them in one call")
    parser.add_argument("--implementations", nargs="+", default=list(IMPLEMENTATIONS), choices=IMPLEMENTATIONS)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args(argv)
    if args.dim < 16 or args.dim % 16 or args.products < 1 or args.repeat < 1:
        parser.error(f"--dim {args.dim} must be a multiple of 16 (>= 16), --products {args.products} and --repeat "
                     f"{args.repeat} >= 1")
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    key = jax.random.key(0)
    # N(0, 1 / K): the row keeps its scale along the chain.
    kernels = [(jax.random.normal(k, (args.dim, args.dim)) / np.sqrt(args.dim)).astype(jnp.bfloat16)
               for k in jax.random.split(key, args.products)]
    kernels_nk = [kernel.T.copy() for kernel in kernels]  # the same kernels stored [N, K]
    row = jax.random.normal(jax.random.fold_in(key, 1), (args.dim,)).astype(jnp.bfloat16)
    env = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "argv": sys.argv if argv is None else argv}
    print(json.dumps(env), flush=True)
    want = reference(row, kernels, args.repeat)
    rows = []
    for implementation in args.implementations:
        result = measure(implementation, row, kernels, kernels_nk, args.repeat, want)
        rows.append(result)
        print(f"{implementation:9s} {result['us_per_product']:8.2f} us per product ({result['weight_TBps']:.2f} TB/s "
              f"of weights), chain error {result['rel_max_error']:.1e}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "product_chain.json"), "w") as f:
        json.dump({"env": env, "dim": args.dim, "rows": rows}, f, indent=1)
    if not all(r["ok"] for r in rows):
        print(f"CORRECTNESS FAILURE: a chain's error exceeds {ERROR_BOUND}", flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(0 if all(r["ok"] for r in main()) else 1)
