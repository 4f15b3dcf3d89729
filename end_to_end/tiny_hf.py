"""Tiny random HF Kimi-Linear checkpoints, built locally (no downloads), in both layouts and both config schemas.

Used by the parity script (end_to_end/check_hf_parity.py), the conversion / tokenizer tests, and from the command
line (end_to_end/convert_and_decode.sh):

    python end_to_end/tiny_hf.py OUT_DIR [--layout save_pretrained|native] [--kimi-tokenizer]
  layouts:  "native"   = `KimiLinearForCausalLM.state_dict()` names (conv1d, forget_gate.*, experts.gate_up_proj);
            "original" = the moonshotai release names (q/k/v_conv1d, block_sparse_moe.experts.N.w1/w2/w3).
  schemas:  "native"   = transformers' `layer_types` / `mlp_layer_types` / `linear_*` keys;
            "original" = the release's `linear_attn_config` (1-indexed kda_layers / full_attn_layers),
                         `first_k_dense_replace`, `num_experts`, `num_experts_per_token`, `moe_renormalize`, ...
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

# A small config exercising every feature: q LoRA off, 2 KDA heads, MLA at 0-indexed layer 3, group-limited routing.
TINY_HF_KWARGS: dict[str, Any] = dict(
    vocab_size=260, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=16, num_local_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=2,
    topk_group=1, routed_scaling_factor=2.446, norm_topk_prob=True, linear_num_heads=2, linear_head_dim=16,
    linear_conv_kernel_dim=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
    mlp_layer_types=["dense"] + ["sparse"] * 3, rms_norm_eps=1e-5, pad_token_id=256, bos_token_id=257,
    eos_token_id=258, tie_word_embeddings=False,
)


def tiny_hf_config(**overrides):
    """A transformers KimiLinearConfig of TINY_HF_KWARGS updated with `overrides` (native keyword names)."""
    from transformers import KimiLinearConfig  # pylint: disable=import-outside-toplevel
    return KimiLinearConfig(**{**TINY_HF_KWARGS, **overrides})


def tiny_hf_model(config, seed: int = 0):
    """A random KimiLinearForCausalLM (fp32, eval mode) whose norm weights and router correction biases are
    perturbed away from their init (ones / zeros), so that a converter mixing them up is caught."""
    import torch  # pylint: disable=import-outside-toplevel
    from transformers import KimiLinearForCausalLM  # pylint: disable=import-outside-toplevel
    torch.manual_seed(seed)
    model = KimiLinearForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if "norm" in name:
                tensor.add_(0.1 * torch.randn(tensor.shape, generator=generator))
            elif name.endswith("e_score_correction_bias"):
                tensor.copy_(0.05 * torch.randn(tensor.shape, generator=generator))
    return model


def native_state_dict(model) -> dict[str, np.ndarray]:
    """The transformers-native layout: the model's own state dict, as numpy."""
    return {name: t.detach().cpu().numpy().copy() for name, t in model.state_dict().items()}


_FORGET_GATE = re.compile(r"\.self_attn\.forget_gate\.")
_EXPERTS = re.compile(r"^(model\.layers\.\d+\.)mlp\.experts\.(gate_up_proj|down_proj)$")


def original_state_dict(native: Mapping[str, np.ndarray], dense_prefix: str = "mlp") -> dict[str, np.ndarray]:
    """The moonshotai release layout of a native state dict: separate q/k/v convs, the forget gate's tensors
    directly under self_attn, MoE layers under block_sparse_moe with per-expert w1 (gate) / w3 (up) / w2 (down).
    Dense MLP layers stay under `dense_prefix` ('mlp' as in the release, or 'block_sparse_moe' as HF's
    `save_pretrained` writes them)."""
    out: dict[str, np.ndarray] = {}
    moe_layers = {m.group(1) for name in native if (m := _EXPERTS.match(name))}
    for name, value in native.items():
        layer = re.match(r"^model\.layers\.\d+\.", name)
        if name.endswith("self_attn.conv1d.weight"):
            base = name[: -len("conv1d.weight")]
            for part, array in zip("qkv", np.split(value, 3, axis=0)):
                out[f"{base}{part}_conv1d.weight"] = array.copy()
        elif (m := _EXPERTS.match(name)) and m.group(2) == "gate_up_proj":
            gate, up = np.split(value, 2, axis=1)  # [E, 2I, D] -> [E, I, D] each
            for n in range(value.shape[0]):
                out[f"{m.group(1)}block_sparse_moe.experts.{n}.w1.weight"] = gate[n].copy()
                out[f"{m.group(1)}block_sparse_moe.experts.{n}.w3.weight"] = up[n].copy()
        elif m:
            for n in range(value.shape[0]):
                out[f"{m.group(1)}block_sparse_moe.experts.{n}.w2.weight"] = value[n].copy()
        elif layer and ".mlp." in name:
            moe = layer.group(0) in moe_layers
            out[name.replace(".mlp.", ".block_sparse_moe." if moe else f".{dense_prefix}.")] = value
        else:
            out[_FORGET_GATE.sub(".self_attn.", name)] = value
    return out


# transformers-native config key -> the name the moonshotai release (and KimiLinearConfig.to_dict()) uses.
ORIGINAL_KEY_NAMES = {"num_local_experts": "num_experts", "num_experts_per_tok": "num_experts_per_token",
                      "n_shared_experts": "num_shared_experts", "norm_topk_prob": "moe_renormalize",
                      "n_group": "num_expert_group", "max_position_embeddings": "model_max_length"}


def original_config_json(native_json: Mapping[str, Any]) -> dict[str, Any]:
    """The moonshotai release schema of a transformers config dict (`KimiLinearConfig.to_dict()`)."""
    cfg = dict(native_json)
    layer_types = cfg.pop("layer_types")
    mlp_types = cfg.pop("mlp_layer_types")
    cfg["linear_attn_config"] = {
        "kda_layers": [i + 1 for i, t in enumerate(layer_types) if t == "linear_attention"],
        "full_attn_layers": [i + 1 for i, t in enumerate(layer_types) if t == "full_attention"],
        "num_heads": cfg.pop("linear_num_heads"), "head_dim": cfg.pop("linear_head_dim"),
        "short_conv_kernel_size": cfg.pop("linear_conv_kernel_dim"),
    }
    cfg["first_k_dense_replace"] = mlp_types.index("sparse") if "sparse" in mlp_types else len(mlp_types)
    for native_key, original_key in ORIGINAL_KEY_NAMES.items():
        if native_key in cfg:
            cfg[original_key] = cfg.pop(native_key)
    cfg.update(mla_use_nope=True, moe_layer_freq=1, moe_router_activation_func="sigmoid", use_grouped_topk=True)
    return cfg


def native_config_json(config) -> dict[str, Any]:
    """The transformers schema with its native key names (layer_types, num_local_experts, n_group, ...)."""
    cfg = config.to_dict()
    for native_key, saved_key in ORIGINAL_KEY_NAMES.items():
        if saved_key in cfg:
            cfg[native_key] = cfg.pop(saved_key)
    return cfg


def write_checkpoint(directory: str, state_dict: Mapping[str, np.ndarray], config_json: Mapping[str, Any],
                     num_shards: int = 3, write_index: bool = True) -> list[str]:
    """Writes `config.json` and `state_dict` as `num_shards` safetensors files (tensors spread round-robin, so
    every shard holds pieces of several layers and experts of one layer span shards) plus
    `model.safetensors.index.json` when `write_index`. Returns the shard file names."""
    from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
        json.dump(dict(config_json), f, indent=2)
    files = [f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors" for i in range(num_shards)]
    shards: list[dict[str, np.ndarray]] = [{} for _ in files]
    weight_map = {}
    for i, (name, value) in enumerate(sorted(state_dict.items())):
        shards[i % num_shards][name] = np.ascontiguousarray(value)
        weight_map[name] = files[i % num_shards]
    for file, shard in zip(files, shards):
        save_file(shard, os.path.join(directory, file), metadata={"format": "pt"})
    if write_index:
        total = sum(v.nbytes for v in state_dict.values())
        with open(os.path.join(directory, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return files


# ------------------------------------------------------------------------------------------------ tokenizer

# Words whose every UTF-8 prefix becomes a BPE token, so each word encodes to exactly one id.
SMALL_BPE_WORDS = ("hello", " world", "def", " fib", "onacci", "(n", "):", "你好")
# Named special tokens, as offsets after the BPE ids (the release names [BOS], [EOS], <|im_end|>, ..., [PAD]).
SMALL_BPE_SPECIALS = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 257: "[PAD]"}


def write_small_kimi_tokenizer(directory: str) -> dict[str, int]:
    """Writes a small Kimi-style tokenizer: `tiktoken.model` (base64 token + rank lines: the 256 bytes, then every
    prefix of SMALL_BPE_WORDS) and `tokenizer_config.json` (added_tokens_decoder, bos / eos / pad tokens).
    Returns each word's id and 'first_special' (= the number of BPE ranks); its vocabulary ends at
    first_special + 258."""
    ranks: dict[bytes, int] = {bytes([b]): b for b in range(256)}
    for word in SMALL_BPE_WORDS:
        data = word.encode("utf-8")
        for end in range(2, len(data) + 1):
            ranks.setdefault(data[:end], len(ranks))
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "tiktoken.model"), "w", encoding="utf-8") as f:
        for token, rank in ranks.items():
            f.write(f"{base64.b64encode(token).decode()} {rank}\n")
    first = len(ranks)
    named = {str(first + k): {"content": v, "special": True} for k, v in SMALL_BPE_SPECIALS.items()}
    config = {
        "added_tokens_decoder": named,
        "bos_token": "[BOS]", "eos_token": {"content": "[EOS]"}, "pad_token": "[PAD]",
        "tokenizer_class": "TikTokenTokenizer",
    }
    with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    return {word: ranks[word.encode("utf-8")] for word in SMALL_BPE_WORDS} | {"first_special": first}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Writes a tiny random HF Kimi-Linear checkpoint.")
    parser.add_argument("out_dir")
    parser.add_argument("--layout", choices=("save_pretrained", "native"), default="save_pretrained",
                        help="save_pretrained: HF's writer (original release layout, several shards); native: "
                             "the transformers state dict names in 3 shards")
    parser.add_argument("--kimi-tokenizer", action="store_true",
                        help="also write a small tiktoken.model + tokenizer_config.json (vocab becomes 600)")
    args = parser.parse_args(argv)
    config = tiny_hf_config(**({"vocab_size": 600, "pad_token_id": None, "bos_token_id": None,
                                "eos_token_id": None} if args.kimi_tokenizer else {}))
    model = tiny_hf_model(config)
    if args.layout == "save_pretrained":
        model.save_pretrained(args.out_dir, max_shard_size="200KB")
    else:
        write_checkpoint(args.out_dir, native_state_dict(model), native_config_json(config), num_shards=3)
    if args.kimi_tokenizer:
        write_small_kimi_tokenizer(args.out_dir)
    print(f"wrote a tiny HF Kimi-Linear checkpoint ({args.layout} layout) to {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
