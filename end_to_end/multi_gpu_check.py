"""Sharded decode on several GPUs equals one GPU: logits and greedy tokens under tensor=2 and expert=2.

    python end_to_end/multi_gpu_check.py [--out DIR] [--models tiny,1b] [--meshes tensor=2,expert=2]

Two random-weight models (fp32): "tiny", the tiny config (head and expert counts divisible by 2), and "1b", a
>= 1B-param one (the 48B model's widths with 2 layers: one KDA, one MLA, 64 experts). For each, the 1-device Engine is the
reference; the tensor=2 and expert=2 Engines must give logits within 1e-4 x max|logits| and identical greedy tokens.
Prints a table and writes multi_gpu_check.json to --out. Needs >= 2 devices.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from MaxText import pyconfig, train  # noqa: E402
from MaxText.inference.engine import Engine  # noqa: E402
from MaxText.layers.models import KimiLinearForCausalLM  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = {
    "tiny": (os.path.join(REPO, "configs", "kimi_linear_tiny.yml"),
             {"kda_num_heads": 4, "num_query_heads": 4, "param_init_std": 0.08}),
    "1b": (os.path.join(REPO, "configs", "kimi_linear.yml"),
                                         {"num_decoder_layers": 2, "kda_layers": [1], "mla_layers": [2],
                                          "num_experts": 64, "dtype": "float32", "weight_dtype": "float32"}),
}
MESHES = {"1 GPU": {}, "tensor=2": {"ici_tensor_parallelism": 2}, "expert=2": {"ici_expert_parallelism": 2}}
TOLERANCE = 1e-4


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".")
    parser.add_argument("--precision", default="highest", choices=("default", "high", "highest"),
                        help="jax_default_matmul_precision: 'default' lets the GPU use TF32-class fp32 matmuls, whose "
                             "rounding changes with the partitioning")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {list(MODELS)}")
    parser.add_argument("--meshes", default=",".join(list(MESHES)[1:]),
                        help=f"comma-separated subset of {list(MESHES)[1:]} (the 1-GPU reference always runs first)")
    args = parser.parse_args()
    for name, chosen, known in (("--models", args.models, list(MODELS)), ("--meshes", args.meshes, list(MESHES)[1:])):
        unknown = [x for x in chosen.split(",") if x not in known]
        if unknown:
            parser.error(f"{name}: unknown {unknown}; choose from {known}")
    meshes = {name: MESHES[name] for name in ["1 GPU", *args.meshes.split(",")]}
    os.makedirs(args.out, exist_ok=True)  # before the first model: the report is written after every run
    jax.config.update("jax_default_matmul_precision", args.precision)
    print(f"devices: {jax.devices()} (jax {jax.__version__}), matmul precision {args.precision}", flush=True)
    rng = np.random.default_rng(0)
    report, ok = [], True
    for model_name in args.models.split(","):
        path, overrides = MODELS[model_name]
        base = {**overrides, "max_target_length": 128}
        config = pyconfig.load_config(path, base)
        params = jax.device_get(train.init_params(KimiLinearForCausalLM(config), config, jax.random.key(0)))
        num_params = sum(p.size for p in jax.tree.leaves(params))
        tokens = rng.integers(0, config.vocab_size, (2, 24)).tolist()
        prompts = [tokens[0][:24], tokens[1][:11]]
        reference = None
        for mesh_name, mesh_overrides in meshes.items():
            start = time.perf_counter()
            engine = Engine(pyconfig.load_config(path, {**base, **mesh_overrides}), params)
            logits = engine.logits(tokens)
            generated = engine.generate(prompts, 16)
            seconds = time.perf_counter() - start
            if reference is None:
                reference = (logits, generated)
                row = {"model": model_name, "params": int(num_params), "mesh": mesh_name, "seconds": seconds}
            else:
                rel = float(np.abs(logits - reference[0]).max() / np.abs(reference[0]).max())
                same = generated == reference[1]
                ok &= rel <= TOLERANCE and same
                row = {"model": model_name, "params": int(num_params), "mesh": mesh_name, "seconds": seconds,
                       "logits_max_rel_diff": rel, "greedy_tokens_equal": same}
            report.append(row)
            print(json.dumps(row), flush=True)
            with open(os.path.join(args.out, "multi_gpu_check.json"), "w") as f:
                json.dump(report, f, indent=1)
    print("all sharded runs match the 1-GPU run" if ok else "MISMATCH", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
