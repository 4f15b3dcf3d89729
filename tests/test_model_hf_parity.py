"""The full model and engine against HF transformers' KimiLinearForCausalLM (the oracle), on tiny random checkpoints.

Three configs vary the KDA heads / head dim, MLA positions, expert count and top-k, group-limited routing, q LoRA,
shared experts and the dense prefix. Every HF model is perturbed after construction (norm weights, A_log, dt_bias,
a non-zero e_score_correction_bias) so that no parameter sits at a value that hides a mistake.

Checked per config: fp32 `engine.logits` within 1e-4 x max|HF logits| for prompts of length 1, 63, 130; greedy
`engine.generate` of 32 tokens for a batch of 3 prompts of different lengths identical to HF `generate` on each
prompt alone; a bf16 run's mean per-token KL(HF || ours) <= 1e-3, where HF is the fp32 model on the bf16-rounded
checkpoint (a released checkpoint is bf16; the KL then measures what running in bf16 costs us). HF's own bf16 run is
printed beside it: random tiny models are far more sensitive to rounding than trained ones (at initializer_range 0.1
HF's own bf16 run is ~1e-2 away from its fp32 run), so the weights are drawn with std 0.05.

Other test files import `hf_model`, `hf_state_dict` and `our_config` from here to build their oracles.
"""

from __future__ import annotations

import copy
import functools

import numpy as np
import pytest
import torch
from transformers import KimiLinearConfig, KimiLinearForCausalLM

from MaxText import pyconfig
from MaxText.hf_weights import config_from_hf, params_from_hf_state_dict
from MaxText.inference.engine import Engine

VOCAB = 300
LOGIT_RTOL = 1e-4  # of max|HF logits|
BF16_MAX_KL = 1e-3
NUM_NEW_TOKENS = 32

# Tiny HF configs (KimiLinearConfig keyword arguments on top of COMMON).
COMMON = dict(vocab_size=VOCAB, rms_norm_eps=1e-5, initializer_range=0.05, num_key_value_heads=None,
              pad_token_id=0, bos_token_id=None, eos_token_id=None, tie_word_embeddings=False)
HF_CONFIGS = {
    # 3:1 hybrid (MLA last), 8 experts top-2, no grouping, no q LoRA.
    "kda2x32_mla4_e8top2": dict(
        hidden_size=64, num_hidden_layers=4, intermediate_size=96, moe_intermediate_size=32,
        layer_types=["linear_attention"] * 3 + ["full_attention"], mlp_layer_types=["dense"] + ["sparse"] * 3,
        linear_num_heads=2, linear_head_dim=32, num_attention_heads=2, kv_lora_rank=32, q_lora_rank=None,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        num_local_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1,
        routed_scaling_factor=2.446, norm_topk_prob=True),
    # MLA first and third, q LoRA, 16 experts top-4 in 4 groups (2 kept), 2 shared experts.
    "kda4x16_mla13_qlora_e16top4g4": dict(
        hidden_size=48, num_hidden_layers=4, intermediate_size=80, moe_intermediate_size=24,
        layer_types=["full_attention", "linear_attention", "full_attention", "linear_attention"],
        mlp_layer_types=["dense"] + ["sparse"] * 3,
        linear_num_heads=4, linear_head_dim=16, num_attention_heads=3, kv_lora_rank=24, q_lora_rank=20,
        qk_nope_head_dim=12, qk_rope_head_dim=4, v_head_dim=10,
        num_local_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=2,
        routed_scaling_factor=1.5, norm_topk_prob=True),
    # Two dense layers, MLA in the middle, 32 experts top-6 in 8 groups (3 kept), no renormalization.
    "kda3x24_mla2_e32top6g8": dict(
        hidden_size=72, num_hidden_layers=3, intermediate_size=64, moe_intermediate_size=16,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        mlp_layer_types=["dense", "dense", "sparse"],
        linear_num_heads=3, linear_head_dim=24, num_attention_heads=4, kv_lora_rank=16, q_lora_rank=None,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
        num_local_experts=32, num_experts_per_tok=6, n_group=8, topk_group=3, n_shared_experts=1,
        routed_scaling_factor=2.0, norm_topk_prob=False),
}
CONFIG_NAMES = list(HF_CONFIGS)


def _perturb(model: KimiLinearForCausalLM, seed: int) -> None:
    """Moves every norm weight, A_log, dt_bias and e_score_correction_bias away from its init value."""
    gen = torch.Generator().manual_seed(seed)
    perturbed = set()
    with torch.no_grad():
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            noise = torch.randn(tensor.shape, generator=gen, dtype=tensor.dtype)
            if name.endswith("norm.weight"):  # input/post_attention/final/o_norm/kv_a/q_a layernorms
                tensor.add_(0.3 * noise)
            elif name.endswith(("A_log", "dt_bias")):
                tensor.add_(0.5 * noise)
            elif name.endswith("e_score_correction_bias"):
                tensor.copy_(0.05 * noise)
            else:
                continue
            perturbed.add(name.rsplit(".", 2)[-2] if name.endswith(".weight") else name.rsplit(".", 1)[-1])
    kinds = {"input_layernorm", "post_attention_layernorm", "norm", "o_norm", "kv_a_layernorm", "A_log", "dt_bias",
             "e_score_correction_bias"}
    assert kinds <= perturbed, f"not perturbed: {kinds - perturbed}"


@functools.lru_cache(maxsize=None)
def hf_model(name: str) -> KimiLinearForCausalLM:
    """The perturbed fp32 HF model of config `name` (eval mode; built once per session)."""
    torch.manual_seed(CONFIG_NAMES.index(name))
    model = KimiLinearForCausalLM(KimiLinearConfig(**COMMON, **HF_CONFIGS[name])).eval()
    _perturb(model, seed=100 + CONFIG_NAMES.index(name))
    return model


def hf_state_dict(model: torch.nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().float().numpy() for k, v in model.state_dict().items()}


def our_config(model: KimiLinearForCausalLM, **overrides):
    """Our config for an HF model (through the converter's config_from_hf), CPU-sized decode settings."""
    keys = {**config_from_hf(model.config.to_dict()), "max_target_length": 256, "kda_kernel": "chunked",
            "kda_chunk_size": 32, **overrides}
    return pyconfig.load_config(pyconfig.BASE_CONFIG_PATH, keys)


@functools.lru_cache(maxsize=None)
def _engine(name: str, dtype: str = "float32", layout: str | None = None) -> Engine:
    """Our engine on `name`'s weights; `layout`: dense_kernel_layout (None: base.yml's default)."""
    model = hf_model(name)
    layout_key = {} if layout is None else {"dense_kernel_layout": layout}
    config = our_config(model, dtype=dtype, weight_dtype=dtype, **layout_key)
    return Engine(config, params_from_hf_state_dict(hf_state_dict(model), config))


def _prompt(length: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, VOCAB, length).tolist()


def _hf_logits(model, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits.float().numpy()


@pytest.mark.parametrize("layout", ["in_out", "out_in"])
@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_fp32_logits_match_hf(name, layout):
    """Both dense kernel layouts (dense_kernel_layout: the HF weights transposed into [in, out] or kept [out, in])."""
    model, engine = hf_model(name), _engine(name, layout=layout)
    for length in (1, 63, 130):
        tokens = _prompt(length, seed=length)
        want = _hf_logits(model, tokens)
        got = engine.logits([tokens])
        assert got.dtype == np.float32 and got.shape == (1, length, VOCAB)
        scale = np.abs(want).max()
        err = np.abs(got - want).max()
        print(f"{name} {layout} T={length}: max|ours - HF| = {err:.3e}, max|HF| = {scale:.3f}, ratio {err / scale:.2e}")
        assert err <= LOGIT_RTOL * scale, (name, length, err, scale)


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_greedy_generation_matches_hf(name):
    model, engine = hf_model(name), _engine(name)
    prompts = [_prompt(length, seed=1000 + length) for length in (9, 30, 47)]
    ours = engine.generate(prompts, max_new_tokens=NUM_NEW_TOKENS)
    for prompt, got in zip(prompts, ours):
        with torch.no_grad():
            full = model.generate(torch.tensor([prompt]), max_new_tokens=NUM_NEW_TOKENS, do_sample=False,
                                  min_new_tokens=NUM_NEW_TOKENS)
        want = full[0, len(prompt):].tolist()
        assert got == want, (name, len(prompt), got, want)
    assert len({tuple(t) for t in ours}) == len(ours)  # the rows really differ


def _mean_kl(reference_logits: np.ndarray, logits: np.ndarray) -> float:
    """Mean over tokens of KL(softmax(reference) || softmax(logits)), in float64."""
    ref = torch.log_softmax(torch.tensor(reference_logits, dtype=torch.float64), dim=-1)
    ours = torch.log_softmax(torch.tensor(logits, dtype=torch.float64), dim=-1)
    return (ref.exp() * (ref - ours)).sum(-1).mean().item()


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_bf16_kl_to_hf(name):
    model = copy.deepcopy(hf_model(name))
    with torch.no_grad():  # a bf16 checkpoint: every weight exactly representable in bf16
        for tensor in list(model.parameters()) + list(model.buffers()):
            tensor.copy_(tensor.to(torch.bfloat16).float())
    config = our_config(model, dtype="bfloat16", weight_dtype="bfloat16")
    engine = Engine(config, params_from_hf_state_dict(hf_state_dict(model), config))
    tokens = _prompt(130, seed=7)
    reference = _hf_logits(model, tokens)
    hf_bf16 = _hf_logits(model.to(torch.bfloat16), tokens)
    ours = engine.logits([tokens])
    kl = _mean_kl(reference, ours)
    print(f"{name} bf16 over {len(tokens)} tokens: KL(HF fp32 || ours bf16) = {kl:.2e}; for comparison "
          f"KL(HF fp32 || HF bf16) = {_mean_kl(reference, hf_bf16):.2e}, "
          f"KL(HF bf16 || ours bf16) = {_mean_kl(hf_bf16, ours):.2e}")
    assert kl <= BF16_MAX_KL, (name, kl)
