"""HF config / state dict -> our config keys and param tree (MaxText/hf_weights.py), against tiny local HF models."""

import os
import tempfile

import numpy as np
import pytest
import yaml

from end_to_end import tiny_hf
from MaxText import hf_weights, pyconfig


@pytest.fixture(scope="module")
def hf_model():
    config = tiny_hf.tiny_hf_config(q_lora_rank=8, linear_num_heads=3, linear_head_dim=8)
    return config, tiny_hf.tiny_hf_model(config)


@pytest.fixture(scope="module")
def native(hf_model):
    return tiny_hf.native_state_dict(hf_model[1])


@pytest.fixture(scope="module")
def config(hf_model):
    return hf_weights.config_from_hf(hf_model[0].to_dict())


# ------------------------------------------------------------------------------------------------ config


def test_config_schemas_agree_and_load(hf_model):
    hf_config = hf_model[0]
    saved = hf_weights.config_from_hf(hf_config.to_dict())  # what save_pretrained writes
    native_names = hf_weights.config_from_hf(tiny_hf.native_config_json(hf_config))
    original = hf_weights.config_from_hf(tiny_hf.original_config_json(hf_config.to_dict()))
    assert saved == native_names == original
    assert saved["kda_layers"] == [1, 2, 3] and saved["mla_layers"] == [4]
    assert saved["kda_num_heads"] == 3 and saved["kda_head_dim"] == 8 and saved["q_lora_rank"] == 8
    assert saved["n_routing_groups"] == 2 and saved["num_experts"] == 8 and saved["num_experts_per_tok"] == 2
    assert saved["first_num_dense_layers"] == 1
    with tempfile.TemporaryDirectory() as tmp:  # the keys are valid pyconfig keys, usable without base_config
        path = os.path.join(tmp, "config.yml")
        with open(path, "w", encoding="utf-8") as f:
            yaml.safe_dump(saved, f)
        loaded = pyconfig.load_config(path)
    assert loaded.layer_types == ("kda", "kda", "kda", "mla")
    assert loaded.mlp_types == ("dense", "moe", "moe", "moe")


def test_config_original_schema_values():
    original = {
        "model_type": "kimi_linear", "vocab_size": 1000, "hidden_size": 32, "num_hidden_layers": 6,
        "intermediate_size": 64, "moe_intermediate_size": 16, "num_attention_heads": 4, "num_key_value_heads": 4,
        "kv_lora_rank": 8, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8, "q_lora_rank": None,
        "linear_attn_config": {"kda_layers": [1, 2, 4, 5], "full_attn_layers": [3, 6], "num_heads": 2,
                               "head_dim": 16, "short_conv_kernel_size": 3},
        "first_k_dense_replace": 2, "num_experts": 16, "num_experts_per_token": 3, "num_shared_experts": 2,
        "moe_renormalize": False, "num_expert_group": 4, "topk_group": 2, "routed_scaling_factor": 1.5,
        "rms_norm_eps": 1e-6, "mla_use_nope": True, "moe_layer_freq": 1,
    }
    cfg = hf_weights.config_from_hf(original)
    assert cfg["kda_layers"] == [1, 2, 4, 5] and cfg["mla_layers"] == [3, 6]
    assert (cfg["kda_num_heads"], cfg["kda_head_dim"], cfg["kda_conv_kernel_size"]) == (2, 16, 3)
    assert (cfg["first_num_dense_layers"], cfg["num_experts"], cfg["num_experts_per_tok"]) == (2, 16, 3)
    assert (cfg["shared_experts"], cfg["norm_topk_prob"], cfg["n_routing_groups"]) == (2, False, 4)
    assert (cfg["topk_routing_group"], cfg["routed_scaling_factor"], cfg["q_lora_rank"]) == (2, 1.5, 0)
    assert cfg["normalization_layer_epsilon"] == 1e-6
    # Without layer lists, KimiLinearConfig's default applies: full attention at 0-indexed layers 4, 8, ...
    del original["linear_attn_config"]
    assert hf_weights.config_from_hf(original)["mla_layers"] == [5]


@pytest.mark.parametrize("key,value,needle", [
    ("num_key_value_heads", 1, "num_key_value_heads"),
    ("mlp_layer_types", ["dense", "sparse", "dense", "sparse", "sparse", "sparse"], "mlp_layer_types"),
    ("layer_types", ["linear_attention"] * 5, "layer_types has 5 entries"),
    ("hidden_act", "gelu", "hidden_act"),
    ("tie_word_embeddings", True, "tie_word_embeddings"),
])
def test_config_unsupported_settings_are_named(key, value, needle):
    hf = tiny_hf.tiny_hf_config(num_hidden_layers=6, layer_types=["linear_attention"] * 6,
                                mlp_layer_types=["dense"] + ["sparse"] * 5).to_dict()
    hf[key] = value
    with pytest.raises(hf_weights.HFCheckpointError, match=needle):
        hf_weights.config_from_hf(hf)


def test_config_missing_required_key():
    hf = tiny_hf.tiny_hf_config().to_dict()
    del hf["hidden_size"]
    with pytest.raises(hf_weights.HFCheckpointError, match="hidden_size"):
        hf_weights.config_from_hf(hf)


# ------------------------------------------------------------------------------------------------ params


def _leaf(params, path):
    node = params
    for key in path.split("/"):
        node = node[key]
    return node


def test_native_layout_values(native, config):
    params = hf_weights.params_from_hf_state_dict(native, config)
    flat = {hf_weights.path_str(p): s for p, s in hf_weights.param_shapes(config).items()}
    for path, shape in flat.items():  # every leaf present with the expected shape
        assert _leaf(params, path).shape == shape, path
    m = "params/model/"
    np.testing.assert_array_equal(_leaf(params, m + "embed_tokens/embedding"), native["model.embed_tokens.weight"])
    np.testing.assert_array_equal(_leaf(params, "params/lm_head/kernel"), native["lm_head.weight"].T)
    np.testing.assert_array_equal(_leaf(params, m + "layers_0/self_attn/q_proj/kernel"),
                                  native["model.layers.0.self_attn.q_proj.weight"].T)
    conv = native["model.layers.1.self_attn.conv1d.weight"]  # [3 * 24, 1, 4]
    np.testing.assert_array_equal(_leaf(params, m + "layers_1/self_attn/k_conv1d/kernel"), conv[24:48, 0, :].T)
    np.testing.assert_array_equal(_leaf(params, m + "layers_1/self_attn/A_log"),
                                  native["model.layers.1.self_attn.forget_gate.A_log"].reshape(3))
    np.testing.assert_array_equal(_leaf(params, m + "layers_2/self_attn/f_b_proj/kernel"),
                                  native["model.layers.2.self_attn.forget_gate.f_b_proj.weight"].T)
    gate_up = native["model.layers.2.mlp.experts.gate_up_proj"]  # [E, 2I, D]
    np.testing.assert_array_equal(_leaf(params, m + "layers_2/mlp/experts/gate_proj")[5], gate_up[5, :32].T)
    np.testing.assert_array_equal(_leaf(params, m + "layers_2/mlp/experts/up_proj")[5], gate_up[5, 32:].T)
    np.testing.assert_array_equal(_leaf(params, m + "layers_2/mlp/experts/down_proj")[5],
                                  native["model.layers.2.mlp.experts.down_proj"][5].T)
    np.testing.assert_array_equal(_leaf(params, m + "layers_3/mlp/gate/e_score_correction_bias"),
                                  native["model.layers.3.mlp.gate.e_score_correction_bias"])
    np.testing.assert_array_equal(_leaf(params, m + "layers_3/self_attn/q_b_proj/kernel"),
                                  native["model.layers.3.self_attn.q_b_proj.weight"].T)
    np.testing.assert_array_equal(_leaf(params, m + "layers_0/mlp/down_proj/kernel"),
                                  native["model.layers.0.mlp.down_proj.weight"].T)


def _assert_trees_equal(a, b, prefix=""):
    assert set(a) == set(b), prefix
    for key in a:
        if isinstance(a[key], dict):
            _assert_trees_equal(a[key], b[key], f"{prefix}/{key}")
        else:
            np.testing.assert_array_equal(a[key], b[key], err_msg=f"{prefix}/{key}")


@pytest.mark.parametrize("dense_prefix", ["mlp", "block_sparse_moe"])
def test_original_layout_equals_native(native, config, dense_prefix):
    original = tiny_hf.original_state_dict(native, dense_prefix=dense_prefix)
    assert "model.layers.1.block_sparse_moe.experts.7.w2.weight" in original
    assert "model.layers.0.self_attn.q_conv1d.weight" in original
    _assert_trees_equal(hf_weights.params_from_hf_state_dict(original, config),
                        hf_weights.params_from_hf_state_dict(native, config))


def test_save_pretrained_layout_equals_native(hf_model, native, config, tmp_path):
    """HF's own save_pretrained writes the original (release) layout; it converts to the same params."""
    from safetensors.numpy import load_file
    hf_model[1].save_pretrained(tmp_path)
    saved = load_file(os.path.join(tmp_path, "model.safetensors"))
    assert "model.layers.1.block_sparse_moe.experts.0.w1.weight" in saved
    _assert_trees_equal(hf_weights.params_from_hf_state_dict(saved, config),
                        hf_weights.params_from_hf_state_dict(native, config))


def test_torch_tensors_are_accepted(hf_model, native, config):
    _assert_trees_equal(hf_weights.params_from_hf_state_dict(hf_model[1].state_dict(), config),
                        hf_weights.params_from_hf_state_dict(native, config))


def test_streaming_pieces_assemble_to_the_same_params(native, config):
    """convert_tensor, one tensor at a time with experts arriving in any order, rebuilds the same tree."""
    original = tiny_hf.original_state_dict(native)
    specs = hf_weights.hf_tensor_specs(config)
    hf_weights.check_tensor_shapes({n: a.shape for n, a in original.items()}, config)
    shapes = hf_weights.param_shapes(config)
    leaves = {}
    for name in sorted(original, reverse=True):
        for piece in hf_weights.convert_tensor(name, original[name], specs):
            if piece.slot is None:
                leaves[piece.path] = np.array(piece.value)
            else:
                leaves.setdefault(piece.path, np.full(shapes[piece.path], np.nan, np.float32))[piece.slot] = piece.value
    expected = hf_weights.params_from_hf_state_dict(native, config)
    for path, value in leaves.items():
        np.testing.assert_array_equal(value, _leaf(expected, hf_weights.path_str(path)))
    assert set(leaves) == set(shapes)


# ------------------------------------------------------------------------------------------------ errors


def test_errors_name_the_tensor(native, config):
    bad = dict(native)
    del bad["model.layers.2.mlp.experts.down_proj"]
    bad["model.layers.0.self_attn.q_proj.weight"] = np.zeros((3, 5), np.float32)
    bad["model.layers.9.self_attn.q_proj.weight"] = np.zeros((2,), np.float32)
    with pytest.raises(hf_weights.HFCheckpointError) as info:
        hf_weights.params_from_hf_state_dict(bad, config)
    message = str(info.value)
    assert "'model.layers.0.self_attn.q_proj.weight' has shape [3, 5]; expected [24, 64]" in message
    assert "unexpected tensor 'model.layers.9.self_attn.q_proj.weight'" in message
    assert "missing tensor for params/model/layers_2/mlp/experts/down_proj (experts 0-7)" in message
    assert "'model.layers.2.mlp.experts.down_proj' [8, 64, 32] (native layout)" in message


def test_missing_single_expert_and_mixed_layouts(native, config):
    original = tiny_hf.original_state_dict(native)
    del original["model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    with pytest.raises(hf_weights.HFCheckpointError,
                       match=r"layers_1/mlp/experts/up_proj \(experts 3\).*experts\.3\.w3\.weight"):
        hf_weights.params_from_hf_state_dict(original, config)
    mixed = tiny_hf.original_state_dict(native)
    mixed["model.layers.2.mlp.experts.down_proj"] = native["model.layers.2.mlp.experts.down_proj"]
    with pytest.raises(hf_weights.HFCheckpointError, match="mixes the original and transformers-native layouts"):
        hf_weights.params_from_hf_state_dict(mixed, config)


def test_config_mismatch_is_reported(native, config):
    """A checkpoint of another config (MLA where the config says KDA) fails with unexpected + missing tensors."""
    other = dict(config, kda_layers=[1, 2, 3, 4], mla_layers=[])
    with pytest.raises(hf_weights.HFCheckpointError, match=r"unexpected tensor 'model\.layers\.3\.self_attn\.q_a_proj"):
        hf_weights.params_from_hf_state_dict(native, other)


# ------------------------------------------------------------------------------------------------ one KDA layer


def test_kda_layer_params_from_standalone_module(hf_model, native, config):
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention
    layer = KimiLinearDeltaAttention(hf_model[0], layer_idx=0)
    state = {k: v.detach().numpy() for k, v in layer.state_dict().items()}
    params = hf_weights.kda_layer_params(state, "", config)
    assert set(params) == {"q_proj", "k_proj", "v_proj", "q_conv1d", "k_conv1d", "v_conv1d", "f_a_proj",
                           "f_b_proj", "A_log", "dt_bias", "b_proj", "g_a_proj", "g_b_proj", "o_norm", "o_proj"}
    np.testing.assert_array_equal(params["v_conv1d"]["kernel"], state["conv1d.weight"][48:, 0, :].T)
    np.testing.assert_array_equal(params["dt_bias"], state["forget_gate.dt_bias"])
    np.testing.assert_array_equal(params["o_norm"]["scale"], state["o_norm.weight"])
    # The same layer taken out of a full checkpoint by its prefix.
    from_full = hf_weights.kda_layer_params(native, "model.layers.1.self_attn.", config)
    full = hf_weights.params_from_hf_state_dict(native, config)["params"]["model"]["layers_1"]["self_attn"]
    _assert_trees_equal(from_full, full)


@pytest.mark.parametrize("layout", ["native", "original"])
def test_experts_convert_to_the_out_in_layout(native, config, layout):
    """expert_kernel_layout out_in: each routed expert's matrices as HF stores them ([out, in]), from either HF
    layout; every other leaf as in the default in_out tree."""
    state = native if layout == "native" else tiny_hf.original_state_dict(native, dense_prefix="mlp")
    out_in = hf_weights.params_from_hf_state_dict(state, {**config, "expert_kernel_layout": "out_in"})
    in_out = hf_weights.params_from_hf_state_dict(state, config)
    experts = "params/model/layers_2/mlp/experts/"
    for name in ("gate_proj", "up_proj", "down_proj"):
        np.testing.assert_array_equal(_leaf(out_in, experts + name), _leaf(in_out, experts + name).transpose(0, 2, 1))
    gate_up = native["model.layers.2.mlp.experts.gate_up_proj"]  # [E, 2I, D]
    np.testing.assert_array_equal(_leaf(out_in, experts + "gate_proj")[5], gate_up[5, :32])

    def relaid(tree, path=()):  # in_out's tree with every routed expert's matrices transposed
        if isinstance(tree, dict):
            return {key: relaid(value, (*path, key)) for key, value in tree.items()}
        return tree.transpose(0, 2, 1) if "experts" in path else tree
    _assert_trees_equal(out_in, relaid(in_out))
