"""MLA decode attention over the latent cache: the Pallas kernel (MaxText/kernels/mla/pallas_decode.py) against
XLA's einsums and masked softmax (naive.latent_attention, the previous path), on the same inputs in one run.

    python benchmarks/mla_decode.py [--batches 1 8 64] [--context 4096] [--caches 1] [--sweep] [--out DIR]

Shapes: Kimi-Linear-48B's MLA (H 32, kv_lora_rank 512, rope 64), a bf16 cache of `--cache` positions (default 4213,
model_decode.py's) with the first `--context` + 1 valid and the query at position `--context`. Each implementation
is timed as a jitted chain of `--chain` dependent calls (the next call's queries depend on this call's output, so
calls cannot overlap; µs-scale work timed inside one program, the combine of the kernel's runs included), median
of blocks issued back to back (benchmarks/kda_kernels.time_jax); time per call = chain time / chain. Both results
are checked against the oracle at float32 inputs and HIGHEST precision (max abs error; bf16 bound `--tolerance`).
`--caches N` makes the chain's calls take N distinct caches in turn (the default, 1, keeps one cache in L2; 14 stream
from HBM, as the model's layers read theirs). --sweep times the kernel at other block sizes, runs, warps, stages and
query rows per program too (`pallas all rows`: the rows of a batch row in one program). Prints a table,
writes mla_decode.json to --out (default $OUT or .). On CPU the kernel runs under the Pallas interpreter (a smoke
run: `--smoke`).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import sys

import jax
import jax.numpy as jnp

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.kda_kernels import time_jax  # noqa: E402
from MaxText.kernels.mla import naive, pallas_decode  # noqa: E402

NUM_HEADS, RANK, ROPE, NOPE = 32, 512, 64, 128
SMOKE = {"heads": 2, "rank": 32, "rope": 16, "cache": 80, "context": 50}


def random_cache(key, shape) -> jax.Array:
    """A bf16 latent cache [B, S, R + P] of N(0, 0.01) values."""
    return (0.1 * jax.random.normal(key, shape, jnp.float32)).astype(jnp.bfloat16)


def inputs(batch: int, heads: int, rank: int, rope: int, cache: int, context: int, seed: int = 0):
    """(q_latent, q_rope, keys, query_positions, key_valid): bf16 queries and cache, positions <= context valid."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    q_latent = jax.random.normal(ks[0], (batch, 1, heads, rank), jnp.bfloat16)
    q_rope = jax.random.normal(ks[1], (batch, 1, heads, rope), jnp.bfloat16)
    keys = random_cache(ks[2], (batch, cache, rank + rope))
    key_valid = jnp.broadcast_to(jnp.arange(cache)[None, :] <= context, (batch, cache))
    return q_latent, q_rope, keys, jnp.full((batch, 1), context, jnp.int32), key_valid


def chained(fn, length: int):
    """A jitted chain of `length` calls of fn(q_latent, q_rope, keys, ...), each call's queries moved by the previous
    output; keys: one cache [B, S, R + P], or a list of distinct caches that the calls take in turn."""
    def run(q_latent, q_rope, keys, *rest):
        caches = keys if isinstance(keys, list) else [keys]
        out = jnp.zeros_like(q_latent)
        for i in range(length):
            out = fn(q_latent + (1e-3 * out).astype(q_latent.dtype), q_rope, caches[i % len(caches)], *rest)
        return out
    return jax.jit(run)


def distinct_caches(keys: jax.Array, count: int) -> list[jax.Array]:
    """`keys` and count - 1 other caches of its shape (`random_cache`, as `inputs` makes them): a chain over more
    bytes than the L2 cache holds reads them from HBM, as the model's layers read their own caches."""
    return [keys] + [random_cache(jax.random.PRNGKey(100 + i), keys.shape) for i in range(1, count)]


def kernel_settings(sweep: bool, batch: int, cache: int, heads: int = NUM_HEADS):
    """(label, kwargs) of the kernel settings to time: the defaults, and with --sweep other tiles."""
    settings = [("pallas (defaults)", {})]
    if not sweep:
        return settings
    settings.append(("pallas all rows", {"block_h": pallas_decode.padded_rows(heads)}))  # one token's rows
    for block_s, scale_runs, warps, stages in itertools.product((32, 64), (0.5, 1, 2), (4, 8), (2, 3)):
        runs = max(1, int(pallas_decode.default_runs(batch, -(-cache // block_s)) * scale_runs))
        settings.append((f"pallas block_s {block_s} runs {runs} warps {warps} stages {stages}",
                         {"block_s": block_s, "runs": runs, "num_warps": warps, "num_stages": stages}))
    for block_s, scale_runs, warps in itertools.product((16, 32), (1, 2), (2, 4)):  # 16 query rows per program
        runs = max(1, int(pallas_decode.default_runs(batch, -(-cache // block_s)) * scale_runs))
        settings.append((f"pallas block_h 16 block_s {block_s} runs {runs} warps {warps}",
                         {"block_h": 16, "block_s": block_s, "runs": runs, "num_warps": warps}))
    return settings


def run(args) -> list[dict]:
    shapes = SMOKE if args.smoke else {"heads": NUM_HEADS, "rank": RANK, "rope": ROPE, "cache": args.cache,
                                       "context": args.context}
    interpret = jax.default_backend() == "cpu"
    scale = (NOPE + ROPE) ** -0.5
    rows = []
    for batch in args.batches:
        problem = inputs(batch, **shapes)
        oracle = naive.latent_attention(*[a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for a in problem],
                                        scale=scale, precision=jax.lax.Precision.HIGHEST)
        candidates = [("xla (einsums + masked softmax)", functools.partial(naive.latent_attention, scale=scale))]
        candidates += [(label, functools.partial(pallas_decode.latent_attention, scale=scale, interpret=interpret,
                                                 **kwargs))
                       for label, kwargs in kernel_settings(args.sweep, batch, shapes["cache"], shapes["heads"])]
        timed = (problem[0], problem[1], distinct_caches(problem[2], args.caches), *problem[3:])  # every candidate's
        for label, fn in candidates:
            error = float(jnp.max(jnp.abs(jax.jit(fn)(*problem).astype(jnp.float32) - oracle)))
            if error > args.tolerance:
                raise AssertionError(f"B={batch} {label}: max abs error {error:.2e} > {args.tolerance:.0e}")
            seconds = time_jax(chained(fn, args.chain), *timed, blocks=3 if args.smoke else 7) / args.chain
            rows.append({"batch": batch, "implementation": label, "us": seconds * 1e6, "max_abs_error": error,
                         **shapes})
            print(f"B={batch:3d} {label:50s} {seconds * 1e6:9.2f} us  max abs error {error:.2e}", flush=True)
    return rows


def report(rows: list[dict]) -> str:
    lines = ["| batch | implementation | us per call | vs xla | max abs error |", "|---|---|---|---|---|"]
    xla = {r["batch"]: r["us"] for r in rows if r["implementation"].startswith("xla")}
    lines += [f"| {r['batch']} | {r['implementation']} | {r['us']:.2f} | {r['us'] / xla[r['batch']]:.2f} | "
              f"{r['max_abs_error']:.1e} |" for r in rows]
    return "\n".join(lines)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--cache", type=int, default=4213, help="cache positions (max_target_length)")
    parser.add_argument("--context", type=int, default=4096, help="the query's position (positions <= it valid)")
    parser.add_argument("--chain", type=int, default=20, help="dependent calls per timed program")
    parser.add_argument("--caches", type=int, default=1,
                        help="distinct caches the chain's calls take in turn (1: every call reads the same cache, "
                             "L2-resident at 48B shapes; 14 x 4.8 MB streams from HBM as the model's layers do)")
    parser.add_argument("--tolerance", type=float, default=2e-3, help="max abs error vs the float32 oracle")
    parser.add_argument("--sweep", action="store_true", help="time other kernel tiles too")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU: the kernel interpreted)")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args(argv)
    if args.context >= args.cache or min(args.batches) < 1 or args.chain < 1 or args.caches < 1:
        parser.error(f"--context {args.context} must be < --cache {args.cache}; batches, --chain and --caches >= 1")
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    print(f"{jax.devices()[0].device_kind}, JAX {jax.__version__}", flush=True)
    rows = run(args)
    print(report(rows), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "mla_decode.json"), "w") as f:
        json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "argv": sys.argv, "rows": rows},
                  f, indent=1)
    return rows


if __name__ == "__main__":
    main()
