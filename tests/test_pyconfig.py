"""Config loading: layering, overrides, derived keys, and errors that name the key, the value and what is allowed."""

import pytest

from MaxText import pyconfig
from MaxText.pyconfig import ConfigError, load_config

TINY = f"{pyconfig.CONFIGS_DIR}/kimi_linear_tiny.yml"


def test_48b_architecture():
    c = load_config(f"{pyconfig.CONFIGS_DIR}/kimi_linear.yml")
    mla = [i + 1 for i, kind in enumerate(c.layer_types) if kind == "mla"]
    assert c.num_decoder_layers == 27 and mla == [4, 8, 12, 16, 20, 24, 27]
    assert (c.kda_num_heads, c.kda_head_dim, c.kda_conv_kernel_size) == (32, 128, 4)
    assert (c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.q_lora_rank) == (512, 128, 64,
                                                                                                     128, 0)
    assert (c.num_experts, c.num_experts_per_tok, c.shared_experts, c.moe_mlp_dim) == (256, 8, 1, 1024)
    assert c.mlp_types[0] == "dense" and set(c.mlp_types[1:]) == {"moe"} and c.mlp_dim == 9216
    assert (c.routed_scaling_factor, c.n_routing_groups, c.emb_dim, c.vocab_size) == (2.446, 1, 2304, 163840)
    assert c.normalization_layer_epsilon == 1e-5


def test_overrides_are_parsed_as_yaml_and_the_result_is_frozen():
    c = load_config(TINY, ["kda_kernel=naive", "temperature=1", "kda_layers=[1, 2, 4]", "mla_layers=[3]",
                           "norm_topk_prob=false"])
    assert c.kda_kernel == "naive" and c.temperature == 1.0 and isinstance(c.temperature, float)
    assert c.layer_types == ("kda", "kda", "mla", "kda") and c.norm_topk_prob is False
    with pytest.raises(Exception):
        c.steps = 3  # frozen


def test_a_yml_without_base_config_sits_on_base_yml(tmp_path):
    path = tmp_path / "config.yml"
    path.write_text("num_decoder_layers: 2\nkda_layers: [1]\nmla_layers: [2]\nfirst_num_dense_layers: 1\n")
    c = load_config(str(path))
    assert c.num_decoder_layers == 2 and c.emb_dim == 2304  # the rest from base.yml


def test_unknown_key_suggests_close_names():
    with pytest.raises(ConfigError, match=r"unknown config key 'kda_kernal' \(from the command line\); did you mean "
                                          r"'kda_kernel'"):
        load_config(TINY, ["kda_kernal=naive"])


def test_unknown_key_in_a_file_names_the_file(tmp_path):
    path = tmp_path / "model.yml"
    path.write_text(f"base_config: {pyconfig.BASE_CONFIG_PATH}\nemb_dimm: 64\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'emb_dimm' \(from .*model.yml\); did you mean 'emb_dim'"):
        load_config(str(path))


def test_bad_type_names_key_value_and_expected_type():
    with pytest.raises(ConfigError, match=r"config key 'emb_dim' \(from the command line\) must be of type int, got "
                                          r"'abc' \(string\)"):
        load_config(TINY, ["emb_dim=abc"])
    with pytest.raises(ConfigError, match=r"'norm_topk_prob' .* must be of type bool, got 1 \(int\)"):
        load_config(TINY, ["norm_topk_prob=1"])


def test_bad_enum_value_lists_the_allowed_values():
    with pytest.raises(ConfigError, match=r"config key 'kda_kernel' is 'foo'; allowed values: auto, naive, chunked, "
                                          r"pallas"):
        load_config(TINY, ["kda_kernel=foo"])


@pytest.mark.parametrize("overrides, message", [
    (["kda_layers=[1, 2]"], r"layers \[3\] are in neither kda_layers nor mla_layers"),
    (["mla_layers=[4, 5]"], r"mla_layers holds 5; layers are numbered 1..num_decoder_layers=4"),
    (["mla_layers=[3, 4]"], r"layer 3 is listed in both kda_layers and mla_layers"),
    (["num_experts=6", "n_routing_groups=4"], r"n_routing_groups=4 must divide num_experts=6"),
    (["kda_chunk_size=24"], r"kda_chunk_size is 24; it must be a multiple of 16"),
    (["ici_tensor_parallelism=0"], r"'ici_tensor_parallelism' is 0; it must be >= 1, or -1"),
    (["layer_types=[kda]"], r"'layer_types' .* is derived from other keys and cannot be set"),
    (["steps"], r"'steps' is not of the form key=value"),
    (["dense_kernel_layout=out_in", "dense_matmul=pallas"], r"dense_matmul='pallas' reads \[in, out\] kernels"),
    (["dense_kernel_layout=torch"], r"'dense_kernel_layout' is 'torch'; allowed values: in_out, out_in"),
    (["decode_loop_unroll=0"], r"'decode_loop_unroll' is 0; it must be >= 1"),
])
def test_invalid_values(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(TINY, overrides)


def test_missing_file():
    with pytest.raises(ConfigError, match=r"config file '.*configs/nope.yml' does not exist"):
        load_config(f"{pyconfig.CONFIGS_DIR}/nope.yml")


def test_string_values_are_taken_verbatim():
    c = load_config(TINY, ["prompt=def fibonacci(n): [1, 2]", "run_name=123", "dataset_path=a.py, b/*.txt"])
    assert c.prompt == "def fibonacci(n): [1, 2]" and c.run_name == "123" and c.dataset_path == "a.py, b/*.txt"
