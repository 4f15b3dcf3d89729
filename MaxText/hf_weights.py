"""HF Kimi-Linear checkpoints <-> our config keys and param tree.

Two HF layouts exist and both are accepted, tensor by tensor:
  original (moonshotai release; what `save_pretrained` writes): `self_attn.{q,k,v}_conv1d.weight` [HK, 1, W],
      `self_attn.{f_a_proj,f_b_proj,dt_bias,A_log}`, `block_sparse_moe.{gate, experts.N.w1/w2/w3, shared_experts}`,
      dense layers under `mlp.` or `block_sparse_moe.`;
  transformers-native (`KimiLinearForCausalLM.state_dict()`): `self_attn.conv1d.weight` [3HK, 1, W] (q, k, v
      concatenated), `self_attn.forget_gate.{f_a_proj,f_b_proj,dt_bias,A_log}`, `mlp.{gate, experts.gate_up_proj
      [E, 2I, D], experts.down_proj [E, D, I], shared_experts}`.
Our tree (see the conventions): Linear weights [out, in] become `kernel` [in, out] (kept [out, in] for the dense
projections with `dense_kernel_layout: out_in`); conv weights [C, 1, W] become `kernel` [W, C]; `A_log` [1, 1, H, 1]
becomes [H]; experts are stacked [E, D, I] / [E, I, D] (`expert_kernel_layout: out_in`: [E, I, D] / [E, D, I]).

Everything is driven by one table, `hf_tensor_specs(config)`: every HF tensor name a checkpoint of this config may
hold (both layouts), its shape, and which of our leaves (and which expert slot) it fills. The same table serves
the in-memory conversion (`params_from_hf_state_dict`), the streaming converter (`check_tensor_shapes` on the
safetensors headers, then `convert_tensor` one tensor at a time) and error messages naming the tensor.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

PARAMS_ROOT = ("params",)
MAX_LISTED_PROBLEMS = 12  # how many bad tensors an error lists before "... and N more"


class HFCheckpointError(ValueError):
    """An HF config or checkpoint does not match what a Kimi-Linear model of the given config needs."""


# ------------------------------------------------------------------------------------------------ config


def _first(hf: Mapping[str, Any], names: tuple[str, ...], default: Any) -> Any:
    """The value of the first of `names` present (and not None) in `hf`, else `default`."""
    for name in names:
        if hf.get(name) is not None:
            return hf[name]
    return default


# Our config key -> (HF names, aliases first-to-last as KimiLinearConfig accepts them; HF's default or None if the
# key is required). The aliases are KimiLinearConfig.attribute_map's both sides.
_HF_SCALARS: dict[str, tuple[tuple[str, ...], Any]] = {
    "vocab_size": (("vocab_size",), None),
    "emb_dim": (("hidden_size",), None),
    "num_decoder_layers": (("num_hidden_layers",), None),
    "normalization_layer_epsilon": (("rms_norm_eps",), 1e-5),
    "num_query_heads": (("num_attention_heads",), 32),
    "kv_lora_rank": (("kv_lora_rank",), 512),
    "qk_nope_head_dim": (("qk_nope_head_dim",), 128),
    "qk_rope_head_dim": (("qk_rope_head_dim",), 64),
    "v_head_dim": (("v_head_dim",), 128),
    "mlp_dim": (("intermediate_size",), 9216),
    "num_experts": (("num_experts", "num_local_experts"), 256),
    "num_experts_per_tok": (("num_experts_per_token", "num_experts_per_tok"), 8),
    "moe_mlp_dim": (("moe_intermediate_size",), 1024),
    "shared_experts": (("num_shared_experts", "n_shared_experts"), 1),
    "routed_scaling_factor": (("routed_scaling_factor",), 2.446),
    "n_routing_groups": (("num_expert_group", "n_group"), 1),
    "topk_routing_group": (("topk_group",), 1),
    "norm_topk_prob": (("moe_renormalize", "norm_topk_prob"), True),
}
_LAYER_KIND = {"linear_attention": "kda", "full_attention": "mla"}


def _hf_layer_kinds(hf: Mapping[str, Any], num_layers: int) -> list[str]:
    """'kda' | 'mla' per 0-indexed layer, with KimiLinearConfig's precedence: layer_types, then linear_attn_config,
    then its default."""
    linear = hf.get("linear_attn_config") or {}
    if hf.get("layer_types") is not None:
        types = list(hf["layer_types"])
        if len(types) != num_layers:
            raise HFCheckpointError(f"config layer_types has {len(types)} entries; num_hidden_layers is {num_layers}")
        bad = sorted({t for t in types if t not in _LAYER_KIND})
        if bad:
            raise HFCheckpointError(f"config layer_types holds {bad}; allowed: {sorted(_LAYER_KIND)}")
        return [_LAYER_KIND[t] for t in types]
    if "kda_layers" in linear and "full_attn_layers" in linear:
        kinds: list[str | None] = [None] * num_layers
        for key, kind in (("full_attn_layers", "mla"), ("kda_layers", "kda")):
            for layer in linear[key]:
                if not isinstance(layer, int) or not 1 <= layer <= num_layers:
                    raise HFCheckpointError(f"linear_attn_config.{key} holds {layer!r}; layers are 1-indexed in "
                                            f"1..num_hidden_layers={num_layers}")
                if kinds[layer - 1] is not None:
                    raise HFCheckpointError(f"layer {layer} is listed twice in linear_attn_config "
                                            f"(kda_layers / full_attn_layers)")
                kinds[layer - 1] = kind
        missing = [i + 1 for i, k in enumerate(kinds) if k is None]
        if missing:
            raise HFCheckpointError(f"layers {missing} (1-indexed) are in neither linear_attn_config.kda_layers nor "
                                    f"full_attn_layers")
        return kinds  # type: ignore[return-value]
    # KimiLinearConfig's default: full attention at 0-indexed layers 4, 8, ...
    return ["mla" if i and i % 4 == 0 else "kda" for i in range(num_layers)]


def _hf_first_dense(hf: Mapping[str, Any], num_layers: int) -> int:
    """How many leading layers use the dense MLP (the rest must all be MoE: that is what our config can express)."""
    if hf.get("mlp_layer_types") is not None:
        types = list(hf["mlp_layer_types"])
        if len(types) != num_layers:
            raise HFCheckpointError(f"config mlp_layer_types has {len(types)} entries; num_hidden_layers is "
                                    f"{num_layers}")
        first_dense = next((i for i, t in enumerate(types) if t != "dense"), num_layers)
        if types != ["dense"] * first_dense + ["sparse"] * (num_layers - first_dense):
            raise HFCheckpointError(f"config mlp_layer_types is {types}; only 'dense' layers followed by 'sparse' "
                                    f"layers are supported")
        return first_dense
    if hf.get("moe_layer_freq", 1) != 1:
        raise HFCheckpointError(f"config moe_layer_freq is {hf['moe_layer_freq']!r}; only 1 (every layer after "
                                f"first_k_dense_replace is MoE) is supported")
    first_dense = hf.get("first_k_dense_replace", 1)
    if not isinstance(first_dense, int) or not 0 <= first_dense <= num_layers:
        raise HFCheckpointError(f"config first_k_dense_replace is {first_dense!r}; expected an int in "
                                f"0..num_hidden_layers={num_layers}")
    return first_dense


def _check_supported(hf: Mapping[str, Any]) -> None:
    """Rejects HF settings our model does not implement, naming the key and the value seen."""
    model_type = hf.get("model_type", "kimi_linear")
    if model_type != "kimi_linear":
        raise HFCheckpointError(f"config model_type is {model_type!r}; expected 'kimi_linear'")
    required_values = {
        "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False, "mla_use_nope": True,
        "moe_router_activation_func": "sigmoid",
    }
    for key, want in required_values.items():
        if key in hf and hf[key] is not None and hf[key] != want:
            raise HFCheckpointError(f"config {key} is {hf[key]!r}; only {want!r} is supported")
    heads, kv_heads = hf.get("num_attention_heads"), hf.get("num_key_value_heads")
    if kv_heads is not None and heads is not None and kv_heads != heads:
        raise HFCheckpointError(f"config num_key_value_heads is {kv_heads}; MLA needs it equal to "
                                f"num_attention_heads={heads}")


def config_from_hf(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """An HF `config.json` dict (moonshotai `linear_attn_config` schema or transformers-native `layer_types`
    schema) -> our architecture config keys (see configs/base.yml), ready to layer over base.yml.

    Raises HFCheckpointError naming the key when a required key is missing or a setting is unsupported.
    """
    hf = dict(hf_config)
    _check_supported(hf)
    cfg: dict[str, Any] = {"model_name": "kimi_linear"}
    for key, (names, default) in _HF_SCALARS.items():
        value = _first(hf, names, default)
        if value is None:
            raise HFCheckpointError(f"config.json has none of {list(names)}; it is needed for {key!r}")
        cfg[key] = value
    cfg["q_lora_rank"] = hf.get("q_lora_rank") or 0
    linear = hf.get("linear_attn_config") or {}
    cfg["kda_num_heads"] = _first(linear, ("num_heads",), _first(hf, ("linear_num_heads",), 32))
    cfg["kda_head_dim"] = _first(linear, ("head_dim",), _first(hf, ("linear_head_dim",), 128))
    cfg["kda_conv_kernel_size"] = _first(linear, ("short_conv_kernel_size",),
                                         _first(hf, ("linear_conv_kernel_dim",), 4))
    num_layers = cfg["num_decoder_layers"]
    kinds = _hf_layer_kinds(hf, num_layers)
    cfg["kda_layers"] = [i + 1 for i, k in enumerate(kinds) if k == "kda"]
    cfg["mla_layers"] = [i + 1 for i, k in enumerate(kinds) if k == "mla"]
    cfg["first_num_dense_layers"] = _hf_first_dense(hf, num_layers)
    cfg["normalization_layer_epsilon"] = float(cfg["normalization_layer_epsilon"])
    cfg["routed_scaling_factor"] = float(cfg["routed_scaling_factor"])
    cfg["norm_topk_prob"] = bool(cfg["norm_topk_prob"])
    return cfg


def layer_kinds(config: Mapping[str, Any]) -> list[str]:
    """'kda' | 'mla' per 0-indexed layer, from `kda_layers` (1-indexed) of our config (dict or ConfigDict)."""
    kda = set(config["kda_layers"])
    return ["kda" if i + 1 in kda else "mla" for i in range(config["num_decoder_layers"])]


def mlp_kinds(config: Mapping[str, Any]) -> list[str]:
    """'dense' | 'moe' per 0-indexed layer."""
    return ["dense" if i < config["first_num_dense_layers"] else "moe" for i in range(config["num_decoder_layers"])]


# ------------------------------------------------------------------------------------------------ the table

Path = tuple[str, ...]
Target = tuple[Path, "int | None"]  # (our leaf path, expert slot along axis 0 or None for the whole leaf)


@dataclasses.dataclass(frozen=True)
class HFTensorSpec:
    """One tensor an HF checkpoint may hold: its name, allowed shapes, layout, and where its values go.

    `transform(array)` returns one array per entry of `targets`, already in our layout (same dtype as the input).
    """
    name: str
    shapes: tuple[tuple[int, ...], ...]
    layout: str  # "any" | "original" | "native"
    targets: tuple[Target, ...]
    transform: Callable[[np.ndarray], list[np.ndarray]]


@dataclasses.dataclass(frozen=True)
class Piece:
    """A converted piece of one of our leaves: the whole leaf (slot None) or one expert slot of a stacked leaf."""
    path: Path
    slot: int | None
    value: np.ndarray


def _linear(w: np.ndarray) -> list[np.ndarray]:
    return [w.T]  # torch Linear weight [out, in] -> kernel [in, out]


def _same(w: np.ndarray) -> list[np.ndarray]:
    return [w]


LINEAR_TRANSFORMS = {"in_out": _linear, "out_in": _same}  # by our kernel's layout (dense_kernel_layout)
# The dense kernels' layout of a config without the key (config_from_hf's keys alone, or a checkpoint's config.yml
# written before the key existed: checkpointing.ARCHITECTURE_KEYS_BEFORE): the one from before the key.
DENSE_LAYOUT_WITHOUT_KEY = "in_out"


def _flatten(w: np.ndarray) -> list[np.ndarray]:
    return [w.reshape(-1)]  # A_log [1, 1, H, 1] -> [H]


def _conv(w: np.ndarray) -> list[np.ndarray]:
    return [w[:, 0, :].T]  # Conv1d weight [C, 1, W] -> kernel [W, C]


def _fused_conv(w: np.ndarray) -> list[np.ndarray]:
    return [part[:, 0, :].T for part in np.split(w, 3, axis=0)]  # [3C, 1, W] -> q, k, v kernels [W, C]


def _gate_up_out_in(w: np.ndarray) -> list[np.ndarray]:
    return list(np.split(w, 2, axis=1))  # [E, 2I, D] -> gate, up [E, I, D]


def _gate_up(w: np.ndarray) -> list[np.ndarray]:
    return [part.transpose(0, 2, 1) for part in _gate_up_out_in(w)]  # [E, D, I]


def _experts_down(w: np.ndarray) -> list[np.ndarray]:
    return [w.transpose(0, 2, 1)]  # [E, D, I] -> [E, I, D]


# By the routed experts' layout (expert_kernel_layout): one expert's [out, in] weight, the fused gate_up_proj, the
# stacked down_proj -> our leaves.
EXPERT_TRANSFORMS = {"in_out": (_linear, _gate_up, _experts_down), "out_in": (_same, _gate_up_out_in, _same)}


class _Table:
    """Collects our leaves (path -> shape) and the HF tensors that fill them, for `config`. `dense_layout`: how the
    dense projections' kernels are stored (config key dense_kernel_layout; MaxText.layers.linears.create_kernel)."""

    def __init__(self, config: Mapping[str, Any]):
        self.dense_layout = config.get("dense_kernel_layout", DENSE_LAYOUT_WITHOUT_KEY)
        self.dense_kernels: set[Path] = set()  # the kernels stored as dense_layout says
        self.leaves: dict[Path, tuple[int, ...]] = {}
        self.stacked: dict[Path, int] = {}  # leaf path -> number of expert slots, for leaves filled slot by slot
        self.specs: dict[str, HFTensorSpec] = {}

    def leaf(self, path: Path, shape: tuple[int, ...], slots: int | None = None) -> Path:
        self.leaves[path] = tuple(shape)
        if slots is not None:
            self.stacked[path] = slots
        return path

    def hf(self, name: str, shape, layout: str, leaves: list[Path], transform, *alt_shapes,
           slot: int | None = None) -> None:
        """HF tensor `name` of `shape` (or one of `alt_shapes`) fills `leaves` (expert `slot` of each when given)."""
        targets = tuple((leaf, slot) for leaf in leaves)
        self.specs[name] = HFTensorSpec(name, (tuple(shape), *map(tuple, alt_shapes)), layout, targets, transform)

    def linear(self, name: str, path: Path, in_dim: int, out_dim: int, layout: str = "any",
               stored: str | None = None) -> None:
        """An nn.Linear weight [out, in] -> our `path/kernel`, [in, out] or as it is (`stored` 'out_in'; None: the
        dense projections' layout)."""
        if stored is None:
            stored = self.dense_layout
            self.dense_kernels.add(path + ("kernel",))
        kernel = self.leaf(path + ("kernel",), (in_dim, out_dim) if stored == "in_out" else (out_dim, in_dim))
        self.hf(name, (out_dim, in_dim), layout, [kernel], LINEAR_TRANSFORMS[stored])

    def norm(self, name: str, path: Path, dim: int) -> None:
        scale = self.leaf(path + ("scale",), (dim,))
        self.hf(name, (dim,), "any", [scale], _same)


def _kda_specs(t: _Table, hf: str, ours: Path, config: Mapping[str, Any]) -> None:
    """One KDA layer: HF names under prefix `hf` (e.g. 'model.layers.0.self_attn.'), our leaves under `ours`."""
    d, h, k, w = config["emb_dim"], config["kda_num_heads"], config["kda_head_dim"], config["kda_conv_kernel_size"]
    hk = h * k
    for proj in ("q_proj", "k_proj", "v_proj"):
        t.linear(f"{hf}{proj}.weight", ours + (proj,), d, hk)
    convs = [t.leaf(ours + (f"{x}_conv1d", "kernel"), (w, hk)) for x in "qkv"]
    for x, conv in zip("qkv", convs):
        t.hf(f"{hf}{x}_conv1d.weight", (hk, 1, w), "original", [conv], _conv)
    t.hf(f"{hf}conv1d.weight", (3 * hk, 1, w), "native", convs, _fused_conv)
    # The forget gate's tensors: directly under self_attn (original) or under self_attn.forget_gate (native).
    for inner, (in_dim, out_dim) in {"f_a_proj": (d, k), "f_b_proj": (k, hk)}.items():
        t.linear(f"{hf}{inner}.weight", ours + (inner,), in_dim, out_dim, "original")
        t.linear(f"{hf}forget_gate.{inner}.weight", ours + (inner,), in_dim, out_dim, "native")
    gate = {
        "dt_bias": (t.leaf(ours + ("dt_bias",), (hk,)), (hk,), _same),
        "A_log": (t.leaf(ours + ("A_log",), (h,)), (1, 1, h, 1), _flatten),
    }
    for inner, (leaf, shape, transform) in gate.items():
        alt = [(h,)] if inner == "A_log" else []
        t.hf(f"{hf}{inner}", shape, "original", [leaf], transform, *alt)
        t.hf(f"{hf}forget_gate.{inner}", shape, "native", [leaf], transform, *alt)
    t.linear(f"{hf}b_proj.weight", ours + ("b_proj",), d, h)
    t.linear(f"{hf}g_a_proj.weight", ours + ("g_a_proj",), d, k)
    t.linear(f"{hf}g_b_proj.weight", ours + ("g_b_proj",), k, hk)
    t.norm(f"{hf}o_norm.weight", ours + ("o_norm",), k)
    t.linear(f"{hf}o_proj.weight", ours + ("o_proj",), hk, d)


def _mla_specs(t: _Table, hf: str, ours: Path, config: Mapping[str, Any]) -> None:
    d, heads, rank = config["emb_dim"], config["num_query_heads"], config["q_lora_rank"]
    nope, rope, v, kv_rank = (config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"],
                              config["kv_lora_rank"])
    if rank:
        t.linear(f"{hf}q_a_proj.weight", ours + ("q_a_proj",), d, rank)
        t.norm(f"{hf}q_a_layernorm.weight", ours + ("q_a_layernorm",), rank)
        t.linear(f"{hf}q_b_proj.weight", ours + ("q_b_proj",), rank, heads * (nope + rope))
    else:
        t.linear(f"{hf}q_proj.weight", ours + ("q_proj",), d, heads * (nope + rope))
    t.linear(f"{hf}kv_a_proj_with_mqa.weight", ours + ("kv_a_proj_with_mqa",), d, kv_rank + rope)
    t.norm(f"{hf}kv_a_layernorm.weight", ours + ("kv_a_layernorm",), kv_rank)
    t.linear(f"{hf}kv_b_proj.weight", ours + ("kv_b_proj",), kv_rank, heads * (nope + v))
    t.linear(f"{hf}o_proj.weight", ours + ("o_proj",), heads * v, d)


def _swiglu_specs(t: _Table, hf_prefixes: Iterable[tuple[str, str]], ours: Path, d: int, f: int) -> None:
    """gate/up/down of a SwiGLU MLP of width `f`, under each (HF prefix, layout) alternative."""
    for hf, layout in hf_prefixes:
        t.linear(f"{hf}gate_proj.weight", ours + ("gate_proj",), d, f, layout)
        t.linear(f"{hf}up_proj.weight", ours + ("up_proj",), d, f, layout)
        t.linear(f"{hf}down_proj.weight", ours + ("down_proj",), f, d, layout)


def _moe_specs(t: _Table, layer: str, ours: Path, config: Mapping[str, Any]) -> None:
    d, e, i = config["emb_dim"], config["num_experts"], config["moe_mlp_dim"]
    for hf, layout in ((f"{layer}block_sparse_moe.", "original"), (f"{layer}mlp.", "native")):
        t.linear(f"{hf}gate.weight", ours + ("gate",), d, e, layout, stored="in_out")  # the router's own param
        bias = t.leaf(ours + ("gate", "e_score_correction_bias"), (e,))
        t.hf(f"{hf}gate.e_score_correction_bias", (e,), layout, [bias], _same)
    layout = config.get("expert_kernel_layout", "in_out")
    one, gate_up, stacked_down = EXPERT_TRANSFORMS[layout]
    gate_up_shape, down_shape = ((i, d), (d, i)) if layout == "out_in" else ((d, i), (i, d))
    gate = t.leaf(ours + ("experts", "gate_proj"), (e, *gate_up_shape), slots=e)
    up = t.leaf(ours + ("experts", "up_proj"), (e, *gate_up_shape), slots=e)
    down = t.leaf(ours + ("experts", "down_proj"), (e, *down_shape), slots=e)
    for n in range(e):
        experts = f"{layer}block_sparse_moe.experts.{n}."
        t.hf(f"{experts}w1.weight", (i, d), "original", [gate], one, slot=n)
        t.hf(f"{experts}w3.weight", (i, d), "original", [up], one, slot=n)
        t.hf(f"{experts}w2.weight", (d, i), "original", [down], one, slot=n)
    t.hf(f"{layer}mlp.experts.gate_up_proj", (e, 2 * i, d), "native", [gate, up], gate_up)
    t.hf(f"{layer}mlp.experts.down_proj", (e, d, i), "native", [down], stacked_down)
    if config["shared_experts"]:
        shared = i * config["shared_experts"]
        _swiglu_specs(t, [(f"{layer}block_sparse_moe.shared_experts.", "original"),
                          (f"{layer}mlp.shared_experts.", "native")], ours + ("shared_experts",), d, shared)


def _build_table(config: Mapping[str, Any]) -> _Table:
    t = _Table(config)
    d, vocab = config["emb_dim"], config["vocab_size"]
    model = PARAMS_ROOT + ("model",)
    embedding = t.leaf(model + ("embed_tokens", "embedding"), (vocab, d))
    t.hf("model.embed_tokens.weight", (vocab, d), "any", [embedding], _same)
    for idx, (mixer, mlp) in enumerate(zip(layer_kinds(config), mlp_kinds(config))):
        hf, ours = f"model.layers.{idx}.", model + (f"layers_{idx}",)
        t.norm(f"{hf}input_layernorm.weight", ours + ("input_layernorm",), d)
        t.norm(f"{hf}post_attention_layernorm.weight", ours + ("post_attention_layernorm",), d)
        (_kda_specs if mixer == "kda" else _mla_specs)(t, f"{hf}self_attn.", ours + ("self_attn",), config)
        if mlp == "dense":
            _swiglu_specs(t, [(f"{hf}mlp.", "any"), (f"{hf}block_sparse_moe.", "original")], ours + ("mlp",), d,
                          config["mlp_dim"])
        else:
            _moe_specs(t, hf, ours + ("mlp",), config)
    t.norm("model.norm.weight", model + ("norm",), d)
    t.linear("lm_head.weight", PARAMS_ROOT + ("lm_head",), d, vocab)
    return t


def hf_tensor_specs(config: Mapping[str, Any]) -> dict[str, HFTensorSpec]:
    """Every HF tensor name a checkpoint of `config` may hold (both layouts) -> its spec."""
    return _build_table(config).specs


def param_shapes(config: Mapping[str, Any]) -> dict[Path, tuple[int, ...]]:
    """Our leaf path (starting with 'params') -> shape, for a model of `config`."""
    return _build_table(config).leaves


def dense_kernel_paths(config: Mapping[str, Any]) -> set[Path]:
    """The leaf paths (starting with 'params') of the kernels stored as `dense_kernel_layout` says: transposing
    exactly these turns one layout's params into the other's."""
    return _build_table(config).dense_kernels


def path_str(path: Path) -> str:
    return "/".join(path)


# ------------------------------------------------------------------------------------------------ validation


def _shape_str(shape) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def _expected_str(spec: HFTensorSpec) -> str:
    return " or ".join(_shape_str(s) for s in spec.shapes)


def _raise_problems(what: str, problems: list[str]) -> None:
    if problems:
        listed = problems[:MAX_LISTED_PROBLEMS]
        more = f"\n  ... and {len(problems) - len(listed)} more" if len(problems) > len(listed) else ""
        raise HFCheckpointError(f"{what}:\n  " + "\n  ".join(listed) + more)


def _shape_problem(spec: HFTensorSpec, shape: tuple[int, ...]) -> str | None:
    if tuple(shape) in spec.shapes:
        return None
    return f"tensor {spec.name!r} has shape {_shape_str(shape)}; expected {_expected_str(spec)}"


def _unexpected_problem(name: str, shape, specs: Mapping[str, HFTensorSpec]) -> str:
    close = difflib.get_close_matches(name, list(specs), n=1, cutoff=0.8)
    hint = f" (closest expected name: {close[0]!r})" if close else ""
    return (f"unexpected tensor {name!r} (shape {_shape_str(shape)}): a Kimi-Linear checkpoint of this config holds "
            f"no such tensor{hint}")


def _slot_targets(target: Target, table: _Table) -> list[Target]:
    """A whole-leaf target of a stacked leaf stands for all of its expert slots."""
    path, slot = target
    if slot is None and path in table.stacked:
        return [(path, n) for n in range(table.stacked[path])]
    return [target]


def _check(shapes: Mapping[str, tuple[int, ...]], table: _Table, what: str) -> None:
    problems: list[str] = []
    filled: dict[Target, str] = {}
    for name, shape in shapes.items():
        spec = table.specs.get(name)
        if spec is None:
            problems.append(_unexpected_problem(name, shape, table.specs))
            continue
        bad_shape = _shape_problem(spec, shape)
        if bad_shape:
            problems.append(bad_shape)
        for target in (t for spec_target in spec.targets for t in _slot_targets(spec_target, table)):
            if target in filled:
                slot = "" if target[1] is None else f" expert {target[1]}"
                problems.append(f"tensors {filled[target]!r} and {name!r} both provide {path_str(target[0])}{slot}: "
                                f"the checkpoint mixes the original and transformers-native layouts")
            filled[target] = name
    problems.extend(_missing_problems(table, set(filled)))
    _raise_problems(what, problems)


def check_tensor_shapes(shapes: Mapping[str, tuple[int, ...]], config: Mapping[str, Any]) -> None:
    """Validates a whole checkpoint from its tensor names and shapes alone (no data needed).

    Raises HFCheckpointError listing every unexpected tensor, wrong shape (name, expected and found shape), leaf
    provided twice (a mix of both layouts) and missing tensor (with the names either layout would use).
    """
    _check(shapes, _build_table(config), "HF checkpoint does not match the Kimi-Linear config")


def _missing_problems(table: _Table, filled: set[Target]) -> list[str]:
    """One message per unfilled leaf (for a stacked leaf: listing its unfilled expert slots), naming the HF
    tensors that would fill it in either layout."""
    providers: dict[Target, list[HFTensorSpec]] = {}
    for spec in table.specs.values():
        for target in spec.targets:
            providers.setdefault(target, []).append(spec)

    def describe(spec: HFTensorSpec) -> str:
        layout = "" if spec.layout == "any" else f" ({spec.layout} layout)"
        return f"{spec.name!r} {_expected_str(spec)}{layout}"

    problems = []
    for path in table.leaves:
        if path not in table.stacked:
            if (path, None) not in filled:
                options = " or ".join(describe(s) for s in providers.get((path, None), []))
                problems.append(f"missing tensor for {path_str(path)}: expected {options}")
            continue
        slots = [n for n in range(table.stacked[path]) if (path, n) not in filled]
        if slots:
            per_expert = [s.name for n in slots for s in providers.get((path, n), [])]
            listed = ", ".join(repr(n) for n in per_expert[:4]) + (", ..." if len(per_expert) > 4 else "")
            options = " or ".join([describe(s) for s in providers.get((path, None), [])] +
                                  [f"the per-expert tensors {listed} (original layout)"])
            problems.append(f"missing tensor for {path_str(path)} (experts {_ranges(slots)}): expected {options}")
    return problems


def _ranges(numbers: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    spans: list[list[int]] = []
    for n in numbers:
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


# ------------------------------------------------------------------------------------------------ conversion


def to_numpy(value: Any) -> np.ndarray:
    """A numpy array from a numpy array or a (CPU) torch tensor; torch bfloat16 becomes ml_dtypes bfloat16."""
    if hasattr(value, "detach"):
        tensor = value.detach().cpu()
        if str(tensor.dtype) == "torch.bfloat16":
            import ml_dtypes  # pylint: disable=import-outside-toplevel
            import torch  # pylint: disable=import-outside-toplevel
            return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return tensor.numpy()
    return np.asarray(value)


def convert_tensor(name: str, array: np.ndarray, specs: Mapping[str, HFTensorSpec]) -> list[Piece]:
    """One HF tensor -> the pieces of our leaves it provides (views; the caller copies or casts them).

    `specs` is `hf_tensor_specs(config)` (built once per checkpoint). Raises HFCheckpointError for an unexpected
    name or a wrong shape, naming the tensor, the expected and the found shape.
    """
    spec = specs.get(name)
    if spec is None:
        raise HFCheckpointError(_unexpected_problem(name, array.shape, specs))
    bad_shape = _shape_problem(spec, array.shape)
    if bad_shape:
        raise HFCheckpointError(bad_shape)
    values = spec.transform(array)
    return [Piece(path, slot, value) for (path, slot), value in zip(spec.targets, values)]


def nest(flat: Mapping[Path, Any]) -> dict[str, Any]:
    """{(a, b, c): x} -> {a: {b: {c: x}}}."""
    tree: dict[str, Any] = {}
    for path, value in flat.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree


def _assemble(state_dict: Mapping[str, Any], table: _Table) -> dict[Path, np.ndarray]:
    """Validates `state_dict` against `table` and converts it into our flat leaves."""
    arrays = {name: to_numpy(value) for name, value in state_dict.items()}
    _check({name: tuple(a.shape) for name, a in arrays.items()}, table,
           "HF state dict does not match the Kimi-Linear config")
    leaves: dict[Path, np.ndarray] = {}
    for name, array in arrays.items():
        for piece in convert_tensor(name, array, table.specs):
            if piece.slot is None:
                leaves[piece.path] = np.array(piece.value)
            else:
                stacked = leaves.setdefault(piece.path, np.zeros(table.leaves[piece.path], array.dtype))
                stacked[piece.slot] = piece.value
    return leaves


def params_from_hf_state_dict(state_dict: Mapping[str, Any], config: Mapping[str, Any]) -> dict[str, Any]:
    """A full HF state dict (either layout; numpy arrays or torch tensors) -> our nested param tree
    `{'params': {'model': ..., 'lm_head': ...}}` of numpy arrays in the source dtype.

    Every tensor is validated: unexpected names, wrong shapes and missing tensors raise HFCheckpointError naming
    the tensor with its expected and found shape.
    """
    return nest(_assemble(state_dict, _build_table(config)))


def kda_layer_params(state_dict: Mapping[str, Any], prefix: str, config: Mapping[str, Any]) -> dict[str, Any]:
    """One KDA layer's params (`{'q_proj': {'kernel': ...}, 'q_conv1d': ..., 'A_log': ..., ...}`, numpy) from the
    tensors of `state_dict` whose names start with `prefix`.

    `prefix=''` takes the state dict of a standalone HF `KimiLinearDeltaAttention` module; `prefix=
    'model.layers.0.self_attn.'` takes one layer of a full checkpoint (names outside the prefix are ignored).
    """
    table = _Table(config)
    _kda_specs(table, prefix, (), config)
    layer = {name: value for name, value in state_dict.items() if name.startswith(prefix)}
    return nest(_assemble(layer, table))
