"""Speculative-verify KDA on one GPU: the Pallas verify kernel against the XLA scan, same run, same inputs.

    python3 benchmarks/kda_verify.py --out DIR [--dtype bfloat16] [--sweep] [--interpret]

Verify = T tokens (the drafts + 1) from each row's committed state, every token's post-state written to a checkpoint
buffer [B, T, H, K, V] (fp32 here), the committed state unchanged. Shapes: B in {1, 8, 64}, T in {4, 8}, H=32,
K=V=128, gate and l2norm in the kernel (as the KDA block calls it).
  pallas = pallas_ops.recurrent_kda_checkpoints (pallas_verify.py, a fresh checkpoint buffer);
  pallas ring = pallas_ops.recurrent_kda_ring_checkpoints, what the KDA block runs: the committed state in slot 0
  of a per-row ring of T + 1 fp32 slots, token t's state written in place into slot t + 1 (ring donated; REPEATS
  verifies chained through it); xla = verify.recurrent_kda_checkpoints (scan).
Correctness: fp32 inputs; both against the naive oracle (naive_recurrent_kda: o over all T tokens, and the final
state of each prefix 1..T as token t's checkpoint); max abs error. Bound: 1e-4.
Timing: the method of benchmarks/kda_kernels.py (its `time_jax`, imported): median wall clock per block of
back-to-back calls of one jitted function after a device sync. Verify is microseconds at small B, so one jitted call
runs REPEATS verifies (unrolled, each on slightly different q so none is merged away) and the time per verify is the
call's time / REPEATS. Traffic = committed state read + checkpoints written, per second. Inputs in --dtype
(default bfloat16, as served); the state and checkpoints are fp32.
Prints a table and writes DIR/kda_verify.json. --interpret: a CPU smoke run of this script (tiny shapes, the Pallas
interpreter).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks.kda_kernels import guarded, log, time_jax  # noqa: E402
from MaxText.kernels.kda import naive, pallas_ops, verify  # noqa: E402

SHAPES = [(B, T) for B in (1, 8, 64) for T in (4, 8)]
HEADS, HEAD_DIM = 32, 128
REPEATS = 16
ERROR_BOUND = 1e-4
KERNEL_FLAGS = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True)


def verify_inputs(key, B, T, H, K, dtype):
    """q, k, v, raw gate, beta [B, T, H(, K)] in `dtype`; A_log [H], dt_bias [H*K], committed state fp32."""
    ks = jax.random.split(key, 8)
    normal = lambda i, shape, scale=1.0: (scale * jax.random.normal(ks[i], shape, jnp.float32)).astype(dtype)  # noqa
    return dict(q=normal(0, (B, T, H, K)), k=normal(1, (B, T, H, K)), v=normal(2, (B, T, H, K)),
                g=normal(3, (B, T, H, K), 2.0), beta=jax.nn.sigmoid(normal(4, (B, T, H))),
                A_log=jnp.log(jax.random.uniform(ks[5], (H,), jnp.float32, 1.0, 16.0)),
                dt_bias=jax.random.normal(ks[6], (H * K,), jnp.float32),
                initial_state=0.1 * jax.random.normal(ks[7], (B, H, K, K), jnp.float32))


def as_checkpoints(ring_fn):
    """A ring verify (`recurrent_kda_ring_checkpoints` signature) as a `recurrent_kda_checkpoints` one: a ring of
    T + 1 slots with the committed state in slot 0; token t's state comes back from slot t + 1."""
    def fn(q, k, v, g, beta, *, initial_state, checkpoint_dtype=jnp.float32, **kwargs):
        ring = jnp.zeros((q.shape[0], q.shape[1] + 1) + initial_state.shape[1:], jnp.float32).at[:, 0].set(
            initial_state)
        o, ring = ring_fn(q, k, v, g, beta, state_ring=ring, state_slot=jnp.zeros((q.shape[0],), jnp.int32),
                          **kwargs)
        return o, ring[:, 1:].astype(checkpoint_dtype)
    return fn


def implementations(interpret, sweep):
    """name -> verify fn with the `recurrent_kda_checkpoints` signature. `pallas_ring` is what the KDA block runs:
    the ring verify, in place (timed by `time_ring`)."""
    if not sweep:
        variants = {"pallas": {}}
    else:
        variants = {f"pallas_bv{bv}_w{nw}": dict(block_v=bv, num_warps=nw) for bv in (32, 64, 128) for nw in (4, 8)}
    impls = {name: functools.partial(pallas_ops.recurrent_kda_checkpoints, interpret=interpret, **opts)
             for name, opts in variants.items()}
    impls["pallas_ring"] = as_checkpoints(functools.partial(pallas_ops.recurrent_kda_ring_checkpoints,
                                                            interpret=interpret))
    impls["xla"] = verify.recurrent_kda_checkpoints
    return impls


def varied(inputs, i):
    """The inputs of the i-th of REPEATS timed verifies: q scaled by 1 + i/256, so that XLA finds no common
    subexpression between them."""
    return {**inputs, "q": inputs["q"] * jnp.asarray(1.0 + i * 2.0 ** -8, inputs["q"].dtype)}


def time_ring(x, T, interpret):
    """Seconds per in-place ring verify: REPEATS verifies chained through one donated ring (T + 1 slots, committed
    slot 0), so each reads the committed state and writes T slots of the same buffer, as the KDA block does."""
    B = x["q"].shape[0]
    slot = jnp.zeros((B,), jnp.int32)
    ring_fn = functools.partial(pallas_ops.recurrent_kda_ring_checkpoints, interpret=interpret, **KERNEL_FLAGS)
    inputs = {n: a for n, a in x.items() if n != "initial_state"}

    def run(ring, inputs):
        acc = jnp.float32(0)
        for i in range(REPEATS):
            o, ring = ring_fn(**varied(inputs, i), state_ring=ring, state_slot=slot)
            acc = acc + o[0, -1, 0, 0].astype(jnp.float32)
        return ring, acc
    step = jax.jit(run, donate_argnums=0)
    holder = [jnp.zeros((B, T + 1) + x["initial_state"].shape[1:], jnp.float32).at[:, 0].set(x["initial_state"])]

    def call():
        holder[0], acc = step(holder[0], inputs)
        return acc
    return time_jax(call, blocks=3 if interpret else 7) / REPEATS


def max_errors(fn, x, T):
    """Max abs error of o and of the checkpoints against the naive oracle (fp32 inputs, fp32 checkpoints)."""
    o, ckpt = jax.jit(lambda x: fn(**x, **KERNEL_FLAGS, checkpoint_dtype=jnp.float32))(x)
    per_token = ("q", "k", "v", "g", "beta")
    oracle = jax.jit(lambda x, t: naive.naive_recurrent_kda(  # the first t tokens
        **{n: a[:, :t] if n in per_token else a for n, a in x.items()}, **KERNEL_FLAGS, output_final_state=True),
        static_argnums=1)
    o_ref, _ = oracle(x, T)
    err_ckpt = max(float(jnp.max(jnp.abs(ckpt[:, t] - oracle(x, t + 1)[1]))) for t in range(T))
    return float(jnp.max(jnp.abs(o - o_ref))), err_ckpt


def repeated(fn):
    """One jitted call running REPEATS verifies; returns a scalar that depends on every output."""
    def run(x):
        acc = jnp.float32(0)
        for i in range(REPEATS):  # unrolled: one launch per verify, no while-loop round trips
            o, ckpt = fn(**varied(x, i), **KERNEL_FLAGS, checkpoint_dtype=jnp.float32)
            acc = acc + o[0, -1, 0, 0].astype(jnp.float32) + ckpt[0, -1, 0, 0, 0]
        return acc
    return jax.jit(run)


def benchmark_verify(shapes=SHAPES, heads=HEADS, head_dim=HEAD_DIM, dtype=jnp.bfloat16, interpret=False,
                     sweep=False) -> list[dict]:
    """Per (B, T): each implementation's max abs errors vs naive (fp32 run) and its time per verify (`dtype` run)."""
    rows = []
    for B, T in shapes:
        row = {"B": B, "T": T, "H": heads, "K": head_dim, "dtype": jnp.dtype(dtype).name}
        key = jax.random.PRNGKey(B * 1000 + T)
        x32 = verify_inputs(key, B, T, heads, head_dim, jnp.float32)
        x = verify_inputs(key, B, T, heads, head_dim, dtype)
        traffic = B * heads * head_dim * head_dim * 4 * (1 + T)  # state read + T fp32 checkpoints written
        for name, fn in implementations(interpret, sweep).items():
            row[f"{name}_err_o"], row[f"{name}_err_ckpt"] = max_errors(fn, x32, T)
            row[f"{name}_s"] = (time_ring(x, T, interpret) if name == "pallas_ring"
                                else time_jax(repeated(fn), x, blocks=3 if interpret else 7) / REPEATS)
            row[f"{name}_tbps"] = traffic / row[f"{name}_s"] / 1e12
            log(f"  verify B={B} T={T} {name}: {row[f'{name}_s'] * 1e6:.1f} us, {row[f'{name}_tbps']:.2f} TB/s, "
                f"max abs err o {row[f'{name}_err_o']:.1e}, checkpoints {row[f'{name}_err_ckpt']:.1e}")
        rows.append(row)
    return rows


def print_table(rows):
    log(f"\n## verify (H={rows[0]['H']}, K=V={rows[0]['K']}, {rows[0]['dtype']} inputs, fp32 checkpoints; "
        f"us per verify; max abs error vs naive on fp32 inputs, bound {ERROR_BOUND:g})")
    log("| B | T | pallas | pallas ring (in place) | xla scan | xla/pallas | pallas traffic | ring traffic | "
        "err pallas o / ckpt | err ring o / ckpt | err xla o / ckpt |")
    log("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        p = min((k for k in r if k.startswith("pallas") and k.endswith("_s") and "ring" not in k), key=lambda k: r[k])
        name = p[:-2]
        variant = "" if name == "pallas" else f" ({name})"
        log(f"| {r['B']} | {r['T']} | {r[p] * 1e6:.1f}{variant} | {r['pallas_ring_s'] * 1e6:.1f} | "
            f"{r['xla_s'] * 1e6:.1f} | {r['xla_s'] / r[p]:.1f} | {r[f'{name}_tbps']:.2f} TB/s | "
            f"{r['pallas_ring_tbps']:.2f} TB/s | {r[f'{name}_err_o']:.1e} / {r[f'{name}_err_ckpt']:.1e} | "
            f"{r['pallas_ring_err_o']:.1e} / {r['pallas_ring_err_ckpt']:.1e} | "
            f"{r['xla_err_o']:.1e} / {r['xla_err_ckpt']:.1e} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="q/k/v/gate/beta dtype")
    parser.add_argument("--sweep", action="store_true", help="time block_v x num_warps variants of the Pallas kernel")
    parser.add_argument("--interpret", action="store_true", help="CPU smoke run: tiny shapes, Pallas interpreter")
    args = parser.parse_args()
    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "device": jax.devices()[0].device_kind, "jax": jax.__version__, "python": platform.python_version(),
           "command": " ".join(sys.argv)}
    log(json.dumps(env))
    kwargs = dict(dtype=jnp.dtype(args.dtype), interpret=args.interpret, sweep=args.sweep)
    if args.interpret:
        kwargs.update(shapes=[(1, 2), (2, 3)], heads=2, head_dim=32)
    rows = guarded(benchmark_verify, **kwargs)
    if isinstance(rows, list):
        print_table(rows)
        failed = [(r["B"], r["T"], k) for r in rows for k in r if "_err_" in k and not r[k] <= ERROR_BOUND]
        log(f"correctness: {'all within ' + format(ERROR_BOUND, 'g') if not failed else 'FAILED ' + str(failed)}")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "kda_verify.json")
    with open(path, "w") as fh:
        json.dump({"env": env, "repeats": REPEATS, "error_bound": ERROR_BOUND, "verify": rows}, fh, indent=1)
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
