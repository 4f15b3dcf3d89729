"""Sharding over a device mesh: sharded == single-device on 8 virtual CPU devices, 48B spec table, mesh errors.

The 8-device checks run in one subprocess (tests/sharding_driver.py): XLA_FLAGS must be set before JAX starts, and
the rest of the suite keeps one device. The other tests run here on abstract meshes (no devices needed).
"""

from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import sys

import jax
import pytest

from MaxText import pyconfig, sharding

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "configs", "kimi_linear_tiny.yml")
FULL = os.path.join(REPO, "configs", "kimi_linear.yml")
TOLERANCE = 1e-5
MESHES = ("tensor=2", "tensor=4", "data=2 x tensor=2", "expert=4 x tensor=2", "fsdp=8")


@functools.lru_cache(maxsize=None)
def _report(tmp_dir: str) -> dict:
    out = os.path.join(tmp_dir, "sharding_report.json")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO,
               # Low XLA optimization: the same program on 1 and 8 devices, compiled twice as fast on 2 cores.
               XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0")
    result = subprocess.run([sys.executable, os.path.join(REPO, "tests", "sharding_driver.py"), out], cwd=REPO,
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"sharding driver failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    with open(out, encoding="utf-8") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return _report(str(tmp_path_factory.mktemp("sharding")))


def abstract_mesh(**sizes) -> jax.sharding.AbstractMesh:
    return jax.sharding.AbstractMesh(tuple(sizes.get(a, 1) for a in sharding.MESH_AXES), sharding.MESH_AXES)


@pytest.mark.parametrize("mesh", MESHES)
def test_sharded_engine_and_train_step_equal_single_device(report, mesh):
    """engine.logits, 16 greedy tokens, one train step's loss, gradients (Adam's first moments, relative to each
    param's largest) and updated params: sharded == 1 device (fp32)."""
    result = report["meshes"][mesh]
    assert result["logits_diff"] <= TOLERANCE, result
    assert result["tokens_equal"], result
    assert result["loss_diff"] <= TOLERANCE, result
    assert result["params_diff"] <= TOLERANCE, result
    assert result["grads_rel_diff"] <= TOLERANCE, result
    assert result["engine_param_placement"] == [] and result["train_state_placement"] == [], result
    named = dict(part.split("=") for part in mesh.split(" x "))
    assert {axis: size for axis, size in result["mesh"].items() if size > 1} == {a: int(n) for a, n in named.items()}


def test_params_are_split_as_the_rules_say(report):
    # lm_head's kernel is stored [vocab, embed] (dense_kernel_layout out_in, the default): vocab split over tensor
    assert report["meshes"]["tensor=2"]["lm_head_spec"] == "P('tensor', 'fsdp')"
    assert report["meshes"]["expert=4 x tensor=2"]["experts_spec"] == "P('expert', 'fsdp', 'tensor')"


def test_chunked_kda_prefill_never_gathers_the_state(report):
    """Under tensor=2 the chunked kernel runs on each device's own heads: no all-gather of a [B, H, K, V] state."""
    assert report["kda_state_all_gathers"] == []


def test_kda_kernel_under_shard_map_equals_the_unsharded_kernel(report):
    assert report["kernel_shard_map_diff"] <= TOLERANCE


def test_sharded_checkpoint_restore_reads_only_each_devices_shard(report):
    ckpt = report["checkpoint"]
    assert ckpt["placement_problems"] == [] and ckpt["values_diff"] == 0.0
    # q_proj stored [out, in] (dense_kernel_layout out_in): its heads split over tensor=4
    assert ckpt["q_proj_global_shape"] == [128, 64] and ckpt["q_proj_shard_shape"] == [32, 64]
    assert ckpt["from_checkpoint_logits_diff"] <= TOLERANCE


def test_no_large_param_is_replicated_in_the_48b_model_under_tensor_8():
    config = pyconfig.load_config(FULL, ["ici_tensor_parallelism=8"])
    rows = sharding.param_spec_table(config, {"tensor": 8})
    assert len(rows) > 500 and rows[0][0].endswith("experts/down_proj")  # the table covers the whole model
    replicated = [(path, shape) for path, shape, _, _, is_replicated in rows
                  if is_replicated and math.prod(shape) > 1_000_000]
    assert replicated == []
    sharding.check_mesh_fits_model(config, abstract_mesh(tensor=8))  # and every split divides


def test_mesh_that_does_not_divide_the_model_names_the_numbers():
    config = pyconfig.load_config(FULL)
    with pytest.raises(sharding.ShardingError, match=r"32 KDA heads .* 3 devices of mesh axis tensor"):
        sharding.check_mesh_fits_model(config, abstract_mesh(tensor=3))
    with pytest.raises(sharding.ShardingError, match=r"256 routed experts .* 3 devices of mesh axis expert"):
        sharding.check_mesh_fits_model(config, abstract_mesh(expert=3))
    tiny = pyconfig.load_config(TINY, {"kda_num_heads": 4, "num_query_heads": 4, "vocab_size": 258})
    with pytest.raises(sharding.ShardingError, match=r"embedding \[258, 64\]: dim 0 \(logical 'vocab'\) has 258 "
                                                     r"entries, which the 4 shards of mesh axis tensor do not divide"):
        sharding.check_mesh_fits_model(tiny, abstract_mesh(tensor=4))


def test_mesh_sizes_fill_and_device_count_errors():
    fill = pyconfig.load_config(TINY, ["ici_data_parallelism=-1", "ici_tensor_parallelism=2"])
    assert sharding.mesh_axis_sizes(fill, 8) == ([4, 1, 1, 2], [1, 1, 1, 1])
    with pytest.raises(sharding.ShardingError, match=r"ici_tensor_parallelism=16 = 16 devices .* only 8"):
        sharding.mesh_axis_sizes(pyconfig.load_config(TINY, ["ici_tensor_parallelism=16"]), 8)
    with pytest.raises(sharding.ShardingError, match=r"cannot fill 8 devices per process, which 3 does not divide"):
        sharding.mesh_axis_sizes(pyconfig.load_config(TINY, ["ici_data_parallelism=-1",
                                                             "ici_tensor_parallelism=3"]), 8)
    multi = pyconfig.load_config(TINY, ["dcn_data_parallelism=-1", "ici_tensor_parallelism=4"])
    assert sharding.mesh_axis_sizes(multi, 8, num_processes=2) == ([1, 1, 1, 4], [2, 1, 1, 1])


def test_distributed_initialize_is_skipped_without_a_coordinator(monkeypatch):
    for var in ("JAX_COORDINATOR_ADDRESS", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert not sharding.maybe_initialize_distributed(pyconfig.load_config(TINY))
    assert not sharding.maybe_initialize_distributed(pyconfig.load_config(TINY, ["jax_distributed_initialize=never"]))
    with pytest.raises(pyconfig.ConfigError, match="jax_distributed_initialize"):
        pyconfig.load_config(TINY, ["jax_distributed_initialize=yes"])
