"""HF safetensors -> Orbax conversion (MaxText/convert_hf_checkpoint.py) and params checkpoints (checkpointing.py)."""

import json
import os

import ml_dtypes
import numpy as np
import pytest

from end_to_end import tiny_hf
from MaxText import checkpointing, convert_hf_checkpoint, hf_weights, pyconfig


@pytest.fixture(scope="module")
def hf_model():
    config = tiny_hf.tiny_hf_config(q_lora_rank=8)
    return config, tiny_hf.tiny_hf_model(config)


@pytest.fixture(scope="module")
def native(hf_model):
    return tiny_hf.native_state_dict(hf_model[1])


def _write(directory, hf_model, native, layout="original", schema="original", num_shards=3, write_index=True):
    state = tiny_hf.original_state_dict(native) if layout == "original" else native
    config_json = (tiny_hf.original_config_json(hf_model[0].to_dict()) if schema == "original"
                   else tiny_hf.native_config_json(hf_model[0]))
    tiny_hf.write_checkpoint(str(directory), state, config_json, num_shards=num_shards, write_index=write_index)
    return str(directory)


def _flat(tree, prefix=()):
    out = {}
    for key, value in tree.items():
        out.update(_flat(value, prefix + (key,)) if isinstance(value, dict) else {prefix + (key,): value})
    return out


def _assert_no_output(out):
    assert not os.path.exists(out)
    leftovers = [n for n in os.listdir(os.path.dirname(out)) if ".partial-" in n]
    assert not leftovers, leftovers


@pytest.mark.parametrize("layout,schema,write_index", [
    ("original", "original", True), ("native", "native", True), ("original", "native", False),
    ("native", "original", False),
])
def test_convert_equals_hf_tensors(tmp_path, hf_model, native, layout, schema, write_index):
    hf_dir = _write(tmp_path / "hf", hf_model, native, layout, schema, num_shards=3, write_index=write_index)
    assert len([f for f in os.listdir(hf_dir) if f.endswith(".safetensors")]) == 3
    out = convert_hf_checkpoint.convert(hf_dir, str(tmp_path / "out"), progress=False)
    assert sorted(os.listdir(out)) == ["config.yml", "params"]
    config, params = checkpointing.load_for_inference(out)
    assert config.layer_types == ("kda", "kda", "kda", "mla") and config.q_lora_rank == 8
    assert config.n_routing_groups == 2 and config.weight_dtype == "float32"
    assert config.load_parameters_path == out
    expected = _flat(hf_weights.params_from_hf_state_dict(native, config))
    got = _flat(params)
    assert set(got) == set(expected)
    for path, value in expected.items():
        assert got[path].dtype == np.float32
        np.testing.assert_array_equal(got[path], value, err_msg="/".join(path))
    # Spot checks straight against the HF tensors (a kernel kept [out, in]: the default dense_kernel_layout; a fused
    # conv split; an expert slot, transposed).
    assert config.dense_kernel_layout == "out_in"
    model = params["params"]["model"]
    np.testing.assert_array_equal(params["params"]["lm_head"]["kernel"], native["lm_head.weight"])
    np.testing.assert_array_equal(model["layers_2"]["self_attn"]["v_conv1d"]["kernel"],
                                  native["model.layers.2.self_attn.conv1d.weight"][64:, 0, :].T)
    np.testing.assert_array_equal(model["layers_3"]["mlp"]["experts"]["up_proj"][6],
                                  native["model.layers.3.mlp.experts.gate_up_proj"][6, 32:, :].T)


def test_convert_cli_bfloat16_and_tokenizer_files(tmp_path, hf_model, native, capsys):
    hf_dir = _write(tmp_path / "hf", hf_model, native, num_shards=4)
    for name in convert_hf_checkpoint.TOKENIZER_FILES:
        (tmp_path / "hf" / name).write_text("{}" if name.endswith(".json") else "YQ== 0\n")
    out = str(tmp_path / "out")
    assert convert_hf_checkpoint.main(["--hf-path", hf_dir, "--output-dir", out, "--dtype", "bfloat16",
                                       "--no-progress"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert {"config.yml", "params", "tiktoken.model", "tokenizer_config.json"} == set(os.listdir(out))
    config = pyconfig.load_config(os.path.join(out, "config.yml"), ["mode=decode"])  # usable as-is
    assert config.weight_dtype == "bfloat16" and config.dtype == "bfloat16"
    params = checkpointing.load_params(out, config)
    model = params["params"]["model"]
    kernel = model["layers_0"]["self_attn"]["q_proj"]["kernel"]
    assert kernel.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(kernel, native["model.layers.0.self_attn.q_proj.weight"].astype(ml_dtypes.bfloat16))
    bias = model["layers_1"]["mlp"]["gate"]["e_score_correction_bias"]  # the router bias stays float32
    assert bias.dtype == np.float32
    np.testing.assert_array_equal(bias, native["model.layers.1.mlp.gate.e_score_correction_bias"])


# ------------------------------------------------------------------------------------------------ failures


def _corrupt_missing(hf_dir):
    path = os.path.join(hf_dir, "model.safetensors.index.json")
    index = json.load(open(path, encoding="utf-8"))
    victim = "model.layers.2.block_sparse_moe.experts.5.w3.weight"
    shard = os.path.join(hf_dir, index["weight_map"].pop(victim))
    from safetensors.numpy import load_file, save_file
    tensors = load_file(shard)
    del tensors[victim]
    save_file(tensors, shard)
    json.dump(index, open(path, "w", encoding="utf-8"))
    return r"missing tensor for params/model/layers_2/mlp/experts/up_proj \(experts 5\).*experts\.5\.w3\.weight"


def _corrupt_shape(hf_dir):
    index = json.load(open(os.path.join(hf_dir, "model.safetensors.index.json"), encoding="utf-8"))
    victim = "model.layers.1.self_attn.k_proj.weight"
    shard = os.path.join(hf_dir, index["weight_map"][victim])
    from safetensors.numpy import load_file, save_file
    tensors = load_file(shard)
    tensors[victim] = np.zeros((32, 60), np.float32)
    save_file(tensors, shard)
    return r"'model\.layers\.1\.self_attn\.k_proj\.weight' has shape \[32, 60\]; expected \[32, 64\]"


def _corrupt_truncated(hf_dir):
    shard = os.path.join(hf_dir, "model-00002-of-00003.safetensors")
    size = os.path.getsize(shard)
    with open(shard, "r+b") as f:
        f.truncate(size - 100)
    return r"model-00002-of-00003\.safetensors: truncated safetensors file: tensor '.*' ends at byte"


def _corrupt_unexpected(hf_dir):
    from safetensors.numpy import save_file
    save_file({"model.layers.0.self_attn.rotary_emb.inv_freq": np.zeros(4, np.float32)},
              os.path.join(hf_dir, "extra.safetensors"))
    os.remove(os.path.join(hf_dir, "model.safetensors.index.json"))
    return r"unexpected tensor 'model\.layers\.0\.self_attn\.rotary_emb\.inv_freq'"


@pytest.mark.parametrize("corrupt", [_corrupt_missing, _corrupt_shape, _corrupt_truncated, _corrupt_unexpected])
def test_corrupted_checkpoint_fails_cleanly(tmp_path, hf_model, native, corrupt, capsys):
    hf_dir = _write(tmp_path / "hf", hf_model, native)
    pattern = corrupt(hf_dir)
    out = str(tmp_path / "out")
    assert convert_hf_checkpoint.main(["--hf-path", hf_dir, "--output-dir", out, "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ")
    import re
    assert re.search(pattern, err, re.S), err
    _assert_no_output(out)


def test_failure_while_writing_leaves_nothing(tmp_path, hf_model, native, monkeypatch):
    hf_dir = _write(tmp_path / "hf", hf_model, native)
    out = str(tmp_path / "out")
    written = []

    def interrupted_save(directory, *args, **kwargs):
        written.append(directory)
        os.makedirs(os.path.join(directory, "params"))  # a half-written checkpoint
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpointing, "save_params", interrupted_save)
    with pytest.raises(KeyboardInterrupt):
        convert_hf_checkpoint.convert(hf_dir, out, progress=False)
    assert written and not os.path.exists(written[0])
    _assert_no_output(out)


def test_existing_output_is_not_overwritten(tmp_path, hf_model, native):
    hf_dir = _write(tmp_path / "hf", hf_model, native)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(convert_hf_checkpoint.ConversionError, match="already exists and is not empty"):
        convert_hf_checkpoint.convert(hf_dir, str(tmp_path / "out"), progress=False)
    assert os.listdir(tmp_path / "out") == ["keep.txt"]


# ------------------------------------------------------------------------------------------------ loading


def test_load_rejects_a_mismatched_config(tmp_path, hf_model, native):
    out = convert_hf_checkpoint.convert(_write(tmp_path / "hf", hf_model, native), str(tmp_path / "out"),
                                        progress=False)
    with pytest.raises(checkpointing.CheckpointError, match="kda_num_heads: checkpoint 2, config 4"):
        checkpointing.load_for_inference(out, kda_num_heads=4)
    with pytest.raises(checkpointing.CheckpointError, match="no params checkpoint"):
        checkpointing.load_for_inference(str(tmp_path / "hf"))
    config, _ = checkpointing.load_for_inference(out, max_target_length=64)  # non-architecture keys may change
    assert config.max_target_length == 64


def test_checkpoint_from_before_the_layout_key_loads_in_out(tmp_path, hf_model, native):
    """A config.yml written before `dense_kernel_layout` existed holds [in, out] kernels: loading takes that layout
    whatever base.yml's default."""
    out = convert_hf_checkpoint.convert(_write(tmp_path / "hf", hf_model, native), str(tmp_path / "out"),
                                        progress=False, dense_kernel_layout="in_out")
    config_file = os.path.join(out, checkpointing.CONFIG_FILE)
    with open(config_file, encoding="utf-8") as f:
        lines = f.readlines()
    with open(config_file, "w", encoding="utf-8") as f:
        f.writelines(line for line in lines if not line.startswith("dense_kernel_layout:"))
    config, params = checkpointing.load_for_inference(out)
    assert config.dense_kernel_layout == "in_out"
    assert params["params"]["lm_head"]["kernel"].shape == (hf_model[0].hidden_size, hf_model[0].vocab_size)
    with pytest.raises(checkpointing.CheckpointError,
                       match="dense_kernel_layout: checkpoint 'in_out', config 'out_in'"):
        checkpointing.load_for_inference(out, dense_kernel_layout="out_in")
    # A config of its own (train_or_decode.py with load_parameters_path) on the default layout: the error says how.
    with pytest.raises(checkpointing.CheckpointError, match=r"config.yml predates the key: set "
                                                            r"dense_kernel_layout=in_out\)"):
        checkpointing.load_params(out, pyconfig.load_config(config_file, ["dense_kernel_layout=out_in"]))


def test_save_and_sharded_load_round_trip(tmp_path, hf_model, native):
    import jax
    config = pyconfig.load_config(checkpointing.write_config(
        str(tmp_path), {**hf_weights.config_from_hf(hf_model[0].to_dict()), "weight_dtype": "float32"}))
    params = hf_weights.params_from_hf_state_dict(native, config)
    checkpointing.save_params(str(tmp_path / "ckpt"), params, config)
    device = jax.devices()[0]
    target = checkpointing.abstract_params(config, lambda path: jax.sharding.SingleDeviceSharding(device))
    restored = checkpointing.load_params(str(tmp_path / "ckpt"), config, target)
    leaf = restored["params"]["model"]["layers_1"]["mlp"]["experts"]["down_proj"]
    assert isinstance(leaf, jax.Array) and leaf.sharding == jax.sharding.SingleDeviceSharding(device)
    flat_restored, flat_params = _flat(restored), _flat(params)
    for path, value in flat_params.items():
        np.testing.assert_array_equal(np.asarray(flat_restored[path]), value)


@pytest.mark.parametrize("dense_kernel_layout", ["in_out", "out_in"])
def test_engine_from_converted_checkpoint_matches_hf(tmp_path, hf_model, dense_kernel_layout):
    """The whole user path on HF's own writer (save_pretrained: release layout, several shards): convert (the dense
    kernels stored either way), then Engine.from_checkpoint reproduces HF's logits."""
    import torch
    from MaxText.inference.engine import Engine
    hf_model[1].save_pretrained(tmp_path / "hf", max_shard_size="300KB")
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) >= 3
    out = convert_hf_checkpoint.convert(str(tmp_path / "hf"), str(tmp_path / "out"), progress=False,
                                        dense_kernel_layout=dense_kernel_layout)
    assert checkpointing.read_checkpoint_config(out)["dense_kernel_layout"] == dense_kernel_layout
    q_proj = checkpointing.load_for_inference(out)[1]["params"]["model"]["layers_0"]["self_attn"]["q_proj"]["kernel"]
    in_out = (hf_model[0].hidden_size, q_proj.size // hf_model[0].hidden_size)
    assert q_proj.shape == (in_out if dense_kernel_layout == "in_out" else in_out[::-1])
    ids = np.random.default_rng(0).integers(0, hf_model[0].vocab_size, (1, 11))
    with torch.no_grad():
        reference = hf_model[1](torch.tensor(ids)).logits.numpy()
    logits = Engine.from_checkpoint(out).logits(ids)
    np.testing.assert_allclose(logits, reference, atol=1e-4 * np.abs(reference).max(), rtol=0)


def test_convert_with_experts_stored_out_in(tmp_path, hf_model, native):
    """--expert-kernel-layout out_in: the routed experts stored as HF holds each expert's matrix ([out, in]), the key
    recorded in config.yml; a config of the other layout is refused by name."""
    hf_dir = _write(tmp_path / "hf", hf_model, native)
    out = str(tmp_path / "out")
    assert convert_hf_checkpoint.main(["--hf-path", hf_dir, "--output-dir", out, "--no-progress",
                                       "--expert-kernel-layout", "out_in"]) == 0
    config, params = checkpointing.load_for_inference(out)
    assert config.expert_kernel_layout == "out_in"
    expected = _flat(hf_weights.params_from_hf_state_dict(native, config))
    got = _flat(params)
    experts = [path for path in got if "experts" in path]
    assert experts and got.keys() == expected.keys()
    for path in experts:
        np.testing.assert_array_equal(got[path], expected[path], err_msg="/".join(path))
    hf = hf_model[0]
    assert got[("params", "model", "layers_1", "mlp", "experts", "gate_proj")].shape == (
        hf.num_experts, hf.moe_intermediate_size, hf.hidden_size)
    with pytest.raises(checkpointing.CheckpointError,
                       match="expert_kernel_layout: checkpoint 'out_in', config 'in_out'"):
        checkpointing.load_for_inference(out, expert_kernel_layout="in_out")
