"""The device mesh and the shardings of params, activations, batches and the decode cache (DESIGN.md §7).

    mesh      = create_mesh(config)                       # axes MESH_AXES, sizes from ici_* x dcn_* (-1 fills)
    check_mesh_fits_model(config, mesh)                   # ShardingError naming the numbers that do not divide
    shardings = param_shardings(config, mesh)             # NamedSharding tree matching the (unboxed) params
    with mesh_context(mesh, config):                      # jax.set_mesh + flax logical axis rules, so that
        ...                                               # nn.with_logical_constraint inside jit takes effect

Params carry logical axis names (`nn.with_logical_partitioning`); `config.logical_axis_rules` maps them to mesh axes
(flax semantics: a mesh axis is used at most once per array, earlier rules win). The decode cache has no param
boxes: its logical axes are declared by the layers that own it (`CACHE_LOGICAL_AXES` in kda.py, mla.py and
decoder.py).
Multi-host runs call `maybe_initialize_distributed(config)` first: JAX is the distributed engine.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
from collections.abc import Callable, Mapping
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from MaxText.layers import decoder, kda, mla
from MaxText.layers.models import KimiLinearForCausalLM

logger = logging.getLogger(__name__)

MESH_AXES = ("data", "fsdp", "expert", "tensor")
CACHE_LOGICAL_AXES: dict[str, tuple[str | None, ...]] = {**kda.CACHE_LOGICAL_AXES, **mla.CACHE_LOGICAL_AXES,
                                                          **decoder.CACHE_LOGICAL_AXES}


class ShardingError(ValueError):
    """The mesh does not fit the devices, or does not divide the model's dimensions."""


# ------------------------------------------------------------------------------------------------ multi-host


def _env_int(name: str) -> int | None:
    value = os.environ.get(name, "")
    return int(value) if value.strip() else None


def _cluster_runs_several_tasks() -> bool:
    """True under a launcher JAX auto-detects (SLURM, Open MPI) that started more than one task."""
    return any((_env_int(var) or 1) > 1 for var in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"))


def maybe_initialize_distributed(config: Mapping[str, Any]) -> bool:
    """Calls `jax.distributed.initialize()` as `config.jax_distributed_initialize` says; True when it did.

    The coordinator, process count and process id come from the config keys, else from $JAX_COORDINATOR_ADDRESS,
    $JAX_NUM_PROCESSES and $JAX_PROCESS_ID, else from JAX's own cluster detection. Must run before any other JAX
    call touches the devices.
    """
    mode = config["jax_distributed_initialize"]
    address = config["coordinator_address"] or os.environ.get("JAX_COORDINATOR_ADDRESS", "")
    if mode == "never" or jax.distributed.is_initialized():
        return False
    if mode == "auto" and not address and not _cluster_runs_several_tasks():
        return False
    num_processes = config["num_processes"] or _env_int("JAX_NUM_PROCESSES")
    process_id = config["process_id"] if config["process_id"] >= 0 else _env_int("JAX_PROCESS_ID")
    jax.distributed.initialize(coordinator_address=address or None, num_processes=num_processes,
                               process_id=process_id)
    logger.info("jax.distributed initialized: process %d of %d, %d devices in all", jax.process_index(),
                jax.process_count(), jax.device_count())
    return True


# ------------------------------------------------------------------------------------------------ mesh


def _fill_axis_sizes(config: Mapping[str, Any], prefix: str, total: int, what: str) -> list[int] | None:
    """The `{prefix}_*_parallelism` sizes in MESH_AXES order with a -1 filled so that they multiply to `total`.

    Returns None when no size is -1 and the product is smaller than `total` (the caller may use fewer devices).
    """
    keys = [f"{prefix}_{axis}_parallelism" for axis in MESH_AXES]
    sizes = [int(config[key]) for key in keys]
    described = " x ".join(f"{key}={size}" for key, size in zip(keys, sizes))
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if total % known:
            raise ShardingError(f"{described}: the -1 axis cannot fill {total} {what}, which {known} does not divide")
        sizes[sizes.index(-1)] = total // known
    elif known > total:
        raise ShardingError(f"{described} = {known} {what} are needed, but only {total} are available")
    elif known < total:
        return None
    return sizes


def mesh_axis_sizes(config: Mapping[str, Any], num_devices: int, num_processes: int = 1
                    ) -> tuple[list[int], list[int]]:
    """(ici sizes, dcn sizes) in MESH_AXES order for `num_devices` devices over `num_processes` processes.

    Single process: when no ici size is -1 and their product is below `num_devices`, the mesh uses the first
    `product` devices (a warning says so). Multi-process meshes must use every device.
    """
    if num_devices % num_processes:
        raise ShardingError(f"{num_devices} devices do not split evenly over {num_processes} processes")
    dcn = _fill_axis_sizes(config, "dcn", num_processes, "processes")
    if dcn is None:
        raise ShardingError(f"the dcn_*_parallelism sizes multiply to fewer than the {num_processes} processes; they "
                            f"must multiply to exactly {num_processes} (or set one to -1)")
    per_process = num_devices // num_processes
    ici = _fill_axis_sizes(config, "ici", per_process, "devices per process")
    if ici is None:
        if num_processes > 1:
            raise ShardingError(f"the ici_*_parallelism sizes multiply to fewer than the {per_process} devices of each "
                                f"process; they must multiply to exactly {per_process} (or set one to -1)")
        ici = [int(config[f"ici_{axis}_parallelism"]) for axis in MESH_AXES]
        logger.warning("the ici_*_parallelism sizes %s multiply to %d: the mesh uses the first %d of %d devices",
                       dict(zip(MESH_AXES, ici)), math.prod(ici), math.prod(ici), num_devices)
    return ici, dcn


def create_mesh(config: Mapping[str, Any], devices: list | None = None) -> Mesh:
    """The Mesh of axes MESH_AXES whose sizes are ici * dcn per axis (see `mesh_axis_sizes`)."""
    devices = jax.devices() if devices is None else list(devices)
    num_processes = len({d.process_index for d in devices})
    ici, dcn = mesh_axis_sizes(config, len(devices), num_processes)
    if num_processes > 1:
        granule_is_process = not hasattr(devices[0], "slice_index")
        device_array = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, process_is_granule=granule_is_process,
                                                            allow_split_physical_axes=True)
    else:
        used = devices[:math.prod(ici)]
        device_array = mesh_utils.create_device_mesh(ici, used, allow_split_physical_axes=True)
    return Mesh(device_array, MESH_AXES)


def describe_mesh(mesh: Mesh) -> str:
    return " x ".join(f"{axis}={size}" for axis, size in mesh.shape.items())


# ------------------------------------------------------------------------------------------------ logical rules


def logical_rules(config: Mapping[str, Any]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """`config.logical_axis_rules` as flax rules, each mesh axis checked against MESH_AXES."""
    rules = []
    for name, axes in config["logical_axis_rules"]:
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        unknown = [a for a in axes if a not in MESH_AXES]
        if unknown:
            raise ShardingError(f"logical_axis_rules maps {name!r} to unknown mesh axes {unknown}; the mesh axes are "
                                f"{MESH_AXES}")
        rules.append((name, axes))
    return tuple(rules)


def mesh_spec(logical_axes: tuple[str | None, ...], rules) -> PartitionSpec:
    """Logical axis names (one per array dim) -> the PartitionSpec of mesh axes."""
    return nn.logical_to_mesh_axes(logical_axes, rules)


def entry_axes(entry) -> tuple[str, ...]:
    """One PartitionSpec entry (None, a mesh axis name, or a tuple of them) as a tuple of mesh axis names."""
    return () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))


def spec_size(spec: PartitionSpec, mesh: Mesh, dim: int) -> int:
    """How many shards dim `dim` of an array with `spec` is split into on `mesh`."""
    return math.prod(mesh.shape[a] for a in entry_axes(spec[dim] if dim < len(spec) else None))


@contextlib.contextmanager
def mesh_context(mesh: Mesh, config: Mapping[str, Any]):
    """Makes `mesh` and the config's logical axis rules current (needed while jitted functions are traced)."""
    with jax.set_mesh(mesh), nn.logical_axis_rules(logical_rules(config)):
        yield


def jit_in_mesh(fn: Callable, mesh: Mesh, config: Mapping[str, Any], static_argnames: tuple[str, ...] = (),
                **jit_kwargs) -> Callable:
    """`jax.jit(fn, **jit_kwargs)` whose every call runs (and so traces) inside `mesh_context`.

    `static_argnames` are passed by keyword and bound before jit (one compiled function per distinct value), so
    that `in_shardings` (which jit allows only with positional arguments) covers the remaining arguments.
    """
    compiled: dict[tuple, Callable] = {}

    @functools.wraps(fn)
    def call(*args, **kwargs):
        static = {name: kwargs.pop(name) for name in static_argnames if name in kwargs}
        key = tuple(sorted(static.items()))
        if key not in compiled:
            compiled[key] = jax.jit(functools.partial(fn, **static), **jit_kwargs)
        with mesh_context(mesh, config):
            return compiled[key](*args, **kwargs)

    return call


# ------------------------------------------------------------------------------------------------ params


def abstract_boxed_params(config: ml_collections.FrozenConfigDict) -> Any:
    """The model's params as ShapeDtypeStructs inside their LogicallyPartitioned boxes (nothing is allocated)."""
    model = KimiLinearForCausalLM(config)
    dummy = jnp.zeros((1, 1), jnp.int32)
    return jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), dummy, model_mode="train"))["params"]


def flat_param_axes(config: ml_collections.FrozenConfigDict) -> dict[tuple[str, ...], tuple[tuple[int, ...], tuple]]:
    """path -> (shape, logical axis names, one per dim; None where the param has no annotation)."""
    flat = flax.traverse_util.flatten_dict(flax.core.unfreeze(abstract_boxed_params(config)))
    return {path: (tuple(nn.unbox(boxed).shape),
                   tuple(boxed.names) if isinstance(boxed, nn.LogicallyPartitioned) else (None,) * len(boxed.shape))
            for path, boxed in flat.items()}


def param_mesh_specs(config: ml_collections.FrozenConfigDict) -> Any:
    """Tree (the unboxed params' structure) of mesh PartitionSpecs from the params' logical annotations."""
    return nn.logical_to_mesh(nn.get_partition_spec(abstract_boxed_params(config)), logical_rules(config))


def param_shardings(config: ml_collections.FrozenConfigDict, mesh: Mesh) -> Any:
    """Tree (the unboxed params' structure, `{'model': ..., 'lm_head': ...}`) of NamedShardings on `mesh`."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), param_mesh_specs(config),
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


def param_sharding_fn(config: ml_collections.FrozenConfigDict, mesh: Mesh) -> Callable[[tuple[str, ...]], Any]:
    """path ('params', 'model', ..., leaf) -> NamedSharding: the `sharding_fn` of checkpointing.abstract_params."""
    flat = flax.traverse_util.flatten_dict(flax.core.unfreeze(param_shardings(config, mesh)))
    return lambda path: flat[tuple(path[1:]) if path[0] == "params" else tuple(path)]


def _divisibility_problems(shapes: Mapping[tuple, tuple[int, ...]], specs: Mapping[tuple, PartitionSpec],
                           logical: Mapping[tuple, tuple], mesh: Mesh) -> list[str]:
    problems = []
    for path, shape in shapes.items():
        spec = specs[path]
        for dim, size in enumerate(shape):
            shards = spec_size(spec, mesh, dim)
            if size % shards:
                axes = "*".join(entry_axes(spec[dim]))
                problems.append(f"param {'/'.join(path)} {list(shape)}: dim {dim} (logical {logical[path][dim]!r}) "
                                f"has {size} entries, which the {shards} shards of mesh axis {axes} do not divide")
    return problems


def check_mesh_fits_model(config: ml_collections.FrozenConfigDict, mesh: Mesh) -> None:
    """Raises ShardingError naming the numbers when the mesh does not divide the model.

    Checks the head and expert counts first (the usual mistake, e.g. 32 KDA heads over tensor=3), then every
    param dimension against the mesh axes its logical name maps to.
    """
    rules = logical_rules(config)
    counts = []
    if "kda" in config.layer_types:
        counts.append(("kda_heads", config.kda_num_heads, "KDA heads (kda_num_heads)"))
    if "mla" in config.layer_types:
        counts.append(("mla_heads", config.num_query_heads, "MLA heads (num_query_heads)"))
    if "moe" in config.mlp_types:
        counts.append(("exp", config.num_experts, "routed experts (num_experts)"))
    for logical, count, what in counts:
        spec = mesh_spec((logical,), rules)
        shards = spec_size(spec, mesh, 0)
        if count % shards:
            raise ShardingError(f"{count} {what} cannot be split over the {shards} devices of mesh axis "
                                f"{spec[0]} (mesh {describe_mesh(mesh)}): the mesh size on that axis must divide "
                                f"{count}")
    axes = flat_param_axes(config)
    shapes = {p: shape for p, (shape, _) in axes.items()}
    logical = {p: names for p, (_, names) in axes.items()}
    specs = {p: mesh_spec(names, rules) for p, names in logical.items()}
    problems = _divisibility_problems(shapes, specs, logical, mesh)
    if problems:
        more = f" ... and {len(problems) - 8} more" if len(problems) > 8 else ""
        raise ShardingError(f"the mesh {describe_mesh(mesh)} does not divide the model: " + "; ".join(problems[:8])
                            + more)


# ------------------------------------------------------------------------------------------------ batch and cache


def batch_sharding(mesh: Mesh, config: Mapping[str, Any], ndim: int, logical: str = "batch") -> NamedSharding:
    """Sharding of a [B, ...] array of `ndim` dims whose batch dim has logical name `logical`."""
    return NamedSharding(mesh, mesh_spec((logical,) + (None,) * (ndim - 1), logical_rules(config)))


def batch_multiple(mesh: Mesh, config: Mapping[str, Any]) -> int:
    """Batch sizes must be multiples of this: the shard counts of the 'batch' and 'cache_batch' dims."""
    rules = logical_rules(config)
    counts = [spec_size(mesh_spec((name,), rules), mesh, 0) for name in ("batch", "cache_batch")]
    return math.lcm(*counts)


def cache_logical_axes(name: str, ndim: int) -> tuple[str | None, ...]:
    """Logical axes of the cache leaf called `name` (from the owning layer); unknown leaves are replicated."""
    axes = CACHE_LOGICAL_AXES.get(name)
    if axes is None or len(axes) != ndim:
        return (None,) * ndim
    return axes


def cache_shardings(cache: Any, mesh: Mesh, config: Mapping[str, Any]) -> Any:
    """NamedSharding tree for a cache tree (arrays or ShapeDtypeStructs), by each leaf's name."""
    rules = logical_rules(config)

    def sharding(path, leaf):
        name = str(getattr(path[-1], "key", path[-1]))
        return NamedSharding(mesh, mesh_spec(cache_logical_axes(name, len(leaf.shape)), rules))

    return jax.tree_util.tree_map_with_path(sharding, cache)


def is_fully_replicated(spec: PartitionSpec, mesh_sizes: Mapping[str, int]) -> bool:
    """True when no dim of an array with `spec` is split over a mesh axis of size > 1."""
    return all(math.prod(mesh_sizes.get(a, 1) for a in entry_axes(entry)) == 1 for entry in spec)


def param_spec_table(config: ml_collections.FrozenConfigDict, mesh_sizes: Mapping[str, int]
                     ) -> list[tuple[str, tuple[int, ...], tuple, PartitionSpec, bool]]:
    """Rows (path, shape, logical axes, mesh PartitionSpec, fully replicated under `mesh_sizes`), largest first.

    Uses `jax.eval_shape` only: nothing of the model is allocated, so the 48B config is fine on any machine.
    """
    rules = logical_rules(config)
    rows = []
    for path, (shape, names) in flat_param_axes(config).items():
        spec = mesh_spec(names, rules)
        rows.append(("/".join(path), shape, names, spec, is_fully_replicated(spec, mesh_sizes)))
    rows.sort(key=lambda row: (-int(np.prod(row[1], dtype=np.int64)), row[0]))
    return rows
