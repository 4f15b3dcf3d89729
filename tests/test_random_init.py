"""MaxText/random_init.py: params made leaf by leaf on the device have init_params' tree, shapes, dtypes and
shardings, the layers' init distributions, and an unknown param name is an error before anything is made."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText import pyconfig, random_init, sharding
from MaxText.layers.models import KimiLinearForCausalLM
from MaxText.train import init_params

TINY_BF16 = pyconfig.load_config("configs/kimi_linear_tiny.yml", ["weight_dtype=bfloat16"])  # as the benchmark
BF16_ROUNDING = 2 ** -7  # relative spacing of bfloat16 values


@pytest.fixture(scope="module")
def made():
    """(mesh, params, summary) of the tiny model in bf16 on a 1-device mesh."""
    mesh = sharding.create_mesh(TINY_BF16)
    params, summary = random_init.random_params_on_device(TINY_BF16, mesh, jax.random.key(0, impl="rbg"),
                                                          progress=False)
    return mesh, params, summary


def flat(tree) -> dict[str, jax.Array]:
    return {jax.tree_util.keystr(path, simple=True, separator="/"): leaf
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def test_tree_shapes_dtypes_and_shardings_equal_init_params(made):
    mesh, params, summary = made
    shardings = sharding.param_shardings(TINY_BF16, mesh)
    expected = jax.eval_shape(lambda key: init_params(KimiLinearForCausalLM(TINY_BF16), TINY_BF16, key, shardings),
                              jax.random.key(0))
    assert jax.tree.structure(params) == jax.tree.structure(expected)
    got, want, want_shardings = flat(params), flat(expected), flat(shardings)
    for name, leaf in got.items():
        assert (leaf.shape, leaf.dtype) == (want[name].shape, want[name].dtype), name
        assert isinstance(leaf, jax.Array) and leaf.sharding == want_shardings[name], name
    assert got["model/layers_1/mlp/gate/e_score_correction_bias"].dtype == jnp.float32  # not weight_dtype
    assert got["model/layers_1/mlp/experts/gate_proj"].dtype == jnp.bfloat16
    assert summary.num_leaves == len(got) and summary.num_params == sum(x.size for x in got.values())
    assert summary.num_bytes == sum(x.nbytes for x in got.values())
    # One program per (init kind, shape, dtype, sharding), not per param: the 3 KDA layers share theirs.
    assert summary.num_generators < len(got) / 2, summary


def test_values_follow_the_layers_initializers(made):
    _, params, _ = made
    got = {name: np.asarray(leaf, np.float32) for name, leaf in flat(params).items()}
    std = TINY_BF16.param_init_std
    normal = [name for name in got if (name.endswith("/kernel") and "_conv1d/" not in name)
              or name.endswith("/embedding") or "/experts/" in name]
    assert len(normal) > 40
    pooled = np.concatenate([got[name].ravel() for name in normal])
    assert abs(pooled.mean()) < 0.02 * std and pooled.std() == pytest.approx(std, rel=0.03)
    for name in ("lm_head/kernel", "model/layers_1/mlp/experts/down_proj", "model/embed_tokens/embedding"):
        assert got[name].std() == pytest.approx(std, rel=0.1), name
    conv = np.concatenate([got[f"model/layers_{i}/self_attn/{p}_conv1d/kernel"].ravel()
                           for i in range(3) for p in "qkv"])
    assert conv.std() == pytest.approx(TINY_BF16.kda_conv_kernel_size ** -0.5, rel=0.1)
    scales = [name for name in got if name.endswith("/scale")]
    assert len(scales) == 1 + 2 * 4 + 3 + 1  # final norm, 2 per layer, 3 KDA o_norms, MLA kv_a_layernorm
    assert all(np.all(got[name] == 1.0) for name in scales)
    for i in (1, 2, 3):
        assert np.all(got[f"model/layers_{i}/mlp/gate/e_score_correction_bias"] == 0.0)
    a_log = np.concatenate([got[f"model/layers_{i}/self_attn/A_log"] for i in range(3)])
    assert np.all(a_log >= 0.0) and np.all(a_log <= math.log(16.0) * (1 + BF16_ROUNDING)), a_log
    dt = np.log1p(np.exp(np.concatenate([got[f"model/layers_{i}/self_attn/dt_bias"] for i in range(3)])))
    assert np.all(dt >= 1e-3 * (1 - 4 * BF16_ROUNDING)) and np.all(dt <= 1e-1 * (1 + 4 * BF16_ROUNDING))
    assert dt.min() < 3e-3 and dt.max() > 3e-2  # log-uniform over two decades
    # Each param draws its own bits: same-shape params of one layer and the same param of two layers differ.
    q_proj = got["model/layers_1/self_attn/q_proj/kernel"]
    assert not np.array_equal(q_proj, got["model/layers_1/self_attn/k_proj/kernel"])
    assert not np.array_equal(q_proj, got["model/layers_2/self_attn/q_proj/kernel"])


def test_unknown_param_name_is_an_error_before_anything_is_made(monkeypatch):
    with pytest.raises(random_init.UnknownParamError, match=r"model/layers_0/self_attn/mystery_bias.*'mystery_bias'"):
        random_init.init_kind(("model", "layers_0", "self_attn", "mystery_bias"))
    assert random_init.init_kind(("model", "layers_0", "self_attn", "q_conv1d", "kernel")) == "conv_kernel"
    assert random_init.init_kind(("model", "layers_1", "mlp", "experts", "up_proj")) == "normal"
    with pytest.raises(random_init.UnknownParamError, match="model/layers_0/mlp/up_proj"):  # a dense MLP's up_proj
        random_init.init_kind(("model", "layers_0", "mlp", "up_proj"))  # is a module; its param is `kernel`

    real = sharding.abstract_boxed_params

    def with_a_new_param(config):
        boxed = real(config)
        boxed["model"]["layers_2"]["self_attn"]["new_gate"] = nn.LogicallyPartitioned(
            jax.ShapeDtypeStruct((4,), jnp.float32), names=(None,))
        return boxed

    monkeypatch.setattr(sharding, "abstract_boxed_params", with_a_new_param)
    mesh = sharding.create_mesh(TINY_BF16)
    made = []
    monkeypatch.setattr(random_init, "_generate", lambda *args: made.append(args))
    with pytest.raises(random_init.UnknownParamError, match="model/layers_2/self_attn/new_gate"):
        random_init.random_params_on_device(TINY_BF16, mesh, jax.random.key(0), progress=False)
    assert made == []
