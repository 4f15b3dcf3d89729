"""Chains of batch-1 MoE sublayers as a decode step runs them, by the experts' weight layout and (--sweep) the
launches' options.

    python benchmarks/moe_chain.py [--layers 26] [--pool 16] [--sweep] [--out DIR]

Why: in the 48B batch-1 decode step the MoE sublayer is ~45 of a KDA layer's ~77 µs, its experts' launches stream their
weights at ~80% of the copy bandwidth and the router's launch takes ~7 µs for 1.2 MB (benchmarks/RESULTS.md, issue 8),
and a launch's speed alone differs from its speed in the step's dependent chain. Each layer here is one token's MoE
sublayer with the defaults (`moe_router_in_norm`, `moe_rows_fused_inputs`, `moe_shared_in_routed`): the residual add,
post-attention norm, router product and routing in one launch (`pallas_route.norm_and_route`, 256 experts, its counters
passed along the chain as the decode cache's are), the gate / up launch (8 routed rows + the shared expert's row,
SiLU(gate) * up left to the down launch's loads) and the down launch, then the rows' weighted sum added to the residual.
The router's correction bias makes each layer choose among its own --pool experts, ids 2 ... pool + 1 (the weights
together far larger than the GPU's L2; the ids need no arithmetic before either layout's launches). The chain runs once
per jitted call, with the CUDA-graph order of the decode programs (`decode_graph_scheduling: concurrent`).
Layouts:
  in_out  the routed experts' params as stored today, [E, K, N]; the shared expert's [N, K] (dense_kernel_layout
          out_in) read transposed as the extra group: the production call;
  out_in  every expert stored [N, K] (HF's layout) and read transposed: the routed experts and the shared one as
          extra groups behind one unused group (what a routed-expert param layout [E, N, K] would read).
Time = median seconds per call (kda_kernels.time_jax) / layers. Every chain is checked layer by layer against float32
(HIGHEST) from the same layer input: the norm and the routing as `rms_norm.naive` / `moe_router.naive` compute them,
each expert's rows gathered; max abs error relative to the largest value <= 5e-2 (bf16 rounding). On CPU the kernels
run in interpret mode (a smoke run). Prints one line per chain and writes moe_chain.json.
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
from MaxText.kernels.grouped_matmul import pallas_gmm, silu_glu  # noqa: E402
from MaxText.kernels.moe_router import pallas_route  # noqa: E402
from MaxText.kernels.moe_router.naive import route  # noqa: E402
from MaxText.kernels.rms_norm.naive import add_rms_norm  # noqa: E402

LAYOUTS = ("in_out", "out_in")
NUM_EXPERTS, TOP_K, SCALING = 256, 8, 2.446  # Kimi-Linear-48B's routing
EPSILON = 1e-5
ERROR_BOUND = 5e-2
BF16 = jnp.bfloat16
# --sweep: one launch's options changed at a time from the defaults (pallas_gmm.default_tiles, norm_and_route's)
ROUTER_SWEEP = (dict(num_warps=1), dict(num_warps=2), dict(num_warps=8))
GATE_UP_SWEEP = (dict(block_n=32), dict(block_n=128), dict(num_stages=2), dict(num_stages=4), dict(split_k=3),
                 dict(num_warps=8), dict(rows_mma=False), dict(rows_one_launch=True))
DOWN_SWEEP = (dict(block_n=32), dict(block_n=128), dict(num_stages=2), dict(num_stages=4), dict(split_k=2),
              dict(rows_mma=False))


def make_layer(key, dim: int, inner: int, pool: int) -> dict:
    """One layer's params, bf16 N(0, 1 / K) matrices: the experts (the shared one and `pool` routed ones, stored both
    ways), the router (256 experts; correction bias +1 on ids 2 ... pool + 1, so that they are the ones chosen), the
    post-attention norm's scale, and the attention output added to the residual before it."""
    keys = jax.random.split(key, 6)
    layer = {}
    for name, (rows, cols), k in zip(("gate", "up", "down"), ((inner, dim), (inner, dim), (dim, inner)), keys):
        out_in = (jax.random.normal(k, (1 + pool, rows, cols), jnp.float32) / np.sqrt(cols)).astype(BF16)
        layer[name] = out_in  # [1 + pool, N, K]: the shared expert, then expert id i at i - 1
        layer[name + "_shared"] = out_in[:1].copy()  # [1, N, K]
        # [2 + pool, K, N]: expert id i at i (ids 0 and 1, never chosen, hold copies of the shared expert)
        layer[name + "_routed"] = jnp.swapaxes(jnp.concatenate([out_in[:1], out_in]), 1, 2).copy()
    layer["router"] = (jax.random.normal(keys[3], (dim, NUM_EXPERTS), jnp.float32) / np.sqrt(dim)).astype(BF16)
    chosen = (jnp.arange(NUM_EXPERTS) >= 2) & (jnp.arange(NUM_EXPERTS) < pool + 2)
    layer["bias"] = jnp.where(chosen, 1.0, 0.0).astype(jnp.float32)
    layer["scale"] = (1.0 + 0.1 * jax.random.normal(keys[4], (dim,))).astype(BF16)
    layer["update"] = jax.random.normal(keys[5], (1, dim)).astype(BF16)
    return layer


def experts(h, layer, ids, weights, layout: str, gate_up: dict, down: dict, interpret: bool) -> jax.Array:
    """h [1, D], ids / weights [k] -> the token's experts' weighted sum [1, D] bf16 (the shared row added)."""
    if layout == "in_out":
        matrices = (layer["gate_routed"], layer["up_routed"], layer["down_routed"])
        extras = (layer["gate_shared"], layer["up_shared"], layer["down_shared"])
        groups = ids
    elif layout == "out_in":  # one unused group: expert id i is extra matrix i - 1, the shared row's extra matrix 0
        dim, inner = h.shape[1], layer["gate"].shape[1]
        matrices = (jnp.zeros((1, dim, inner), BF16),) * 2 + (jnp.zeros((1, inner, dim), BF16),)
        extras = (layer["gate"], layer["up"], layer["down"])
        groups = ids
    else:
        raise ValueError(f"layout {layout!r}: expected one of {LAYOUTS}")
    sizes = jnp.zeros((matrices[0].shape[0],), jnp.int32)  # (the rows grid reads the groups, not the sizes)
    common = dict(extra_out_in=True, interpret=interpret)
    hidden = pallas_gmm.grouped_matmul(h, matrices[:2], sizes, groups, glu=True, rows_per_token=TOP_K,
                                       partial_rows=True, extra_weights=extras[:2], **common, **gate_up)
    out = pallas_gmm.grouped_matmul(hidden, matrices[2], sizes, groups, extra_weights=extras[2], **common,
                                    **down)  # [9, D]
    total = jnp.einsum("kd,k->d", out[:TOP_K].astype(jnp.float32), weights) + out[TOP_K].astype(jnp.float32)
    return total[None].astype(BF16)


def chain(layout: str, router: dict, gate_up: dict, down: dict, interpret: bool):
    """(x [1, D], layers, counts [1] int32 zeros) -> every layer's input and the last output [L + 1, D]."""
    def run(x, layers, counts):
        inputs = [x]
        for layer in layers:
            normed, summed, weights, ids, counts = pallas_route.norm_and_route(
                x, layer["update"], layer["scale"], layer["router"], layer["bias"], epsilon=EPSILON, top_k=TOP_K,
                norm_topk_prob=True, routed_scaling_factor=SCALING, counts=counts, interpret=interpret, **router)
            x = summed + experts(normed, layer, ids[0], weights[0], layout, gate_up, down, interpret)
            inputs.append(x)
        return jnp.concatenate(inputs)
    return run


def reference_layer(x, layer) -> jax.Array:
    """One layer in float32 HIGHEST from its input x [1, D] (bf16): the norm and routing as the oracles compute them
    (the routing's choice from the bf16 norm, as the kernel makes it), the experts from the [N, K] arrays."""
    hi = jax.lax.Precision.HIGHEST
    normed, summed = add_rms_norm(x, layer["update"], layer["scale"], EPSILON)  # bf16 [1, D]
    logits = jnp.dot(normed.astype(jnp.float32), layer["router"].astype(jnp.float32), precision=hi)
    weights, ids = route(jax.nn.sigmoid(logits), layer["bias"], top_k=TOP_K, n_groups=1, top_k_groups=1,
                         norm_topk_prob=True, routed_scaling_factor=SCALING)  # [1, k]
    h = normed[0].astype(jnp.float32)
    rows = jnp.concatenate([ids[0] - 1, jnp.zeros((1,), ids.dtype)])  # indices into [1 + pool]: the shared row last
    gate, up, down = (layer[name].astype(jnp.float32)[rows] for name in ("gate", "up", "down"))  # [9, N, K]
    hidden = silu_glu(jnp.einsum("d,rnd->rn", h, gate, precision=hi), jnp.einsum("d,rnd->rn", h, up, precision=hi))
    out = jnp.einsum("ri,rdi->rd", hidden, down, precision=hi)  # [9, D]
    return summed.astype(jnp.float32) + (weights[0] @ out[:TOP_K] + out[TOP_K])[None]


def chain_error(got: np.ndarray, layers) -> float:
    """got [L + 1, D] (the chain's layer inputs, then its output): the largest relative error of a layer's output
    against `reference_layer` of the chain's own input to it."""
    errors = []
    for i, layer in enumerate(layers):
        want = np.asarray(reference_layer(jnp.asarray(got[i:i + 1], BF16), layer))
        errors.append(float(np.max(np.abs(got[i + 1] - want[0])) / max(np.max(np.abs(want)), 1e-30)))
    return max(errors)


def variants(sweep: bool) -> list[tuple[str, dict, dict, dict]]:
    """(layout, router, gate / up and down options): the defaults per layout, then with --sweep one option changed
    at a time (the router's in both layouts, the experts' in the production one)."""
    plan = [(layout, {}, {}, {}) for layout in LAYOUTS]
    if sweep:
        plan += [(layout, r, {}, {}) for layout in LAYOUTS for r in ROUTER_SWEEP]
        plan += [("in_out", {}, g, {}) for g in GATE_UP_SWEEP] + [("in_out", {}, {}, d) for d in DOWN_SWEEP]
    return plan


def measure(variant, inputs, interpret: bool) -> dict:
    """Times one chain and checks it layer by layer (`chain_error`)."""
    layout, router, gate_up, down = variant
    row = {"layout": layout, "router": router, "gate_up": gate_up, "down": down}
    try:
        compiled = jax.jit(chain(layout, router, gate_up, down, interpret)).lower(*inputs).compile(
            None if interpret else {GRAPH_SCHEDULING_OPTION: "CONCURRENT"})
    except ValueError as e:  # options this shape refuses (e.g. a K split that does not divide its blocks)
        return {**row, "skipped": str(e)}
    except Exception as e:  # noqa: BLE001 -- e.g. a lowering past the GPU's shared memory: the other chains still run
        return {**row, "failed": f"{type(e).__name__}: {e}"}
    error = chain_error(np.asarray(compiled(*inputs), np.float32), inputs[1])
    layers = len(inputs[1])
    return {**row, "us_per_layer": time_jax(compiled, *inputs) / layers * 1e6, "rel_max_error": error,
            "ok": error <= ERROR_BOUND}


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=2304, help="the model's width D (Kimi-Linear-48B: 2304)")
    parser.add_argument("--inner", type=int, default=1024, help="each expert's width I (48B: 1024)")
    parser.add_argument("--layers", type=int, default=26, help="MoE layers in the chain (48B: 26)")
    parser.add_argument("--pool", type=int, default=16, help="distinct routed experts per layer (8-254)")
    parser.add_argument("--sweep", action="store_true", help="also each launch's tile options, one at a time")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args(argv)
    if args.dim % 128 or args.inner % 128 or args.dim < 128 or args.inner < 128:
        parser.error(f"--dim {args.dim} and --inner {args.inner} must be multiples of 128")
    if args.layers < 1 or not TOP_K <= args.pool <= NUM_EXPERTS - 2:
        parser.error(f"--layers {args.layers} must be >= 1 and --pool {args.pool} in [{TOP_K}, {NUM_EXPERTS - 2}]")
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    interpret = jax.default_backend() == "cpu"
    key = jax.random.key(0)
    layers = [make_layer(jax.random.fold_in(key, i), args.dim, args.inner, args.pool) for i in range(args.layers)]
    x = jax.random.normal(jax.random.fold_in(key, args.layers), (1, args.dim)).astype(BF16)
    inputs = (x, layers, jnp.zeros((1,), jnp.int32))
    env = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "argv": sys.argv if argv is None else argv}
    print(json.dumps(env), flush=True)
    rows = []
    os.makedirs(args.out, exist_ok=True)
    for variant in variants(args.sweep):
        row = measure(variant, inputs, interpret)
        rows.append(row)
        layout, router, gate_up, down = variant
        label = (f"{layout:6s} router {router or 'defaults'} gate/up {gate_up or 'defaults'} down "
                 f"{down or 'defaults'}")
        if "skipped" in row or "failed" in row:
            print(f"{label}: {'skipped' if 'skipped' in row else 'FAILED'} ({row.get('skipped', row.get('failed'))})",
                  flush=True)
        else:
            print(f"{label}: {row['us_per_layer']:8.2f} us per layer, chain error {row['rel_max_error']:.1e}",
                  flush=True)
        with open(os.path.join(args.out, "moe_chain.json"), "w") as f:  # after every chain: a cut run keeps them
            json.dump({"env": env, "args": vars(args), "rows": rows}, f, indent=1)
    if not all(r.get("ok", True) for r in rows):
        print(f"CORRECTNESS FAILURE: a chain's error exceeds {ERROR_BOUND}", flush=True)
    return rows


def succeeded(rows: list[dict]) -> bool:
    """Every chain that ran matched float32 and none failed to build (options a shape refuses are skipped)."""
    return all(r.get("ok", True) and "failed" not in r for r in rows)


if __name__ == "__main__":
    sys.exit(0 if succeeded(main()) else 1)
