"""Host time to issue one jitted program of N small kernels, by kernel kind, under this process's XLA_FLAGS.

    python benchmarks/launch_overhead.py [--kernels N] [--calls M] [--kinds xla pallas mixed] [--branches B]
                                         [--graph-scheduling serialize|concurrent|lhs] [--out DIR]

Why: at batch 1 the 48B decode step (~1300 kernels) is bound by the host's time to issue it (benchmarks/RESULTS.md,
issue 8). This isolates the runtime's cost per kernel: each program is a chain of N dependent kernels on a
[8, 128] fp32 array (donated, updated in place), of one kind:
  xla     N elementwise XLA fusions (kept apart by optimization barriers);
  pallas  N Pallas (Triton lowering) kernels;
  mixed   N / 2 of each, alternating (an XLA fusion between Pallas calls, as in the model).
--branches B splits the N kernels into B independent chains of N / B kernels, each on its own array (a DAG of B
branches, as a decode step's independent projections are), and --graph-scheduling compiles the program with that
CUDA-graph order (`decode_graph_scheduling`'s XLA option; default serialize, XLA's own). The 48B step's graph launch
takes ~2 us per kernel on the host (a DAG, concurrent order); an H200 host issued 1024 kernels here at 0.1-0.3 us
each as one chain or as 8 or 64 branches, either order (benchmarks/RESULTS.md, thirteenth session).
Per kind: `issue` = host time per call while M calls are issued back to back (median of 5 blocks), `wall` = wall
time per call including the final sync, both also per kernel; and the result is checked (x + N / B in every branch
after one call).
XLA_FLAGS are read at start-up: run once per setting, e.g. `XLA_FLAGS=--xla_gpu_enable_command_buffer=` (no CUDA
graphs). Prints one line per kind and writes launch_overhead.json to --out (default $OUT or .).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from MaxText.inference.compile_options import GRAPH_SCHEDULING_CHOICES, GRAPH_SCHEDULING_OPTION  # noqa: E402

KINDS = ("xla", "pallas", "mixed")


def _add_one_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1.0


def pallas_add_one(x, interpret):
    return pl.pallas_call(_add_one_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          input_output_aliases={0: 0}, interpret=interpret, name="launch_probe")(x)


def xla_add_one(x):
    return jax.lax.optimization_barrier(x + 1.0)


def chain(kind: str, kernels: int, interpret: bool, branches: int = 1, scheduling: str = "serialize"):
    """A jitted (x_1 .. x_branches) -> (x_b + kernels / branches) made of `branches` independent chains of
    kernels / branches dependent kernels of `kind`, the arrays donated, compiled with CUDA-graph order
    `scheduling`."""
    steps = {"xla": [xla_add_one] * kernels,
             "pallas": [lambda x: pallas_add_one(x, interpret)] * kernels,
             "mixed": [xla_add_one if i % 2 else (lambda x: pallas_add_one(x, interpret)) for i in range(kernels)]}
    if kind not in steps:
        raise ValueError(f"kind {kind!r}: expected one of {KINDS}")
    if kernels % branches or scheduling not in GRAPH_SCHEDULING_CHOICES:
        raise ValueError(f"{kernels} kernels in {branches} branches, scheduling {scheduling!r}: expected branches "
                         f"that divide the kernels and one of {GRAPH_SCHEDULING_CHOICES}")

    def run(xs):
        outs = []
        for x in xs:  # independent chains: XLA may run them side by side
            for step in steps[kind][:kernels // branches]:
                x = step(x)
            outs.append(x)
        return tuple(outs)
    return jax.jit(run, donate_argnums=0, compiler_options={GRAPH_SCHEDULING_OPTION: scheduling.upper()})


def measure(kind: str, kernels: int, calls: int, blocks: int = 5, branches: int = 1,
            scheduling: str = "serialize") -> dict:
    interpret = jax.default_backend() == "cpu"
    fn = chain(kind, kernels, interpret, branches, scheduling)
    x = tuple(jnp.zeros((8, 128), jnp.float32) for _ in range(branches))
    x = fn(x)
    got = [float(np.asarray(branch)[0, 0]) for branch in x]
    if got != [kernels // branches] * branches:
        raise AssertionError(f"{kind}: one call gave {got}, expected {kernels // branches} in each branch")
    for _ in range(3):
        x = fn(x)
    jax.block_until_ready(x)
    issue, wall = [], []
    for _ in range(blocks):
        start = time.perf_counter()
        for _ in range(calls):
            x = fn(x)
        issue.append((time.perf_counter() - start) / calls)
        jax.block_until_ready(x)
        wall.append((time.perf_counter() - start) / calls)
    issue_s, wall_s = statistics.median(issue), statistics.median(wall)
    return {"kind": kind, "kernels": kernels, "branches": branches, "scheduling": scheduling, "calls": calls,
            "issue_us": issue_s * 1e6, "wall_us": wall_s * 1e6,
            "issue_us_per_kernel": issue_s * 1e6 / kernels, "wall_us_per_kernel": wall_s * 1e6 / kernels}


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernels", type=int, default=256, help="kernels per program (N)")
    parser.add_argument("--calls", type=int, default=50, help="calls issued back to back per timed block (M)")
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--branches", type=int, default=1, help="independent chains the kernels are split into (B)")
    parser.add_argument("--graph-scheduling", default="serialize", choices=GRAPH_SCHEDULING_CHOICES,
                        help="CUDA-graph order of the program (XLA's default: serialize)")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args(argv)
    if args.kernels < 2 or args.calls < 1 or args.branches < 1 or args.kernels % args.branches:
        parser.error(f"--kernels {args.kernels} must be >= 2, --calls {args.calls} >= 1 and --branches "
                     f"{args.branches} >= 1 and divide the kernels")
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    flags = os.environ.get("XLA_FLAGS", "")
    print(f"{jax.devices()[0].device_kind}, JAX {jax.__version__}, XLA_FLAGS={flags!r}", flush=True)
    rows = []
    for kind in args.kinds:
        row = measure(kind, args.kernels, args.calls, branches=args.branches, scheduling=args.graph_scheduling)
        rows.append(row)
        print(f"{kind:7s} {args.kernels} kernels in {args.branches} branch(es), {args.graph_scheduling}: "
              f"issue {row['issue_us']:9.1f} us/call "
              f"({row['issue_us_per_kernel']:.2f} us/kernel), wall {row['wall_us']:9.1f} us/call "
              f"({row['wall_us_per_kernel']:.2f} us/kernel)", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "launch_overhead.json"), "w") as f:
        json.dump({"xla_flags": flags, "device": jax.devices()[0].device_kind, "jax": jax.__version__,
                   "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
