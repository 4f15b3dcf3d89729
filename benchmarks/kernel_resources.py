"""Registers, spills and shared memory of our Pallas (Triton) kernels for an H100/H200 (sm_90a), without a GPU.

    python benchmarks/kernel_resources.py [--out DIR] [--triton-python PYTHON] [--only SUBSTRING]

Each kernel variant below is lowered for CUDA on this machine (JAX's Pallas Triton lowering runs on any host) and
its Triton IR written to DIR/<name>.ttir; then a Python with the `triton` package (`--triton-python`, default this
one; `pip install triton` in a separate venv is enough, no GPU needed) compiles each file for sm_90a with the
variant's warps and stages and runs the bundled `ptxas -v` and `nvdisasm`. Printed: registers per thread, spill
stores / loads (bytes per thread), shared memory, the thread blocks per SM those allow (65,536 registers, 227 KiB, 32
blocks, 64 warps; registers allocated per warp in units of 256), and static SASS counts (instructions; global loads
and stores, of them 128-bit ones; tensor-core MMAs; warp shuffles; MUFU.EX2). DIR keeps each .ttir, .ptx, .cubin and
.sass.

A proxy: the pip Triton is not the one inside the GPU machine's jaxlib, whose code generation may differ. Use it to
see register pressure and spills before spending device time (e.g. `scores` at whole-K tiles spills at 255
registers; with 32-channel blocks it does not), not as a measurement of speed.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks.kda_kernels import SCORES_VARIANTS, scores_variant_name  # noqa: E402

H, K, V, TOKENS = 32, 128, 128, 8 * 4096  # the --tune shape of benchmarks/kda_kernels.py
REGISTERS_PER_SM, SHARED_PER_SM, MAX_BLOCKS_PER_SM, MAX_WARPS_PER_SM = 65536, 232448, 32, 64  # sm_90
REGISTER_ALLOCATION_UNIT = 256  # registers are given to a warp in units of this many (sm_90)

COMPILE = r"""
import collections, os, re, subprocess, sys, triton
from triton.backends.compiler import GPUTarget
path, warps, stages = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
kernel = triton.compile(path, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
stem = path[:-len(".ttir")]
open(stem + ".ptx", "w").write(kernel.asm["ptx"])
open(stem + ".cubin", "wb").write(kernel.asm["cubin"])
tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
try:  # the ptxas Triton compiled with (Triton >= 3.9 takes a newer one for sm_90 and up)
    from triton.backends.nvidia.compiler import get_ptxas
    ptxas = get_ptxas(90).path
except (ImportError, TypeError, AttributeError):
    ptxas = os.path.join(tools, "ptxas")
info = subprocess.run([ptxas, "-arch=sm_90a", "-v", stem + ".ptx", "-o", os.devnull],
                      capture_output=True, text=True).stderr
sass = subprocess.run([os.path.join(tools, "nvdisasm"), "-c", stem + ".cubin"], capture_output=True, text=True).stdout
open(stem + ".sass", "w").write(sass)
instruction = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")
ops = collections.Counter(m.group(1) for m in instruction.finditer(sass))
print(f"shared={kernel.metadata.shared} triton={triton.__version__} sass=" +
      ",".join(f"{op}:{n}" for op, n in sorted(ops.items())) + " " + " ".join(info.split()))
"""


def kernel_variants():
    """name -> (num_warps, num_stages, fn, abstract args): the KDA kernels' defaults and the variants
    `kda_kernels.py --tune` and `--sweep` time, the speculative verify, and the batch-1 decode step's other Pallas
    kernels (norms, MoE router and experts, MLA's absorbed query, latent attention and its combine) at the 48B
    model's shapes."""
    from MaxText.kernels.grouped_matmul import pallas_gmm
    from MaxText.kernels.kda import pallas_chunk as pc, pallas_ops
    from MaxText.kernels.mla import pallas_absorb, pallas_decode as mla_decode
    from MaxText.kernels.moe_router import pallas_route
    from MaxText.kernels.rms_norm import pallas_norm
    S, bf, f32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.float32
    q, G, beta = S((TOKENS, H, K), bf), S((TOKENS, H, K), f32), S((TOKENS, H), bf)
    diag_blocks, akk = (S((H, TOKENS, 16), f32),) * 2, S((H, TOKENS, 64), f32)
    one_seq = [S((H, 4096, K), bf)] * 4 + [S((H, 4096, 64), bf), S((H, 64, K), f32), S((1, H, K, V), f32),
                                           S((2,), jnp.int32)]
    decode = (S((64, 2 * H * K + H * V), bf), S((64, H * K), bf), S((64, H), bf), S((H,), f32), S((H * K,), f32),
              S((64, H, K, V), f32), S((64,), jnp.int32))
    variants = {
        "prepare": (4, 1, lambda *a: pc.prepare(*a, None, None, l2norm=True, gate=False), (q, q, G)),
        "diag": (1, 1, lambda *a: pc.diag(*a, scale=0.1), (q, q, G)),
        "wy_inverse": (1, 1, lambda *a: pc.wy_inverse(*a, dtype=bf), (akk, beta)),
    }
    for options in SCORES_VARIANTS:
        variants[scores_variant_name(**options)] = (options["num_warps"], options["num_stages"], lambda *a, o=options: (
            pc.scores(*a, scale=0.1, **o)), (q, q, G, diag_blocks))
    for warps, stages in ((4, 2), (8, 2)):
        variants[f"wu w{warps} stages={stages}"] = (warps, stages, lambda *a, w=warps, s=stages: pc.wu(
            *a, scale=0.1, num_warps=w, num_stages=s), (q, q, G, q, beta, S((H, TOKENS, 64), bf)))
    for block_v in (64, 32, 16):
        variants[f"recurrence bv{block_v} (one sequence)"] = (4, 3, lambda *a, bv=block_v: pc.recurrence(
            *a, out_dtype=jnp.bfloat16, block_v=bv, num_stages=3), one_seq)
    for block_v, warps in ((128, 4), (128, 16), (64, 2), (64, 4), (64, 8), (32, 4)):
        variants[f"packed decode bv{block_v} w{warps}"] = (
            warps, 1, lambda *a, bv=block_v, w=warps: pallas_ops.packed_decode_kda(
                *a, num_heads=H, head_dim=K, kernel="triton", block_v=bv, num_warps=w), decode)
    for tokens, parts in ((1, 18), (64, 1)):  # decode: 18 partial sums of the product (D = 2304)
        variants[f"moe route {tokens} tokens"] = (1, 1, lambda *a: pallas_route.route_logits(
            *a, top_k=8, norm_topk_prob=True, routed_scaling_factor=2.446), (S((parts, tokens, 256), f32),
                                                                             S((256,), f32)))
    variants["moe router product 1 token"] = (4, 1, pallas_gmm.vector_matrix_partials,
                                              (S((1, 2304), f32), S((2304, 256), bf)))
    experts = (S((9, 2304), bf), S((256, 2304, 1024), bf), S((256,), jnp.int32), S((9,), jnp.int32))
    variants["moe experts gate 9 rows, FMAs"] = (4, 3, lambda *a: pallas_gmm.grouped_matmul(
        *a, rows_mma=False), experts)
    variants["moe experts gate 9 rows"] = (4, 3, pallas_gmm.grouped_matmul, experts)  # the default: tensor cores
    variants["moe experts gate 9 rows, shared expert row"] = (4, 3, lambda *a: pallas_gmm.grouped_matmul(
        *a[:4], extra_weights=a[4]), experts + (S((1, 2304, 1024), bf),))
    from MaxText.kernels.grouped_matmul import pallas_rows_out_in
    gate_up_out_in, down_out_in = S((256, 1024, 2304), bf), S((256, 2304, 1024), bf)
    variants["moe experts out_in gate / up 9 rows"] = (pallas_rows_out_in.NUM_WARPS, 1, lambda x, g, u, sg, su, ids: (
        pallas_rows_out_in.grouped_matmul_out_in(x, (g, u), ids, extra_weights=(sg, su), rows_per_token=8, glu=True)), (
        S((1, 2304), bf), gate_up_out_in, gate_up_out_in, S((1, 1024, 2304), bf), S((1, 1024, 2304), bf),
        S((8,), jnp.int32)))
    variants["moe experts out_in down 9 rows"] = (pallas_rows_out_in.NUM_WARPS, 1, lambda h, d, sd, ids: (
        pallas_rows_out_in.grouped_matmul_out_in(h, (d,), ids, extra_weights=(sd,))), (
        S((9, 1024), bf), down_out_in, S((1, 2304, 1024), bf), S((8,), jnp.int32)))
    variants["moe experts out_in gate 64 rows (tiles)"] = (4, 3, lambda *a: pallas_gmm.grouped_matmul(
        *a, weights_out_in=True), (S((64, 2304), bf), gate_up_out_in, S((256,), jnp.int32), S((64,), jnp.int32)))
    verify = [S((1, 4, H, K), bf)] * 3 + [S((1, 4, H, K), f32), S((1, 4, H), bf), S((1, H, K, V), f32)]
    variants["verify 4 tokens"] = (4, 1, lambda *a: pallas_ops.recurrent_kda_checkpoints(
        *a[:5], initial_state=a[5]), verify)
    row, update, norm_scale = S((1, 2304), bf), S((1, 2304), f32), S((2304,), bf)
    variants["rms norm 1 row"] = (4, 1, lambda *a: pallas_norm.rms_norm(*a, 1e-5), (row, norm_scale))
    variants["add rms norm 1 row"] = (4, 1, lambda *a: pallas_norm.add_rms_norm(*a, 1e-5), (row, update, norm_scale))
    variants["moe norm and route 1 token"] = (4, 1, lambda *a: pallas_route.norm_and_route(
        *a, epsilon=1e-5, top_k=8, norm_topk_prob=True, routed_scaling_factor=2.446),
        (row, update, norm_scale, S((2304, 256), bf), S((256,), f32)))
    heads, nope, rope, rank, keys = 32, 128, 64, 512, 4096  # MLA
    variants["mla absorbed query 1 row"] = (pallas_absorb.NUM_WARPS, 1, lambda *a: pallas_absorb.absorb_query(
        *a, None, num_heads=heads, nope=nope, v_dim=V), (S((1, heads * (nope + rope)), bf),
                                                         S((heads * (nope + V), rank), bf)))
    def latent_attention(*a):
        return mla_decode.latent_attention(*a, scale=0.1)
    latent_attention.triton_kernel = "mla_latent_decode"  # (then its runs' combine)
    variants["mla latent attention 1 row"] = (mla_decode.NUM_WARPS, mla_decode.NUM_STAGES, latent_attention, (
        S((1, 1, heads, rank), bf), S((1, 1, heads, rope), bf), S((1, keys, rank + rope), bf), S((1, 1), jnp.int32),
        S((1, keys), jnp.bool_)))
    from MaxText.kernels.kda import pallas_project_decode as project_decode, project_decode as project_reference
    D, W = 2304, 4
    weights = project_reference.ProjectionWeights(
        q=S((H * K, D), bf), k=S((H * K, D), bf), v=S((H * V, D), bf), f_a=S((K, D), bf), g_a=S((K, D), bf),
        b=S((H, D), bf), f_b=S((H * K, K), bf), g_b=S((H * V, K), bf), q_conv=S((W, H * K), bf),
        k_conv=S((W, H * K), bf), v_conv=S((W, H * V), bf))
    variants["kda one-launch decode 1 row"] = (4, project_decode.NUM_STAGES, lambda *a: (
        project_decode.project_and_decode(*a, num_heads=H, head_dim=K, norm_eps=1e-5, out_norm_eps=1e-5)), (
        S((1, D), bf), S((D,), bf), weights, S((1, W - 1, 3 * H * K), bf), S((H,), f32), S((H * K,), f32),
        S((2, H, K, V), f32), S((1,), jnp.int32), S((V,), f32), S(project_decode.counters_shape(H), jnp.int32)))
    runs = 64
    variants["mla combine runs 1 row"] = (4, 1, lambda *a: mla_decode.combine_runs(*a, runs, bf), (
        S((1, runs, heads), f32), S((1, runs, heads), f32), S((1, runs, heads, rank), f32)))
    return variants


def triton_ir(fn, args, kernel: str | None = None) -> str:
    """The Triton IR (text) of a Pallas kernel `fn` lowers to, captured from JAX's Pallas Triton lowering: the kernel
    named `kernel` (its `tt.func`; default: `fn.triton_kernel` where set), else the last one lowered."""
    from jax._src.pallas.triton import pallas_call_registration as registration
    lower = registration.lowering.lower_jaxpr_to_triton_module
    kernel = kernel or getattr(fn, "triton_kernel", None)
    captured = []

    def capture(*a, **kw):
        result = lower(*a, **kw)
        captured.append(str(result.module))
        return result
    registration.lowering.lower_jaxpr_to_triton_module = capture
    jax.clear_caches()  # a cached lowering would not call it
    try:
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    finally:
        registration.lowering.lower_jaxpr_to_triton_module = lower
    if kernel:
        captured = [ir for ir in captured if f"tt.func public @{kernel}(" in ir]
    if not captured:
        raise RuntimeError(f"no Pallas Triton kernel{f' named {kernel!r}' if kernel else ''} was lowered")
    return captured[-1]


def resources(line: str, warps: int) -> dict:
    """Parses the compile step's one-line report into numbers, with the blocks per SM they allow."""
    number = lambda pattern: int(m.group(1)) if (m := re.search(pattern, line)) else 0  # noqa: E731
    out = {"registers": number(r"Used (\d+) registers"), "spill_stores": number(r"(\d+) bytes spill stores"),
           "spill_loads": number(r"(\d+) bytes spill loads"), "shared": number(r"shared=(\d+)")}
    sass = dict((op, int(n)) for op, n in re.findall(r"([A-Z][A-Z0-9_.]*):(\d+)", m.group(1))) if (
        m := re.search(r"sass=(\S*)", line)) else {}
    family = lambda *prefixes: sum(n for op, n in sass.items() if op.startswith(prefixes))  # noqa: E731
    loads = {op: n for op, n in sass.items() if re.match(r"LDG(STS)?\.E", op)}  # plain and async (to shared) copies
    out["sass"] = {"instructions": sum(sass.values()), "global_loads": sum(loads.values()),
                   "global_loads_128": sum(n for op, n in loads.items() if ".128" in op),
                   "global_stores": family("STG.E"), "global_stores_128": family("STG.E.128"),
                   "mma": family("HMMA", "HGMMA"), "shuffles": family("SHFL"), "exp2": family("MUFU.EX2")}
    per_warp = -(-max(1, out["registers"]) * 32 // REGISTER_ALLOCATION_UNIT) * REGISTER_ALLOCATION_UNIT
    limits = [REGISTERS_PER_SM // per_warp // warps, MAX_BLOCKS_PER_SM, MAX_WARPS_PER_SM // warps]
    out["blocks_per_sm"] = min(limits + ([SHARED_PER_SM // out["shared"]] if out["shared"] else []))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="kernel_resources")
    parser.add_argument("--triton-python", default=sys.executable, help="a python with the triton package")
    parser.add_argument("--only", default="", help="variants whose name contains this")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    print("| kernel | warps | stages | registers | spill stores / loads (B) | shared (B) | blocks / SM "
          "| SASS instructions | global loads (128-bit) | global stores (128-bit) | MMA | shuffles | MUFU.EX2 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, (warps, stages, fn, fn_args) in kernel_variants().items():
        if args.only not in name:
            continue
        path = os.path.join(args.out, re.sub(r"[^A-Za-z0-9_.=-]+", "_", name) + ".ttir")
        with open(path, "w") as f:
            f.write(triton_ir(fn, fn_args))
        done = subprocess.run([args.triton_python, "-c", COMPILE, path, str(warps), str(stages)],
                              capture_output=True, text=True)
        if done.returncode:
            print(f"| {name} | {warps} | {stages} | compile failed: {done.stderr.strip()[-200:]} |" + " |" * 9)
            continue
        r = resources(done.stdout, warps)
        c = r["sass"]
        print(f"| {name} | {warps} | {stages} | {r['registers']} | {r['spill_stores']} / {r['spill_loads']} | "
              f"{r['shared']} | {r['blocks_per_sm']} | {c['instructions']} | {c['global_loads']} "
              f"({c['global_loads_128']}) | {c['global_stores']} ({c['global_stores_128']}) | {c['mma']} | "
              f"{c['shuffles']} | {c['exp2']} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
