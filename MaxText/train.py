"""Training: AdamW with warmup + cosine decay, gradient clipping, packed rows, held-out loss, Orbax checkpoints.

`train(config)` runs `config.steps` optimizer steps on the packed local dataset (MaxText/data.py), shows a progress
bar (step, loss, tokens/s, learning rate), evaluates the held-out loss every `eval_interval` steps, saves a
checkpoint (params, optimizer state, step) every `checkpoint_period` steps and at the end, and with `resume=true`
continues from the latest one. Params are kept in `weight_dtype` (float32 master weights); the forward runs in
`dtype` (bfloat16 compute is `dtype=bfloat16`). A non-finite loss or gradient stops training with the step number;
the checkpoints written before it are kept.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp
from tqdm import tqdm

from MaxText import sharding
from MaxText.data import Batch, PackedDataset, resolve_files, split_files
from MaxText.layers.models import KimiLinearForCausalLM
from MaxText.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

NO_DECAY_PARAMS = ("A_log", "dt_bias", "e_score_correction_bias")


class TrainingDivergedError(RuntimeError):
    """The loss or the gradient norm became NaN or infinite."""


@dataclasses.dataclass
class TrainResult:
    params: Any
    final_step: int
    eval_losses: dict[int, float]  # step -> held-out loss (nats per token)
    train_losses: dict[int, float]  # step -> training loss of that step's batch
    checkpoint_dir: str


def run_directory(config) -> str:
    return os.path.join(config.base_output_directory, config.run_name)


def learning_rate_schedule(config) -> optax.Schedule:
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=config.learning_rate, warmup_steps=config.warmup_steps,
        decay_steps=max(config.steps, config.warmup_steps + 1),
        end_value=config.learning_rate * config.cosine_end_fraction)


def weight_decay_mask(params):
    """Decay matrices only: not norm scales (1-D), biases, A_log, dt_bias or the router's correction bias."""
    def decays(path, leaf):
        name = str(getattr(path[-1], "key", path[-1]))
        return leaf.ndim >= 2 and name not in NO_DECAY_PARAMS
    return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(config) -> optax.GradientTransformation:
    adamw = optax.adamw(learning_rate_schedule(config), b1=config.adam_b1, b2=config.adam_b2, eps=config.adam_eps,
                        weight_decay=config.weight_decay, mask=weight_decay_mask)
    if config.max_grad_norm > 0:
        return optax.chain(optax.clip_by_global_norm(config.max_grad_norm), adamw)
    return adamw


def token_losses(model, params, batch: Batch) -> tuple[jax.Array, jax.Array]:
    """Per-token next-token cross entropy (float32) and its mask, both [B, L-1]."""
    logits = model.apply({"params": params}, batch.tokens, model_mode="train",
                         decoder_segment_ids=batch.segment_ids)  # [B, L, vocab]
    log_probs = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    targets = batch.tokens[:, 1:]
    losses = -jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    return losses, batch.loss_mask[:, :-1]


def mean_loss(model, params, batch: Batch) -> jax.Array:
    losses, mask = token_losses(model, params, batch)
    return jnp.sum(losses * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def init_params(model, config, rng, shardings=None):
    """Random-init params (unboxed); created directly on `shardings` (a NamedSharding tree) when given."""
    dummy = jnp.zeros((1, config.max_target_length), jnp.int32)
    return jax.jit(lambda key: nn.meta.unbox(model.init(key, dummy, model_mode="train")["params"]),
                   out_shardings=shardings)(rng)


@dataclasses.dataclass(frozen=True)
class TrainSharding:
    """Where training lives: the mesh, the NamedSharding trees of the train state ({step, params, opt_state}) and
    of a Batch (rows over the 'batch' logical axis: data x fsdp)."""
    mesh: jax.sharding.Mesh
    config: Any
    state: Any
    batch: Batch


def train_sharding(config, model, optimizer, mesh=None) -> TrainSharding:
    """The mesh of `config` (checked against the model) and the shardings of the state: params by their logical
    axes, the optimizer's per-param moments like their params, its scalars replicated."""
    mesh = sharding.create_mesh(config) if mesh is None else mesh
    sharding.check_mesh_fits_model(config, mesh)
    params = sharding.param_shardings(config, mesh)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    abstract_opt_state = jax.eval_shape(optimizer.init, jax.eval_shape(lambda: init_params(model, config,
                                                                                            jax.random.key(0))))
    opt_state = optax.tree_map_params(optimizer, lambda _, param_sharding: param_sharding, abstract_opt_state,
                                      params, transform_non_params=lambda _: replicated)
    rows = sharding.batch_sharding(mesh, config, 2)
    return TrainSharding(mesh, config, {"step": replicated, "params": params, "opt_state": opt_state},
                         Batch(rows, rows, rows))


def make_train_step(model, optimizer, shardings: TrainSharding | None = None):
    """The jitted step (state, batch) -> (state, {loss, grad_norm}); sharded as `shardings` says when given."""
    def train_step(state, batch):
        loss, grads = jax.value_and_grad(lambda p: mean_loss(model, p, batch))(state["params"])
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        new_state = {"step": state["step"] + 1, "params": optax.apply_updates(state["params"], updates),
                     "opt_state": opt_state}
        return new_state, {"loss": loss, "grad_norm": optax.global_norm(grads)}
    if shardings is None:
        return jax.jit(train_step, donate_argnums=0)
    replicated = shardings.state["step"]
    return sharding.jit_in_mesh(train_step, shardings.mesh, shardings.config, donate_argnums=0,
                                in_shardings=(shardings.state, shardings.batch),
                                out_shardings=(shardings.state, {"loss": replicated, "grad_norm": replicated}))


def init_train_state(model, optimizer, config, rng, shardings: TrainSharding):
    """{step, params, opt_state} created directly on their shardings."""
    params = init_params(model, config, rng, shardings.state["params"])
    opt_state = jax.jit(optimizer.init, out_shardings=shardings.state["opt_state"])(params)
    return {"step": jax.device_put(jnp.zeros((), jnp.int32), shardings.state["step"]), "params": params,
            "opt_state": opt_state}


def _checkpoint_manager(config) -> ocp.CheckpointManager:
    directory = os.path.abspath(os.path.join(run_directory(config), "checkpoints"))
    if not config.resume and os.path.isdir(directory) and os.listdir(directory):
        aside = f"{directory}.old-{time.strftime('%Y%m%d-%H%M%S')}"
        os.rename(directory, aside)
        logger.warning("resume=false: the existing checkpoints were moved to %s; training starts at step 0", aside)
    options = ocp.CheckpointManagerOptions(max_to_keep=config.max_checkpoints_to_keep, create=True)
    return ocp.CheckpointManager(directory, options=options)


def latest_trained_params(config):
    """Params of the run's latest training checkpoint, or None when it has none."""
    directory = os.path.abspath(os.path.join(run_directory(config), "checkpoints"))
    if not os.path.isdir(directory):
        return None
    manager = ocp.CheckpointManager(directory)
    step = manager.latest_step()
    if step is None:
        return None
    model, optimizer = KimiLinearForCausalLM(config), make_optimizer(config)

    def fresh_state():
        params = init_params(model, config, jax.random.key(0))
        return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": optimizer.init(params)}

    # Restore onto this process's first device, whatever topology the checkpoint was written from (train on one
    # machine, decode on another).
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), jax.eval_shape(fresh_state))
    state = manager.restore(step, args=ocp.args.StandardRestore(target))
    logger.info("loaded the params of training step %d from %s", step, directory)
    return state["params"]


def _batch_to_device(batch: Batch, shardings: Batch) -> Batch:
    return Batch(*(jax.device_put(x, s) for x, s in zip(batch, shardings)))


def train(config: ml_collections.FrozenConfigDict) -> TrainResult:
    """Trains `config.steps` steps (from the latest checkpoint when `config.resume`); returns the final params."""
    tokenizer = load_tokenizer("", config)
    train_files, eval_files = split_files(resolve_files(config.dataset_path), config.eval_fraction)
    batch_size = config.per_device_batch_size * jax.device_count()
    model = KimiLinearForCausalLM(config)
    optimizer = make_optimizer(config)
    shardings = train_sharding(config, model, optimizer)
    train_data = PackedDataset(train_files, tokenizer, config.max_target_length, batch_size, config.seed)
    eval_batches = [_batch_to_device(b, shardings.batch) for b in PackedDataset(
        eval_files, tokenizer, config.max_target_length, batch_size, config.seed).fixed_batches(config.eval_batches)]
    logger.info("data: %d train files (%d tokens, %d rows), %d held-out files", len(train_files),
                train_data.num_tokens, train_data.num_rows, len(eval_files))

    state = init_train_state(model, optimizer, config, jax.random.key(config.seed), shardings)
    manager = _checkpoint_manager(config)
    if config.resume and manager.latest_step() is not None:
        state = manager.restore(manager.latest_step(), args=ocp.args.StandardRestore(state))
        logger.info("resumed from step %d (%s)", int(state["step"]), manager.directory)
    elif config.resume:
        logger.warning("resume=true but %s holds no checkpoint; starting at step 0", manager.directory)

    train_step = make_train_step(model, optimizer, shardings)
    eval_fn = sharding.jit_in_mesh(lambda p, b: mean_loss(model, p, b), shardings.mesh, config,
                                   in_shardings=(shardings.state["params"], shardings.batch))
    schedule = learning_rate_schedule(config)

    def held_out_loss(params) -> float:
        return float(np.mean([eval_fn(params, b) for b in eval_batches]))

    start = int(state["step"])
    eval_losses = {start: held_out_loss(state["params"])}
    train_losses: dict[int, float] = {}
    tokens_per_step = batch_size * config.max_target_length
    progress = tqdm(range(start, config.steps), initial=start, total=config.steps, desc="train", unit="step",
                    dynamic_ncols=True, mininterval=1.0)
    progress.write(f"step {start}: held-out loss {eval_losses[start]:.4f}")
    for step in progress:
        t0 = time.perf_counter()
        state, metrics = train_step(state, _batch_to_device(train_data.batch(step), shardings.batch))
        loss, grad_norm = float(metrics["loss"]), float(metrics["grad_norm"])
        if not (np.isfinite(loss) and np.isfinite(grad_norm)):
            manager.wait_until_finished()
            raise TrainingDivergedError(
                f"training stopped at step {step}: loss {loss}, gradient norm {grad_norm}. The last good checkpoint "
                f"(step {manager.latest_step()}) is kept in {manager.directory}")
        train_losses[step] = loss
        done = step + 1
        progress.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_step / (time.perf_counter() - t0):.0f}",
                             lr=f"{float(schedule(step)):.2e}")
        if done == config.steps or (config.eval_interval and done % config.eval_interval == 0):
            eval_losses[done] = held_out_loss(state["params"])
            progress.write(f"step {done}: held-out loss {eval_losses[done]:.4f}")
        if done == config.steps or done % config.checkpoint_period == 0:
            manager.save(done, args=ocp.args.StandardSave(state))
    manager.wait_until_finished()
    return TrainResult(state["params"], int(state["step"]), eval_losses, train_losses, str(manager.directory))
