"""Logit and greedy-generation parity with HF transformers, through the whole user path:

    python end_to_end/check_hf_parity.py [--preset base lora groups] [--layout save_pretrained|native] [--keep DIR]

For each preset: builds a tiny random HF KimiLinearForCausalLM locally (perturbed norm weights, non-zero router
correction biases), saves it (HF's own `save_pretrained`, which writes the original release layout over several
shards, or the transformers-native layout), converts it with `MaxText.convert_hf_checkpoint`, loads it with
`Engine.from_checkpoint`, and compares, like MaxText's forward_pass_logit_checker:
  * fp32 logits for prompts of length 1, 63 and 130: max |ours - HF| <= 1e-4 * max |HF|, and per-token
    KL(HF || ours);
  * greedy generation of 32 tokens for a batch of 3 prompts of different lengths == HF `generate(do_sample=False)`
    on each prompt alone;
  * bfloat16 (weights and activations): mean per-token KL(HF fp32 || ours bf16) <= 1e-3.
Prints one report line per check and exits 1 when any check fails.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from end_to_end import tiny_hf  # noqa: E402  pylint: disable=wrong-import-position

# Three tiny configs that vary what the acceptance asks for: KDA heads / head dim, MLA positions, expert count and
# top-k, group-limited routing, q LoRA, shared experts, dense-layer count, renormalization.
PRESETS: dict[str, dict] = {
    "base": {},  # 2 KDA heads x 16, MLA last of 4 layers, 8 experts top-2 in 2 groups (1 kept), no q LoRA
    "lora": dict(hidden_size=48, num_hidden_layers=5, q_lora_rank=8, linear_num_heads=3, linear_head_dim=8,
                 layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention",
                              "full_attention"],
                 mlp_layer_types=["dense", "dense", "sparse", "sparse", "sparse"], num_local_experts=12,
                 num_experts_per_tok=3, n_group=1, topk_group=1, n_shared_experts=2, norm_topk_prob=False,
                 routed_scaling_factor=1.0),
    "groups": dict(num_hidden_layers=3, linear_num_heads=4, linear_head_dim=16, num_attention_heads=4,
                   num_key_value_heads=4, layer_types=["full_attention", "linear_attention", "full_attention"],
                   mlp_layer_types=["dense", "sparse", "sparse"], num_local_experts=16, num_experts_per_tok=4,
                   n_group=4, topk_group=2),
}
LOGIT_PROMPT_LENGTHS = (1, 63, 130)
GENERATE_PROMPT_LENGTHS = (5, 17, 40)
NEW_TOKENS = 32
FP32_REL_TOL = 1e-4
BF16_MAX_MEAN_KL = 1e-3


def kl_per_token(reference_logits: np.ndarray, logits: np.ndarray) -> np.ndarray:
    """KL(softmax(reference) || softmax(logits)) per position, in float64. Shapes [T, V] -> [T]."""
    def log_softmax(x):
        x = x.astype(np.float64)
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))
    ref, ours = log_softmax(reference_logits), log_softmax(logits)
    return (np.exp(ref) * (ref - ours)).sum(-1)


def hf_logits(model, ids: list[int]) -> np.ndarray:
    import torch  # pylint: disable=import-outside-toplevel
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def hf_greedy(model, ids: list[int], new_tokens: int) -> list[int]:
    import torch  # pylint: disable=import-outside-toplevel
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    return out[0, len(ids):].tolist()


def save_hf(model, config, directory: str, layout: str) -> None:
    if layout == "save_pretrained":  # HF's own writer: the original (release) layout, several shards
        model.save_pretrained(directory, max_shard_size="200KB")
    else:
        tiny_hf.write_checkpoint(directory, tiny_hf.native_state_dict(model), tiny_hf.native_config_json(config),
                                 num_shards=3)


def check_preset(name: str, layout: str, work: str) -> list[tuple[str, bool, str]]:
    """Runs every check for one preset; returns (check, passed, detail) rows."""
    from MaxText import convert_hf_checkpoint  # pylint: disable=import-outside-toplevel
    from MaxText.inference.engine import Engine  # pylint: disable=import-outside-toplevel
    config = tiny_hf.tiny_hf_config(**PRESETS[name])
    model = tiny_hf.tiny_hf_model(config, seed=len(name))
    model.generation_config.eos_token_id = None  # generate exactly NEW_TOKENS, as our engine does with eos_id=None
    model.generation_config.pad_token_id = config.pad_token_id
    hf_dir, out = os.path.join(work, name, "hf"), os.path.join(work, name, "out")
    save_hf(model, config, hf_dir, layout)
    shards = len([f for f in os.listdir(hf_dir) if f.endswith(".safetensors")])
    convert_hf_checkpoint.convert(hf_dir, out, dtype="float32", progress=False)
    rng = np.random.default_rng(0)
    rows = []

    engine = Engine.from_checkpoint(out)
    for length in LOGIT_PROMPT_LENGTHS:
        ids = rng.integers(0, config.vocab_size, length).tolist()
        ref, ours = hf_logits(model, ids), engine.logits([ids])[0]
        scale = float(np.abs(ref).max())
        diff = float(np.abs(ours - ref).max())
        kl = kl_per_token(ref, ours)
        rows.append((f"fp32 logits T={length}", diff <= FP32_REL_TOL * scale,
                     f"max|diff| {diff:.2e} = {diff / scale:.1e} x max|HF| ({scale:.2f}); KL mean {kl.mean():.1e} "
                     f"max {kl.max():.1e}"))
    prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in GENERATE_PROMPT_LENGTHS]
    ours = engine.generate(prompts, max_new_tokens=NEW_TOKENS)
    for prompt, generated in zip(prompts, ours):
        want = hf_greedy(model, prompt, NEW_TOKENS)
        same = sum(a == b for a, b in zip(generated, want))
        rows.append((f"greedy {NEW_TOKENS} tokens, prompt {len(prompt)} (batch of 3)", generated == want,
                     f"{same}/{len(want)} tokens equal" + ("" if generated == want else
                                                           f"; ours {generated[:8]}..., HF {want[:8]}...")))

    bf16 = Engine.from_checkpoint(out, dtype="bfloat16", weight_dtype="bfloat16")
    kls = []
    for length in LOGIT_PROMPT_LENGTHS:
        ids = rng.integers(0, config.vocab_size, length).tolist()
        kls.append(kl_per_token(hf_logits(model, ids), bf16.logits([ids])[0]))
    kl = np.concatenate(kls)
    rows.append(("bf16 logits, KL(HF fp32 || ours bf16)", float(kl.mean()) <= BF16_MAX_MEAN_KL,
                 f"mean {kl.mean():.1e} max {kl.max():.1e} over {kl.size} tokens"))
    print(f"[{name}] {layout} layout, {shards} shards, layers {list(config.layer_types)}, "
          f"{config.num_local_experts} experts top-{config.num_experts_per_tok}, n_group {config.n_group}, "
          f"q_lora_rank {config.q_lora_rank}")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", nargs="+", choices=sorted(PRESETS), default=list(PRESETS))
    parser.add_argument("--layout", choices=("save_pretrained", "native"), default="save_pretrained")
    parser.add_argument("--keep", default=None, help="write the HF and converted checkpoints here (kept)")
    args = parser.parse_args()
    work = args.keep or tempfile.mkdtemp(prefix="check_hf_parity.")
    failed = 0
    try:
        for name in args.preset:
            start = time.time()
            rows = check_preset(name, args.layout, work)
            for check, passed, detail in rows:
                failed += not passed
                print(f"  {'PASS' if passed else 'FAIL'}  {check}: {detail}")
            print(f"  ({time.time() - start:.0f} s)")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print("all checks passed" if not failed else f"{failed} check(s) FAILED")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
