"""Configuration: YAML files + `key=value` overrides -> a validated, frozen `ml_collections.FrozenConfigDict`.

Layering, lowest first: `configs/base.yml` (every key, documented) <- the `base_config:` chain of the model yml
<- the model yml <- command-line overrides. A yml without `base_config:` sits directly on base.yml, so a
config written next to a converted checkpoint (`OUT/config.yml`) loads the same way.

Types come from base.yml's defaults: an override must parse (as a YAML scalar) to the same type; an int is
accepted where a float is expected. Enumerated keys and cross-key rules are checked here, once, so that every
other module may trust the config.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping, Sequence
from typing import Any

import ml_collections
import yaml

from MaxText.inference.compile_options import GRAPH_SCHEDULING_CHOICES

CONFIGS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
BASE_CONFIG_PATH = os.path.join(CONFIGS_DIR, "base.yml")

# Keys whose value must be one of a fixed set.
ALLOWED_VALUES: dict[str, tuple[str, ...]] = {
    "mode": ("train", "decode", "both"),
    "log_level": ("debug", "info", "warning", "error"),
    "model_name": ("kimi_linear",),
    "kda_kernel": ("auto", "naive", "chunked", "pallas"),
    "dtype": ("float32", "bfloat16"),
    "weight_dtype": ("float32", "bfloat16"),
    "moe_grouped_matmul": ("auto", "ragged_dot", "gather", "pallas"),
    "dense_matmul": ("auto", "xla", "pallas"),
    "dense_matmul_grid": ("tiles", "rows"),
    "dense_kernel_layout": ("in_out", "out_in"),
    "expert_kernel_layout": ("in_out", "out_in"),
    "moe_router_kernel": ("auto", "xla", "pallas"),
    "mla_kernel": ("auto", "xla", "pallas"),
    "norm_kernel": ("auto", "xla", "pallas"),
    "moe_rows_product": ("auto", "tensor_cores", "fma"),
    "decode_graph_scheduling": GRAPH_SCHEDULING_CHOICES,
    "speculative": ("none", "ngram", "draft_model"),
    "verify_checkpoint_dtype": ("float32",),
    "jax_distributed_initialize": ("auto", "always", "never"),
}
# Why a key allows only what it does, where that is not obvious (added to the error).
ALLOWED_VALUES_WHY = {
    "verify_checkpoint_dtype": "the KDA verify writes each draft token's state into the row's fp32 state ring and the "
                               "commit selects the accepted slot with no copy, so every checkpoint may become the "
                               "committed fp32 state",
}

# Keys that must be >= 1.
POSITIVE_INT_KEYS = (
    "vocab_size", "emb_dim", "num_decoder_layers", "kda_num_heads", "kda_head_dim", "kda_conv_kernel_size",
    "kda_chunk_size", "num_query_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "mlp_dim",
    "num_experts", "num_experts_per_tok", "moe_mlp_dim", "n_routing_groups", "topk_routing_group",
    "max_target_length", "steps", "per_device_batch_size", "eval_batches", "checkpoint_period",
    "max_checkpoints_to_keep", "decode_loop_unroll",
)
NON_NEGATIVE_INT_KEYS = ("q_lora_rank", "qk_rope_head_dim", "first_num_dense_layers", "shared_experts",
                         "max_new_tokens", "seed", "warmup_steps", "eval_interval", "dense_row_reduce_max_elements")
MESH_KEYS = ("ici_data_parallelism", "ici_fsdp_parallelism", "ici_tensor_parallelism", "ici_expert_parallelism")
DCN_MESH_KEYS = ("dcn_data_parallelism", "dcn_fsdp_parallelism", "dcn_tensor_parallelism", "dcn_expert_parallelism")

# Keys computed here from the others; a yml or override that sets them is an error.
DERIVED_KEYS = ("layer_types", "mlp_types", "config_path")


class ConfigError(ValueError):
    """A configuration key is unknown, has the wrong type, or a value outside what is allowed."""


def _read_yaml(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} does not exist")
    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path!r} must hold a mapping of key: value, found {type(data).__name__}")
    return data


def _load_chain(path: str, seen: tuple[str, ...] = ()) -> dict[str, Any]:
    """Returns the merged raw keys of `path` and its `base_config:` ancestors (without base.yml itself)."""
    path = os.path.abspath(path)
    if path in seen:
        raise ConfigError(f"config files include each other in a cycle: {' -> '.join(seen + (path,))}")
    data = _read_yaml(path)
    parent = data.pop("base_config", None)
    if path == BASE_CONFIG_PATH:
        return {}
    merged: dict[str, Any] = {}
    if parent:
        parent_path = parent if os.path.isabs(parent) else os.path.join(os.path.dirname(path), parent)
        merged.update(_load_chain(parent_path, seen + (path,)))
    merged.update(data)
    return merged


def _unknown_key_error(key: str, known: Sequence[str], where: str) -> ConfigError:
    close = difflib.get_close_matches(key, known, n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    if key in DERIVED_KEYS:
        return ConfigError(f"key {key!r} (from {where}) is derived from other keys and cannot be set")
    return ConfigError(f"unknown config key {key!r} (from {where}){hint} Every key is listed in {BASE_CONFIG_PATH}.")


def _type_name(value: Any) -> str:
    return {bool: "bool", int: "int", float: "float", str: "string", list: "list", dict: "mapping"}.get(
        type(value), type(value).__name__)


def _coerce(key: str, value: Any, default: Any, where: str) -> Any:
    """Checks `value` against the type of base.yml's `default`; returns it (ints widened to float where needed)."""
    if default is None:
        return value
    expected = type(default)
    if expected is float and type(value) is int:
        return float(value)
    if type(value) is not expected:
        raise ConfigError(
            f"config key {key!r} (from {where}) must be of type {_type_name(default)}, got {value!r} "
            f"({_type_name(value)}); the default is {default!r}")
    return value


def parse_override(arg: str, defaults: Mapping[str, Any]) -> tuple[str, Any]:
    """`key=value` -> (key, value). Values of string keys are taken verbatim (`prompt=def f(x):` stays text);
    the others are parsed as YAML scalars or flow lists (`steps=10`, `kda_layers=[1, 2]`, `resume=true`)."""
    if "=" not in arg:
        raise ConfigError(f"command-line argument {arg!r} is not of the form key=value")
    key, raw = arg.split("=", 1)
    key = key.strip()
    if isinstance(defaults.get(key), str):
        return key, raw
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"value of {key!r} on the command line, {raw!r}, is not valid YAML: {e}") from e
    return key, value


def _check_layer_lists(cfg: dict[str, Any]) -> None:
    n = cfg["num_decoder_layers"]
    named: dict[int, str] = {}
    for list_key in ("kda_layers", "mla_layers"):
        for layer in cfg[list_key]:
            if not isinstance(layer, int) or isinstance(layer, bool) or not 1 <= layer <= n:
                raise ConfigError(
                    f"{list_key} holds {layer!r}; layers are numbered 1..num_decoder_layers={n} (1-indexed)")
            if layer in named:
                raise ConfigError(f"layer {layer} is listed in both {named[layer]} and {list_key}" if named[layer] !=
                                  list_key else f"layer {layer} is listed twice in {list_key}")
            named[layer] = list_key
    missing = [i for i in range(1, n + 1) if i not in named]
    if missing:
        raise ConfigError(
            f"layers {missing} are in neither kda_layers nor mla_layers; together they must name every layer "
            f"1..{n} exactly once (kda_layers={list(cfg['kda_layers'])}, mla_layers={list(cfg['mla_layers'])})")


def _validate(cfg: dict[str, Any]) -> None:
    for key, allowed in ALLOWED_VALUES.items():
        if cfg[key] not in allowed:
            why = f" ({ALLOWED_VALUES_WHY[key]})" if key in ALLOWED_VALUES_WHY else ""
            raise ConfigError(f"config key {key!r} is {cfg[key]!r}; allowed values: {', '.join(allowed)}{why}")
    for key in POSITIVE_INT_KEYS:
        if cfg[key] < 1:
            raise ConfigError(f"config key {key!r} is {cfg[key]!r}; it must be >= 1")
    for key in NON_NEGATIVE_INT_KEYS:
        if cfg[key] < 0:
            raise ConfigError(f"config key {key!r} is {cfg[key]!r}; it must be >= 0")
    for keys in (MESH_KEYS, DCN_MESH_KEYS):
        for key in keys:
            if cfg[key] != -1 and cfg[key] < 1:
                raise ConfigError(f"config key {key!r} is {cfg[key]!r}; it must be >= 1, or -1 to fill the remaining "
                                  f"devices")
        if sum(cfg[k] == -1 for k in keys) > 1:
            raise ConfigError(f"at most one of {', '.join(keys)} may be -1")
    if cfg["num_processes"] < 0:
        raise ConfigError(f"num_processes is {cfg['num_processes']}; it must be >= 0 (0 = from the environment)")
    if cfg["process_id"] < -1:
        raise ConfigError(f"process_id is {cfg['process_id']}; it must be >= 0, or -1 (from the environment)")
    if cfg["dense_kernel_layout"] == "out_in" and cfg["dense_matmul"] == "pallas":
        raise ConfigError("dense_matmul='pallas' reads [in, out] kernels, and dense_kernel_layout='out_in' stores them "
                          "[out, in] (each step would copy their transposes); use dense_matmul 'auto' or 'xla', or "
                          "dense_kernel_layout 'in_out'")
    if cfg["kda_chunk_size"] % 16:
        raise ConfigError(f"kda_chunk_size is {cfg['kda_chunk_size']}; it must be a multiple of 16")
    _check_layer_lists(cfg)
    if cfg["first_num_dense_layers"] > cfg["num_decoder_layers"]:
        raise ConfigError(f"first_num_dense_layers={cfg['first_num_dense_layers']} exceeds "
                          f"num_decoder_layers={cfg['num_decoder_layers']}")
    if cfg["num_experts_per_tok"] > cfg["num_experts"]:
        raise ConfigError(f"num_experts_per_tok={cfg['num_experts_per_tok']} exceeds num_experts={cfg['num_experts']}")
    if cfg["num_experts"] % cfg["n_routing_groups"]:
        raise ConfigError(f"n_routing_groups={cfg['n_routing_groups']} must divide num_experts={cfg['num_experts']}")
    if cfg["topk_routing_group"] > cfg["n_routing_groups"]:
        raise ConfigError(f"topk_routing_group={cfg['topk_routing_group']} exceeds "
                          f"n_routing_groups={cfg['n_routing_groups']}")
    per_group = cfg["num_experts"] // cfg["n_routing_groups"]
    if cfg["n_routing_groups"] > 1 and per_group < 2:
        raise ConfigError(f"group-limited routing scores each group by its top-2 experts, so every group needs >= 2 "
                          f"experts; got num_experts={cfg['num_experts']} over "
                          f"n_routing_groups={cfg['n_routing_groups']}")
    if cfg["num_experts_per_tok"] > cfg["topk_routing_group"] * per_group:
        raise ConfigError(f"num_experts_per_tok={cfg['num_experts_per_tok']} exceeds the experts in the "
                          f"topk_routing_group={cfg['topk_routing_group']} kept groups "
                          f"({cfg['topk_routing_group'] * per_group})")
    if not 0.0 < cfg["eval_fraction"] < 1.0:
        raise ConfigError(f"eval_fraction is {cfg['eval_fraction']}; it must be between 0 and 1 (exclusive)")
    for key in ("learning_rate", "adam_eps"):
        if cfg[key] <= 0:
            raise ConfigError(f"config key {key!r} is {cfg[key]}; it must be > 0")
    for key in ("weight_decay", "max_grad_norm", "cosine_end_fraction"):
        if cfg[key] < 0:
            raise ConfigError(f"config key {key!r} is {cfg[key]}; it must be >= 0")
    if cfg["max_target_length"] < 2:
        raise ConfigError(f"max_target_length is {cfg['max_target_length']}; training needs sequences of >= 2 tokens")
    if cfg["temperature"] < 0:
        raise ConfigError(f"temperature is {cfg['temperature']}; it must be >= 0")
    _check_speculative(cfg)


# The most draft tokens one verify step scores (the verify forward and its KDA checkpoints grow with it).
MAX_DRAFT_TOKENS = 16


def _check_speculative(cfg: dict[str, Any]) -> None:
    """Speculative-decoding settings the engine cannot honour fail here, before anything is loaded."""
    if not 1 <= cfg["num_draft_tokens"] <= MAX_DRAFT_TOKENS:
        raise ConfigError(f"num_draft_tokens is {cfg['num_draft_tokens']}; it must be in [1, {MAX_DRAFT_TOKENS}]")
    if cfg["ngram_max_size"] < 1:
        raise ConfigError(f"ngram_max_size is {cfg['ngram_max_size']}; it must be >= 1")
    if cfg["speculative_topk"] != 1:
        raise ConfigError(f"speculative_topk is {cfg['speculative_topk']}: tree drafts are not supported; only a "
                          f"linear chain of drafts (speculative_topk=1) is")
    if cfg["speculative"] == "none":
        return
    if cfg["temperature"] != 0:
        raise ConfigError(f"speculative={cfg['speculative']!r} with temperature={cfg['temperature']}: speculative "
                          f"decoding is greedy only (no rejection sampling); set temperature=0 or speculative=none")
    if cfg["speculative"] == "draft_model" and not os.path.isfile(cfg["draft_config_path"]):
        raise ConfigError(f"speculative='draft_model' needs draft_config_path to name the draft model's yml; got "
                          f"{cfg['draft_config_path']!r}, which is not a file")


def _derive(cfg: dict[str, Any], path: str) -> None:
    kda = set(cfg["kda_layers"])
    cfg["layer_types"] = ["kda" if i + 1 in kda else "mla" for i in range(cfg["num_decoder_layers"])]
    cfg["mlp_types"] = ["dense" if i < cfg["first_num_dense_layers"] else "moe"
                        for i in range(cfg["num_decoder_layers"])]
    cfg["config_path"] = path


def _freeze(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    return value


def load_config(path: str, overrides: Sequence[str] | Mapping[str, Any] = ()) -> ml_collections.FrozenConfigDict:
    """Loads `path` (a model yml), applies `overrides` (["key=value", ...] or a dict) and validates.

    Raises ConfigError naming the key, the value seen and what is allowed.
    """
    defaults = _read_yaml(BASE_CONFIG_PATH)
    defaults.pop("base_config", None)
    known = sorted(defaults)
    cfg = dict(defaults)
    for key, value in _load_chain(path).items():
        if key not in defaults:
            raise _unknown_key_error(key, known, path)
        cfg[key] = _coerce(key, value, defaults[key], path)
    items = overrides.items() if isinstance(overrides, Mapping) else (parse_override(a, defaults) for a in overrides)
    for key, value in items:
        if key not in defaults:
            raise _unknown_key_error(key, known, "the command line")
        cfg[key] = _coerce(key, value, defaults[key], "the command line")
    _validate(cfg)
    _derive(cfg, os.path.abspath(path))
    return ml_collections.FrozenConfigDict({k: _freeze(v) for k, v in cfg.items()})
