"""Peak memory of the HF -> Orbax converter on a synthetic multi-shard checkpoint of >= 2 GB.

    python end_to_end/convert_memory_check.py [--layout original|native] [--keep DIR]

Builds (in a temp dir) a Kimi-Linear checkpoint with the real model's widths (hidden 2304, KDA 32x128 heads, MLA
32 heads, 1024-wide experts, dense 9216) but few layers and a smaller vocabulary, in bfloat16 with the float32
tensors a real release holds (A_log, dt_bias, router correction bias), split over 4 shards; converts it with
`python -m MaxText.convert_hf_checkpoint` in a subprocess; and compares the child's peak RSS
(ru_maxrss from os.wait4) with the bound 1.5 GB + the largest single tensor. It also checks
a few converted params against the synthetic values. Exits 1 when the bound is exceeded or a value differs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from end_to_end import tiny_hf  # noqa: E402  pylint: disable=wrong-import-position
from MaxText import hf_weights  # noqa: E402  pylint: disable=wrong-import-position

GIB = 1024 ** 3
BOUND_BASE_BYTES = 1.5e9  # the allowed peak RSS is this plus the largest single tensor
FLOAT32_SUFFIXES = ("A_log", "dt_bias", "e_score_correction_bias")

# Real Kimi-Linear-48B widths; 4 layers (KDA+dense, KDA+MoE, MLA+MoE, KDA+MoE) and 64 experts keep it near 3 GB.
WIDE_HF_KWARGS = dict(
    vocab_size=65536, hidden_size=2304, intermediate_size=9216, moe_intermediate_size=1024, num_hidden_layers=4,
    num_attention_heads=32, num_key_value_heads=32, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, num_local_experts=64, num_experts_per_tok=8, n_shared_experts=1, n_group=1,
    topk_group=1, linear_num_heads=32, linear_head_dim=128, linear_conv_kernel_dim=4,
    layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
)


def synthetic_value(name: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """Deterministic per-tensor values (a seeded random block tiled to the shape; cheap for GBs)."""
    seed = sum(name.encode()) * 7919 + len(name)
    block = np.random.default_rng(seed).standard_normal(min(1 << 20, int(np.prod(shape)))).astype(np.float32)
    reps = -(-int(np.prod(shape)) // block.size)
    return np.tile(block, reps)[: int(np.prod(shape))].reshape(shape).astype(dtype)


def hf_tensor_shapes(config: dict, layout: str) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor of a checkpoint of `config` in `layout` ('original' | 'native'): the first
    spec of that layout for each of our leaves (dense layers under `mlp.`, as in the release)."""
    shapes, covered = {}, set()
    for name, spec in hf_weights.hf_tensor_specs(config).items():
        if spec.layout in ("any", layout) and not covered.intersection(spec.targets):
            shapes[name] = spec.shapes[0]
            covered.update(spec.targets)
    return shapes


def write_safetensors(file: str, tensors: dict[str, tuple[tuple[int, ...], np.dtype]]) -> None:
    """Writes a safetensors file tensor by tensor (the header first), never holding more than one tensor."""
    names = {np.dtype(np.float32): "F32", np.dtype(ml_dtypes.bfloat16): "BF16"}
    header, offset = {}, 0
    for name, (shape, dtype) in tensors.items():
        nbytes = int(np.prod(shape)) * dtype.itemsize
        header[name] = {"dtype": names[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with open(file, "wb") as f:
        f.write(len(blob).to_bytes(8, "little") + blob)
        for name, (shape, dtype) in tensors.items():
            f.write(synthetic_value(name, shape, dtype).tobytes())


def build_checkpoint(directory: str, layout: str, num_shards: int = 4) -> tuple[dict, int, int]:
    """Writes config.json + shards + index; returns (our config keys, total bytes, largest tensor bytes)."""
    hf_config = tiny_hf.tiny_hf_config(**WIDE_HF_KWARGS)
    config_json = hf_config.to_dict() if layout == "native" else tiny_hf.original_config_json(hf_config.to_dict())
    config_json["dtype"] = "bfloat16"
    config = hf_weights.config_from_hf(config_json)
    shapes = hf_tensor_shapes(config, layout)
    dtypes = {n: np.dtype(np.float32 if n.endswith(FLOAT32_SUFFIXES) else ml_dtypes.bfloat16) for n in shapes}
    sizes = {n: int(np.prod(s)) * dtypes[n].itemsize for n, s in shapes.items()}
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config_json, f)
    files = [f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors" for i in range(num_shards)]
    # Round-robin by name: the experts of one layer spread over every shard.
    assignment = {name: files[i % num_shards] for i, name in enumerate(sorted(shapes))}
    for file in files:
        write_safetensors(os.path.join(directory, file),
                          {n: (shapes[n], dtypes[n]) for n in sorted(shapes) if assignment[n] == file})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": sum(sizes.values())}, "weight_map": assignment}, f)
    return config, sum(sizes.values()), max(sizes.values())


def spot_check(out: str, layout: str) -> list[str]:
    """Compares a few converted params with the synthetic HF values they came from (loads the whole checkpoint)."""
    from MaxText import checkpointing, pyconfig  # pylint: disable=import-outside-toplevel
    bf16 = np.dtype(ml_dtypes.bfloat16)
    config = pyconfig.load_config(os.path.join(out, checkpointing.CONFIG_FILE))
    params = checkpointing.load_params(out, config)
    model = params["params"]["model"]
    lm_head = synthetic_value("lm_head.weight", (65536, 2304), bf16)  # [out, in]: as stored with out_in kernels
    gate = "" if layout == "original" else "forget_gate."
    if layout == "original":
        w2 = synthetic_value("model.layers.3.block_sparse_moe.experts.17.w2.weight", (2304, 1024), bf16)
    else:
        w2 = synthetic_value("model.layers.3.mlp.experts.down_proj", (64, 2304, 1024), bf16)[17]
    checks = {
        "embed_tokens": (model["embed_tokens"]["embedding"],
                         synthetic_value("model.embed_tokens.weight", (65536, 2304), bf16)),
        "lm_head": (params["params"]["lm_head"]["kernel"],
                    lm_head if config.dense_kernel_layout == "out_in" else lm_head.T),
        "layers_1 A_log (float32 in the checkpoint, stored bfloat16)": (
            model["layers_1"]["self_attn"]["A_log"],
            synthetic_value(f"model.layers.1.self_attn.{gate}A_log", (1, 1, 32, 1), np.dtype(np.float32))
            .reshape(32).astype(bf16)),
        "layers_3 expert 17 down_proj": (model["layers_3"]["mlp"]["experts"]["down_proj"][17], w2.T),
    }
    return [f"{name} differs from the HF tensor" for name, (got, want) in checks.items()
            if not np.array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layout", choices=("original", "native"), default="original")
    parser.add_argument("--keep", default=None, help="build and convert here instead of a temp dir (kept)")
    parser.add_argument("--build-only", default=None, help=argparse.SUPPRESS)  # internal: the builder subprocess
    args = parser.parse_args()
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if args.build_only:
        _, total, largest = build_checkpoint(args.build_only, args.layout)
        print(json.dumps({"total": total, "largest": largest}))
        return 0
    # Linux keeps a process's RSS high-water mark across fork + exec, so this process stays small: the checkpoint is
    # built in one subprocess and converted in another.
    work = args.keep or tempfile.mkdtemp(prefix="convert_memory_check.")
    hf_dir, out = os.path.join(work, "hf"), os.path.join(work, "out")
    start = time.time()
    built = subprocess.run([sys.executable, os.path.abspath(__file__), "--layout", args.layout, "--build-only",
                            hf_dir], cwd=repo, check=True, capture_output=True, text=True)
    sizes = json.loads(built.stdout.strip().splitlines()[-1])
    total, largest = sizes["total"], sizes["largest"]
    print(f"synthetic checkpoint: {args.layout} layout, {total / GIB:.2f} GiB in 4 shards, largest tensor "
          f"{largest / GIB:.3f} GiB (built in {time.time() - start:.0f} s)")
    start = time.time()
    child = subprocess.Popen([sys.executable, "-m", "MaxText.convert_hf_checkpoint", "--hf-path", hf_dir,
                              "--output-dir", out, "--no-progress"], cwd=repo)
    _, status, usage = os.wait4(child.pid, 0)  # the rusage of this child alone
    returncode = os.waitstatus_to_exitcode(status)
    seconds = time.time() - start
    peak = usage.ru_maxrss * 1024  # Linux reports KiB
    bound = BOUND_BASE_BYTES + largest
    print(f"conversion: exit {returncode} in {seconds:.0f} s; peak RSS {peak / 1e9:.3f} GB; bound 1.5 GB + "
          f"largest tensor = {bound / 1e9:.3f} GB -> {'OK' if peak < bound else 'OVER'}")
    problems = [] if returncode == 0 else ["conversion failed"]
    if returncode == 0:
        problems += spot_check(out, args.layout)
        print("spot check:", "; ".join(problems) if problems else "converted values equal the HF tensors")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if peak < bound and not problems else 1


if __name__ == "__main__":
    sys.exit(main())
