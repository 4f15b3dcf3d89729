"""Random params created directly on the device(s), one leaf at a time, each in its target sharding (issue 8).

    params, summary = random_params_on_device(config, mesh, jax.random.key(config.seed, impl="rbg"))
    print(summary.describe())

`train.init_params` jits the whole `model.init`: one program that traces every layer and makes every param at once
(for the 48B config, ~600 params and ~98 GB in one compile and one run, with no sign of progress). Here the param
tree comes from `jax.eval_shape` of the model's init (names, shapes, dtypes, logical axes; no FLOPs), the target
NamedSharding of each param from `sharding.param_shardings`, and each param is then made by a small jitted
generator with that sharding as its out_sharding. Generators are compiled once per (init kind, shape, dtype,
sharding), so the 603 params of the 48B model (27 layers) share 24 programs. Each param waits for its generator to
finish before the next starts: device memory holds the params made so far plus one param's temporaries (the random
bits; for a bf16 normal, 1 byte per element), and the progress bar shows exactly where the run is.

The init of each param is chosen by its name (`init_kind`), with the layers' own initializers, so the params have
the distributions `init_params` gives them (not its bits: every param draws from the key folded with a hash of its
path). A param whose name is not known is an error (UnknownParamError) before anything is made, so a new param is
never initialized by a guess.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
import time
import zlib
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import ml_collections
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tqdm import tqdm

from MaxText import sharding
from MaxText.layers import kda
from MaxText.layers.linears import kernel_init

Initializer = Callable[[jax.Array, tuple[int, ...], Any], jax.Array]  # (key, shape, dtype) -> array

# Init kind -> (config, param shape) -> the initializer the layers use for such a param.
INITIALIZERS: dict[str, Callable[[ml_collections.FrozenConfigDict, tuple[int, ...]], Initializer]] = {
    # N(0, param_init_std): Dense kernels, the embedding table, the routed experts (linears.kernel_init).
    "normal": lambda config, shape: kernel_init(config),
    # kda.ShortConvKernel: N(0, W^-1/2) for a [W, C] depthwise kernel.
    "conv_kernel": lambda config, shape: nn.initializers.normal(shape[0] ** -0.5),
    "ones": lambda config, shape: nn.initializers.ones,  # RMSNorm / gated RMSNorm `scale`
    "zeros": lambda config, shape: nn.initializers.zeros,  # the router's e_score_correction_bias
    "a_log": lambda config, shape: kda.a_log_init,  # log U(1, 16) per KDA head
    "dt_bias": lambda config, shape: kda.dt_bias_init,  # softplus^-1 of a log-uniform dt in [1e-3, 1e-1]
}
EXPERT_WEIGHTS = ("gate_proj", "up_proj", "down_proj")  # moe.RoutedExperts: [E, D, I] / [E, I, D], no `kernel` level
NAMED_PARAMS = {"scale": "ones", "A_log": "a_log", "dt_bias": "dt_bias", "e_score_correction_bias": "zeros",
                "embedding": "normal"}


class UnknownParamError(ValueError):
    """A param whose name says nothing about how the model initializes it."""


def init_kind(path: tuple[str, ...]) -> str:
    """The INITIALIZERS key for the param at `path` (('model', 'layers_0', 'self_attn', 'q_proj', 'kernel'), ...).

    `kernel`: 'conv_kernel' under a `*_conv1d` module (KDA's short convolutions), else 'normal'; the routed experts'
    gate_proj / up_proj / down_proj: 'normal'; `scale`, `A_log`, `dt_bias`, `e_score_correction_bias`, `embedding`:
    NAMED_PARAMS. Raises UnknownParamError for anything else.
    """
    name, parent = path[-1], (path[-2] if len(path) > 1 else "")
    if name == "kernel":
        return "conv_kernel" if parent.endswith("_conv1d") else "normal"
    if parent == "experts" and name in EXPERT_WEIGHTS:
        return "normal"
    if name in NAMED_PARAMS:
        return NAMED_PARAMS[name]
    known = ["kernel", *NAMED_PARAMS, *(f"experts/{w}" for w in EXPERT_WEIGHTS)]
    raise UnknownParamError(f"param {'/'.join(path)}: no random init is known for a param named {name!r} (known: "
                            f"{', '.join(known)}); add its layer's initializer to MaxText/random_init.py")


@dataclasses.dataclass(frozen=True)
class LeafPlan:
    """One param to make: where it goes in the tree, what it is and how it is initialized."""
    path: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: np.dtype
    sharding: NamedSharding
    kind: str  # an INITIALIZERS key

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def salt(self) -> np.uint32:
        """What the key is folded with for this param: a CRC-32 of its path."""
        return np.uint32(zlib.crc32("/".join(self.path).encode()))


@dataclasses.dataclass(frozen=True)
class InitSummary:
    """What `random_params_on_device` made and how long each part took (seconds, wall clock)."""
    num_params: int  # elements over all leaves
    num_bytes: int
    num_leaves: int
    num_generators: int  # distinct compiled programs
    abstract_s: float  # eval_shape of the model init and the param shardings
    compile_s: float  # lowering and compiling the generators
    generate_s: float  # running them (each waited for)
    total_s: float
    peak_bytes_in_use: int | None  # device 0's peak after the init (None where the backend does not say)

    def describe(self) -> str:
        return (f"{self.num_params / 1e9:.3g} B params, {self.num_bytes / 1e9:.3g} GB in {self.num_leaves} leaves by "
                f"{self.num_generators} compiled generators: {self.total_s:.1f} s (abstract tree {self.abstract_s:.1f} "
                f"s, compile {self.compile_s:.1f} s, generate {self.generate_s:.1f} s)")


def plan_leaves(config: ml_collections.FrozenConfigDict, mesh: Mesh, shardings: Any = None
                ) -> tuple[list[LeafPlan], jax.tree_util.PyTreeDef]:
    """Every param of the model (LeafPlans, tree order) and the params' tree structure (that of `init_params`).

    Only `jax.eval_shape` runs. `shardings`: the NamedSharding tree (default `sharding.param_shardings(config,
    mesh)`). Raises UnknownParamError naming the first param `init_kind` does not know.
    """
    abstract = nn.unbox(sharding.abstract_boxed_params(config))  # ShapeDtypeStructs
    shardings = sharding.param_shardings(config, mesh) if shardings is None else shardings
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    flat_shardings = treedef.flatten_up_to(shardings)
    plans = []
    for (keys, leaf), leaf_sharding in zip(flat, flat_shardings):
        path = tuple(str(getattr(k, "key", k)) for k in keys)
        plans.append(LeafPlan(path, tuple(leaf.shape), np.dtype(leaf.dtype), leaf_sharding, init_kind(path)))
    return plans, treedef


def _generate(initializer: Initializer, shape: tuple[int, ...], dtype: np.dtype, key: jax.Array, salt: jax.Array):
    return initializer(jax.random.fold_in(key, salt), shape, dtype)


def _peak_bytes_in_use() -> int | None:
    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def random_params_on_device(config: ml_collections.FrozenConfigDict, mesh: Mesh, key: jax.Array, *,
                            shardings: Any = None, progress: bool = True) -> tuple[Any, InitSummary]:
    """Random params of `KimiLinearForCausalLM(config)` made on `mesh`'s devices: (params, InitSummary).

    params: the unboxed tree of `train.init_params` (same structure, shapes, dtypes and shardings), each leaf a
    jax.Array in its param_shardings sharding. key: a PRNG key (typed, e.g. `jax.random.key(seed, impl="rbg")`, or
    raw); with an "rbg" key XLA's RngBitGenerator makes the bits, so a param's temporaries are its random bits alone
    (threefry's unfused intermediates on XLA:CPU cost several times the param). shardings: the
    NamedSharding tree when the caller has it (default: `sharding.param_shardings(config, mesh)`). progress: a tqdm
    bar (leaves; GB made; compiled generators; the param being made) on stderr.
    """
    start = time.perf_counter()
    plans, treedef = plan_leaves(config, mesh, shardings)
    abstract_s = time.perf_counter() - start
    replicated = NamedSharding(mesh, PartitionSpec())
    key = jax.device_put(key, replicated)
    total_bytes = sum(p.nbytes for p in plans)
    generators: dict[tuple, Any] = {}  # (kind, shape, dtype, sharding) -> compiled program (key, salt) -> leaf
    compile_s = generate_s = 0.0
    made_bytes = 0
    leaves = []
    # Redrawn at most every 5 s into a log file (each redraw is a new line there), every 0.5 s on a terminal.
    bar = tqdm(total=len(plans), unit="leaf", desc="random init", disable=not progress,
               mininterval=0.5 if sys.stderr.isatty() else 5.0)
    for plan in plans:
        bar.set_postfix_str(f"{made_bytes / 1e9:.3g}/{total_bytes / 1e9:.3g} GB, {len(generators)} programs, "
                            f"{'/'.join(plan.path)}", refresh=False)
        signature = (plan.kind, plan.shape, plan.dtype, plan.sharding)
        if signature not in generators:
            tick = time.perf_counter()
            initializer = INITIALIZERS[plan.kind](config, plan.shape)
            generators[signature] = jax.jit(
                functools.partial(_generate, initializer, plan.shape, plan.dtype),
                in_shardings=(replicated, replicated), out_shardings=plan.sharding).lower(key, plan.salt).compile()
            compile_s += time.perf_counter() - tick
        tick = time.perf_counter()
        leaves.append(jax.block_until_ready(generators[signature](key, plan.salt)))
        generate_s += time.perf_counter() - tick
        made_bytes += plan.nbytes
        bar.update()
    bar.set_postfix_str(f"{made_bytes / 1e9:.3g}/{total_bytes / 1e9:.3g} GB, {len(generators)} programs")
    bar.close()
    summary = InitSummary(
        num_params=sum(math.prod(p.shape) for p in plans), num_bytes=total_bytes, num_leaves=len(plans),
        num_generators=len(generators), abstract_s=abstract_s, compile_s=compile_s, generate_s=generate_s,
        total_s=time.perf_counter() - start, peak_bytes_in_use=_peak_bytes_in_use())
    return jax.tree_util.tree_unflatten(treedef, leaves), summary
