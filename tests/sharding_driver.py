"""Sharded-vs-single-device checks on 8 virtual CPU devices; run by tests/test_sharding.py in a subprocess.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/sharding_driver.py OUT.json

The flag must be set before JAX initializes, which is why this is a separate process (the rest of the suite keeps
one device). Every mesh runs in this one process so that the model is built and compiled for the reference once.
Writes a JSON report: per mesh, the max |logit| difference, whether the greedy tokens, the train loss and the
updated params match, and the placement checks; plus the kernel shard_map, checkpoint and state-gather checks.
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from MaxText import checkpointing, pyconfig, sharding, train
from MaxText.data import Batch
from MaxText.inference.engine import Engine
from MaxText.kernels.kda import chunked_kda
from MaxText.kernels.kda.sharded import shard_map_over_rows_and_heads
from MaxText.layers.models import KimiLinearForCausalLM

TINY = "configs/kimi_linear_tiny.yml"
# One KDA and one MLA layer, a dense then a MoE MLP; head and expert counts that the meshes below divide. Adam's eps
# lies above this model's smallest gradients (~1e-8): at eps 1e-8 the first step's g / (|g| + eps) turned the float
# rounding of such a gradient (a few % of it) into parameter differences of 1e-5 (tensor=4, dense down_proj);
# the gradients themselves are compared through Adam's first moments (`grads_rel_diff`).
MODEL = {"num_decoder_layers": 2, "kda_layers": [1], "mla_layers": [2], "first_num_dense_layers": 1,
         "kda_num_heads": 4, "num_query_heads": 4, "num_experts": 8, "kda_kernel": "naive", "kda_chunk_size": 16,
         "max_target_length": 64, "param_init_std": 0.08, "learning_rate": 1e-3, "warmup_steps": 0,
         "adam_eps": 1e-6}
MESHES = {
    "tensor=2": {"ici_tensor_parallelism": 2},
    "tensor=4": {"ici_tensor_parallelism": 4},
    "data=2 x tensor=2": {"ici_data_parallelism": 2, "ici_tensor_parallelism": 2},
    "expert=4 x tensor=2": {"ici_expert_parallelism": 4, "ici_tensor_parallelism": 2},
    "fsdp=8": {"ici_fsdp_parallelism": 8},
}
NEW_TOKENS = 16
TOLERANCE = 1e-5


def config(**overrides):
    return pyconfig.load_config(TINY, {**MODEL, **overrides})


def train_batch(cfg) -> Batch:
    """8 rows of 32 tokens, two packed documents per row."""
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, cfg.vocab_size, (8, 32)).astype(np.int32)
    segment_ids = np.where(np.arange(32) < 13, 1, 2).astype(np.int32)[None].repeat(8, 0)
    loss_mask = (segment_ids[:, 1:] == segment_ids[:, :-1]).astype(np.float32)
    return Batch(tokens, segment_ids, np.concatenate([loss_mask, np.zeros((8, 1), np.float32)], axis=1))


def run_train_step(cfg, params, batch):
    model, optimizer = KimiLinearForCausalLM(cfg), train.make_optimizer(cfg)
    shardings = train.train_sharding(cfg, model, optimizer)
    state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": optimizer.init(params)}
    state = jax.device_put(state, shardings.state)
    state, metrics = train.make_train_step(model, optimizer, shardings)(state, jax.device_put(batch, shardings.batch))
    return state, float(metrics["loss"]), shardings


def max_tree_diff(a, b) -> float:
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in
               zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def first_moments(state) -> list[np.ndarray]:
    """Adam's first moments in a train state (after one step: (1 - b1) times the clipped gradients), per param."""
    adam = [s for s in jax.tree.leaves(state["opt_state"], is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
            if isinstance(s, optax.ScaleByAdamState)]
    return [np.asarray(leaf) for s in adam for leaf in jax.tree.leaves(jax.device_get(s.mu))]


def max_relative_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    """max over pairs of max |x - y| / max |y| (0 where both are all zero)."""
    return max(float(np.max(np.abs(x - y))) / max(float(np.max(np.abs(y))), np.finfo(np.float32).tiny)
               for x, y in zip(a, b))


def placement_problems(tree, shardings) -> list[str]:
    """Leaves whose sharding is not the expected one (compared by how they split the array)."""
    problems = []
    for (path, leaf), want in zip(jax.tree_util.tree_flatten_with_path(tree)[0], jax.tree.leaves(
            shardings, is_leaf=lambda x: isinstance(x, jax.sharding.NamedSharding))):
        if not leaf.sharding.is_equivalent_to(want, leaf.ndim):
            problems.append(f"{jax.tree_util.keystr(path)}: {leaf.sharding} != {want}")
    return problems


def state_all_gathers(params) -> list[str]:
    """all-gather instructions in the compiled tensor=2 prefill (chunked KDA kernel) whose result has the KDA state's
    full [B, H, K, V] shape, or the cache ring's [B, S=1, H, K, V]: the kernel must run on each device's own heads."""
    cfg = config(ici_tensor_parallelism=2, kda_kernel="chunked")
    engine = Engine(cfg, params)
    tokens = jnp.zeros((2, 32), jnp.int32)
    with sharding.mesh_context(engine.mesh, cfg):
        hlo = jax.jit(engine._prefill_fn).lower(engine.params, tokens, jnp.ones_like(tokens)).compile().as_text()
    state = rf"f32\[2,(1,)?{cfg.kda_num_heads},{cfg.kda_head_dim},{cfg.kda_head_dim}\]"
    return [line.strip()[:160] for line in hlo.splitlines() if "all-gather" in line and re.search(state, line)]


def kernel_shard_map_diff() -> float:
    """A KDA kernel run per (row, head) shard under shard_map (the Pallas path) == the unsharded kernel."""
    rng = np.random.default_rng(0)
    B, T, H, K = 4, 40, 4, 16
    q, k, v, g = (jnp.asarray(rng.standard_normal((B, T, H, K)), jnp.float32) for _ in range(4))
    beta = jax.nn.sigmoid(jnp.asarray(rng.standard_normal((B, T, H)), jnp.float32))
    state = jnp.asarray(rng.standard_normal((B, H, K, K)), jnp.float32)
    A_log, dt_bias = jnp.asarray(rng.standard_normal(H), jnp.float32), jnp.asarray(rng.standard_normal(H * K))
    kwargs = dict(initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True,
                  use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, chunk_size=16)
    ref = chunked_kda(q, k, v, g, beta, **kwargs)
    mesh = sharding.create_mesh(config(ici_data_parallelism=2, ici_tensor_parallelism=2))
    fn = shard_map_over_rows_and_heads(chunked_kda, mesh, ("data", "fsdp"), ("tensor",))
    out = jax.jit(lambda *a: fn(*a, **kwargs))(q, k, v, g, beta)
    return max_tree_diff(out, ref)


def checkpoint_report(cfg_mesh, params, reference_logits, tokens) -> dict:
    """Sharded restore: each leaf lands on its param sharding with only its shard per device; Engine.from_checkpoint
    (a tensor=2 override) reproduces the logits."""
    with tempfile.TemporaryDirectory() as directory:
        checkpointing.save_params(directory, jax.device_get(params), cfg_mesh)
        mesh = sharding.create_mesh(cfg_mesh)
        restored = checkpointing.load_sharded_params(directory, cfg_mesh, mesh)["params"]
        expected = sharding.param_shardings(cfg_mesh, mesh)
        kernel = restored["model"]["layers_0"]["self_attn"]["q_proj"]["kernel"]
        engine = Engine.from_checkpoint(directory, ici_tensor_parallelism=2, kda_kernel=MODEL["kda_kernel"])
        return {"placement_problems": placement_problems(restored, expected),
                "q_proj_shard_shape": list(kernel.addressable_shards[0].data.shape),
                "q_proj_global_shape": list(kernel.shape),
                "values_diff": max_tree_diff(restored, params),
                "from_checkpoint_logits_diff": float(np.max(np.abs(engine.logits(tokens) - reference_logits)))}


def main(out_path: str) -> None:
    assert jax.device_count() == 8, f"expected 8 virtual devices, got {jax.device_count()}"
    started = time.perf_counter()
    reference_cfg = config()
    params = jax.device_get(train.init_params(KimiLinearForCausalLM(reference_cfg), reference_cfg,
                                              jax.random.key(0)))
    tokens = np.random.default_rng(1).integers(0, reference_cfg.vocab_size, (2, 20)).tolist()
    prompts = [tokens[0][:5], tokens[1][:11]]
    reference = Engine(reference_cfg, params)
    reference_logits = reference.logits(tokens)
    reference_tokens = reference.generate(prompts, NEW_TOKENS)
    batch = train_batch(reference_cfg)
    reference_state, reference_loss, _ = run_train_step(reference_cfg, params, batch)
    reference_params = jax.device_get(reference_state["params"])
    reference_moments = first_moments(reference_state)
    report = {"meshes": {}, "seconds": {"reference": time.perf_counter() - started}}

    for name, overrides in MESHES.items():
        t0 = time.perf_counter()
        cfg = config(**overrides)
        engine = Engine(cfg, params)
        logits = engine.logits(tokens)
        generated = engine.generate(prompts, NEW_TOKENS)
        state, loss, shardings = run_train_step(cfg, params, batch)
        report["meshes"][name] = {
            "mesh": dict(engine.mesh.shape),
            "logits_diff": float(np.max(np.abs(logits - reference_logits))),
            "tokens_equal": generated == reference_tokens,
            "loss_diff": abs(loss - reference_loss),
            "params_diff": max_tree_diff(jax.device_get(state["params"]), reference_params),
            "grads_rel_diff": max_relative_diff(first_moments(state), reference_moments),
            "engine_param_placement": placement_problems(engine.params, engine.param_shardings),
            "train_state_placement": placement_problems(state, shardings.state),
            "lm_head_spec": str(engine.params["lm_head"]["kernel"].sharding.spec),
            "experts_spec": str(engine.params["model"]["layers_1"]["mlp"]["experts"]["gate_proj"].sharding.spec),
        }
        report["seconds"][name] = time.perf_counter() - t0

    t0 = time.perf_counter()
    report["kda_state_all_gathers"] = state_all_gathers(params)
    report["kernel_shard_map_diff"] = kernel_shard_map_diff()
    report["checkpoint"] = checkpoint_report(config(ici_tensor_parallelism=4), params, reference_logits, tokens)
    report["seconds"]["state gathers + kernel + checkpoint"] = time.perf_counter() - t0
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
