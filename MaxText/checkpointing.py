"""Params checkpoints: an Orbax checkpoint of the param tree plus the model config, in one directory.

    <dir>/config.yml   our config keys (architecture + dtypes); usable directly as the config of train_or_decode.py
    <dir>/params/      Orbax checkpoint (PyTree, OCDBT) of {'params': {'model': ..., 'lm_head': ...}}

`save_params` writes one from in-memory arrays (numpy / jax) or from `StagedArray` leaves, whose values sit in raw
files on disk: the HF converter stages there, so the Orbax write reads one chunk at a time and memory stays bounded
however large the model is. `load_params` restores to the shapes and dtypes the model expects (optionally to given
shardings) after checking the checkpoint's config against the one given; `load_for_inference` is what
`Engine.from_checkpoint` calls.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Callable, Mapping
from typing import Any

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
import yaml

from MaxText import hf_weights, pyconfig

PARAMS_SUBDIR = "params"
CONFIG_FILE = "config.yml"
WRITE_CHUNK_BYTES = 64 * 1024 * 1024  # Orbax chunk size of staged leaves: one chunk is read and written at a time
FLOAT32_PARAMS = ("e_score_correction_bias",)  # leaves kept in float32 whatever weight_dtype is (the fp32 router)

# The keys that define the param tree and the math: a checkpoint only loads under a config that agrees on them.
ARCHITECTURE_KEYS = (
    "model_name", "vocab_size", "emb_dim", "num_decoder_layers", "normalization_layer_epsilon", "kda_layers",
    "mla_layers", "kda_num_heads", "kda_head_dim", "kda_conv_kernel_size", "num_query_heads", "q_lora_rank",
    "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "mlp_dim", "first_num_dense_layers",
    "num_experts", "num_experts_per_tok", "moe_mlp_dim", "shared_experts", "routed_scaling_factor",
    "n_routing_groups", "topk_routing_group", "norm_topk_prob", "dense_kernel_layout", "expert_kernel_layout",
)
# What a checkpoint's config.yml written before an architecture key existed stands for.
ARCHITECTURE_KEYS_BEFORE = {"dense_kernel_layout": hf_weights.DENSE_LAYOUT_WITHOUT_KEY,
                            "expert_kernel_layout": "in_out"}


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, or does not match the config it is loaded with."""


# ------------------------------------------------------------------------------------------------ dtypes


def np_dtype(name: str) -> np.dtype:
    """'float32' | 'bfloat16' -> numpy dtype (bfloat16 from ml_dtypes)."""
    return np.dtype(jax.numpy.dtype(name))


def leaf_dtype(path: tuple[str, ...], weight_dtype: str) -> np.dtype:
    """The dtype a param is stored and created with: float32 for the router bias, `weight_dtype` otherwise."""
    return np.dtype(np.float32) if path[-1] in FLOAT32_PARAMS else np_dtype(weight_dtype)


def abstract_params(config: Mapping[str, Any],
                    sharding_fn: Callable[[tuple[str, ...]], Any] | None = None) -> dict[str, Any]:
    """{'params': ...} of jax.ShapeDtypeStruct: the shapes a model of `config` has, dtypes as `leaf_dtype`, and
    the sharding `sharding_fn(path)` when given (else none: restore to host numpy)."""
    flat = {}
    for path, shape in hf_weights.param_shapes(config).items():
        sharding = sharding_fn(path) if sharding_fn else None
        flat[path] = jax.ShapeDtypeStruct(shape, leaf_dtype(path, config["weight_dtype"]), sharding=sharding)
    return hf_weights.nest(flat)


def _flatten(tree: Mapping[str, Any], prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            flat.update(_flatten(value, prefix + (str(key),)))
        else:
            flat[prefix + (str(key),)] = value
    return flat


# ------------------------------------------------------------------------------------------------ staged leaves


@dataclasses.dataclass(frozen=True)
class StagedArray:
    """A param whose values sit in a raw C-order file of `shape` and `dtype` (no header), filled piece by piece
    with `write` and read back chunk by chunk when the Orbax checkpoint is written. Never held whole in memory."""
    file: str
    shape: tuple[int, ...]
    dtype: np.dtype

    @classmethod
    def create(cls, file: str, shape: tuple[int, ...], dtype: np.dtype) -> "StagedArray":
        staged = cls(file, tuple(int(s) for s in shape), np.dtype(dtype))
        with open(file, "wb") as f:
            f.truncate(staged.nbytes)
        return staged

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def write(self, value: np.ndarray, slot: int | None = None, block_bytes: int = WRITE_CHUNK_BYTES) -> None:
        """Writes `value` as the whole array (slot None) or as index `slot` of axis 0, cast to `dtype`, in blocks
        of about `block_bytes` (so a transposed view is copied a block at a time)."""
        want = self.shape if slot is None else self.shape[1:]
        if tuple(value.shape) != want:
            raise CheckpointError(f"staged write of shape {value.shape} into {self.file} expects {want}")
        offset = 0 if slot is None else slot * (self.nbytes // self.shape[0])
        rows = value.reshape((1,) + value.shape) if value.ndim == 0 else value
        row_bytes = max(1, rows[0].size * self.dtype.itemsize)
        step = max(1, block_bytes // row_bytes)
        fd = os.open(self.file, os.O_WRONLY)
        try:
            for start in range(0, rows.shape[0], step):
                block = np.ascontiguousarray(rows[start:start + step], dtype=self.dtype)
                os.pwrite(fd, block.reshape(-1).view(np.uint8), offset + start * row_bytes)
        finally:
            os.close(fd)

    def read(self, index: tuple[slice, ...]) -> np.ndarray:
        """A copy of `array[index]`; only the pages of that block are touched (and unmapped again)."""
        mapped = np.memmap(self.file, dtype=self.dtype, mode="r", shape=self.shape)
        try:
            return np.array(mapped[index])
        finally:
            del mapped


def _chunk_indices(shape: tuple[int, ...], chunk: tuple[int, ...]):
    """Slices covering `shape` in blocks of `chunk` (the TensorStore write chunk grid)."""
    ranges = [range(0, dim, step) for dim, step in zip(shape, chunk)]
    for starts in itertools.product(*ranges):
        yield tuple(slice(s, min(s + c, d)) for s, c, d in zip(starts, chunk, shape))


class _StagedArrayHandler(ocp.type_handlers.NumpyHandler):
    """Writes StagedArray leaves as Orbax numpy arrays (readable by the standard handlers), one chunk at a time.

    Writes are sequential on purpose: peak memory is one chunk, not one array or the whole tree.
    """

    def __init__(self, on_chunk: Callable[[int], None] | None = None):
        super().__init__(deepcopy_host_arrays=False)
        self._on_chunk = on_chunk

    async def serialize(self, values, infos, args=None):
        args = [dataclasses.replace(a or ocp.SaveArgs(), chunk_byte_size=WRITE_CHUNK_BYTES)
                for a in (args or [None] * len(values))]
        return await super().serialize(values, infos, args)

    # Overrides NumpyHandler's per-array write (orbax-checkpoint 0.12's private hook; tests/test_convert.py goes
    # through it): the TensorStore array is filled chunk by chunk from the staging file instead of from memory.
    async def _open_and_write(self, value: StagedArray, tspec, ts_context):
        import tensorstore as ts  # pylint: disable=import-outside-toplevel
        store = await ts.open(ts.Spec(tspec), create=True, open=True, context=ts_context)
        chunk = tuple(store.chunk_layout.write_chunk.shape)
        for index in _chunk_indices(value.shape, chunk):
            block = value.read(index)
            store[index].write(block).result()  # blocking: one chunk in flight
            if self._on_chunk:
                self._on_chunk(block.nbytes)


# ------------------------------------------------------------------------------------------------ save


def config_keys_to_save(config: Mapping[str, Any]) -> dict[str, Any]:
    """The keys a checkpoint's config.yml records: the architecture and the dtypes (plain Python values)."""
    keys = {}
    for key in ARCHITECTURE_KEYS + ("weight_dtype", "dtype"):
        value = config[key]
        keys[key] = list(value) if isinstance(value, (list, tuple)) else value
    return keys


def write_config(directory: str, keys: Mapping[str, Any]) -> str:
    """Writes `directory/config.yml` (no base_config: pyconfig layers it over configs/base.yml)."""
    path = os.path.join(directory, CONFIG_FILE)
    with open(path, "w", encoding="utf-8") as f:
        f.write("# Written with a params checkpoint; `python train_or_decode.py <this file>` uses it as the config.\n")
        yaml.safe_dump(dict(keys), f, sort_keys=False, default_flow_style=None)
    return path


def save_params(directory: str, params: Mapping[str, Any], config: Mapping[str, Any],
                extra_config: Mapping[str, Any] | None = None,
                on_chunk: Callable[[int], None] | None = None) -> None:
    """Writes `params` ({'params': ...} or the inner tree; numpy, jax or StagedArray leaves) as an Orbax checkpoint
    in `directory/params` and the config in `directory/config.yml` (plus `extra_config` keys).

    `directory/params` must not exist yet. `on_chunk(nbytes)` is called after each staged chunk is written.
    """
    if os.path.exists(os.path.join(directory, PARAMS_SUBDIR)):
        raise CheckpointError(f"{os.path.join(directory, PARAMS_SUBDIR)!r} already exists; choose a new directory")
    os.makedirs(directory, exist_ok=True)
    tree = params if set(params) == {"params"} else {"params": params}
    registry = ocp.type_handlers.create_type_handler_registry(
        (np.ndarray, ocp.type_handlers.NumpyHandler()),
        (jax.Array, ocp.type_handlers.ArrayHandler()),
        (StagedArray, _StagedArrayHandler(on_chunk)),
    )
    checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(type_handler_registry=registry))
    checkpointer.save(os.path.join(os.path.abspath(directory), PARAMS_SUBDIR), args=ocp.args.PyTreeSave(tree))
    write_config(directory, {**config_keys_to_save(config), **(extra_config or {})})


# ------------------------------------------------------------------------------------------------ load


def _params_dir(path: str) -> str:
    candidate = os.path.join(path, PARAMS_SUBDIR)
    if os.path.isdir(candidate):
        return candidate
    hint = (f"; {path!r} looks like an HF checkpoint: convert it first with `python -m MaxText.convert_hf_checkpoint "
            f"--hf-path {path} --output-dir OUT`" if os.path.isfile(os.path.join(path, "config.json")) else "")
    raise CheckpointError(f"no params checkpoint at {path!r}: expected the Orbax directory {candidate!r} "
                          f"(written by `python -m MaxText.convert_hf_checkpoint` or checkpointing.save_params){hint}")


def _read_config_file(path: str) -> dict[str, Any]:
    """The raw keys of `path/config.yml`."""
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(file):
        raise CheckpointError(f"checkpoint {path!r} has no {CONFIG_FILE}")
    with open(file, encoding="utf-8") as f:
        return yaml.safe_load(f) or {}


def _with_keys_before(written: Mapping[str, Any]) -> dict[str, Any]:
    """A config.yml's keys with ARCHITECTURE_KEYS_BEFORE's value for an architecture key it predates."""
    return {**ARCHITECTURE_KEYS_BEFORE, **written}


def read_checkpoint_config(path: str) -> dict[str, Any]:
    """The keys of `path/config.yml`, with ARCHITECTURE_KEYS_BEFORE's value for an architecture key it predates."""
    return _with_keys_before(_read_config_file(path))


def check_config_matches(path: str, config: Mapping[str, Any]) -> None:
    """Raises CheckpointError naming every architecture key where `config` differs from the checkpoint's (for a key
    the checkpoint's config.yml predates, with the override that loads it)."""
    written = _read_config_file(path)
    stored = _with_keys_before(written)
    diffs = []
    for key in ARCHITECTURE_KEYS:
        if key not in stored:
            continue
        want, got = stored[key], config[key]
        if isinstance(want, list):
            got = list(got)
        if want != got:
            predates = f" (its {CONFIG_FILE} predates the key: set {key}={want})" if key not in written else ""
            diffs.append(f"{key}: checkpoint {want!r}, config {got!r}{predates}")
    if diffs:
        raise CheckpointError(f"the config does not match the checkpoint at {path!r}: " + "; ".join(diffs))


def _check_stored_shapes(directory: str, target: Mapping[str, Any]) -> None:
    stored = _flatten(dict(ocp.StandardCheckpointer().metadata(directory).item_metadata.tree))
    want = _flatten(target)
    problems = [f"missing param {'/'.join(p)}" for p in want if p not in stored]
    problems += [f"unexpected param {'/'.join(p)}" for p in stored if p not in want]
    problems += [f"param {'/'.join(p)} has shape {tuple(stored[p].shape)} in the checkpoint; the config implies "
                 f"{tuple(want[p].shape)}" for p in want if p in stored and tuple(stored[p].shape) != want[p].shape]
    if problems:
        raise CheckpointError(f"checkpoint {directory!r} does not match the config: " + "; ".join(problems[:12]))


def load_params(path: str, config: Mapping[str, Any], target: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Restores {'params': ...} from the checkpoint directory `path` (holding params/ and config.yml).

    `target`: {'params': ...} of jax.ShapeDtypeStruct; leaves with a sharding restore as jax.Arrays placed on it,
    others as numpy arrays. Default: `abstract_params(config)` (numpy, `weight_dtype`, router bias float32).
    Raises CheckpointError when the checkpoint's config or param shapes differ from `config`'s.
    """
    directory = _params_dir(path)
    check_config_matches(path, config)
    target = abstract_params(config) if target is None else target
    _check_stored_shapes(directory, target)

    def restore_args(leaf):
        if getattr(leaf, "sharding", None) is not None:
            return ocp.ArrayRestoreArgs(sharding=leaf.sharding, global_shape=leaf.shape, dtype=leaf.dtype)
        return ocp.RestoreArgs(restore_type=np.ndarray, dtype=leaf.dtype)

    args = jax.tree.map(restore_args, target)
    checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
    return checkpointer.restore(directory, args=ocp.args.PyTreeRestore(item=target, restore_args=args))


def load_sharded_params(path: str, config: ml_collections.FrozenConfigDict, mesh=None) -> dict[str, Any]:
    """`load_params` onto the param shardings of `mesh` (default: the mesh of `config`'s ici_* / dcn_* keys): each
    device reads only its own shards, so no host or device ever holds the whole model."""
    from MaxText import sharding  # pylint: disable=import-outside-toplevel  (imports the model)

    mesh = sharding.create_mesh(config) if mesh is None else mesh
    return load_params(path, config, abstract_params(config, sharding.param_sharding_fn(config, mesh)))


def load_for_inference(path: str, sharded: bool = False,
                       **config_overrides) -> tuple[ml_collections.FrozenConfigDict, dict[str, Any]]:
    """(config, params) of the checkpoint directory `path`: its config.yml with `config_overrides` applied
    (e.g. max_target_length=4096, dtype='bfloat16'); overriding an architecture key fails with CheckpointError.
    sharded: restore onto the config's mesh (`load_sharded_params`) instead of into host numpy arrays."""
    _params_dir(path)  # fail on a missing checkpoint before reading its config
    stored = read_checkpoint_config(path)  # a key it lacks is what it stood for before the key existed
    config = pyconfig.load_config(os.path.join(path, CONFIG_FILE),
                                  {**{key: stored[key] for key in ARCHITECTURE_KEYS_BEFORE}, **config_overrides})
    return config, (load_sharded_params(path, config) if sharded else load_params(path, config))
