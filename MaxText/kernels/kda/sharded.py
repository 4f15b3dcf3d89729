"""Runs a KDA kernel per (batch rows, heads) shard under `jax.shard_map`: for kernels XLA cannot partition (Pallas).

KDA is independent across rows and heads, so each device runs the kernel on its own rows and heads with no
communication. The plain-JAX kernels (naive, chunked) need none of this: XLA partitions them from the layer's
sharding constraints.

    fn = shard_map_over_rows_and_heads(kernel_fn, mesh, row_axes=("data", "fsdp"), head_axes=("tensor",))
    o, final_state = fn(q, k, v, g, beta, initial_state=..., A_log=..., dt_bias=..., **static_kwargs)

Shapes (global): q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; initial_state [B, H, K, V]; A_log [H];
dt_bias [H*K] (head-major, so a split over heads keeps each head's K entries together); segment_ids [B, T].
B must be a multiple of the row shards and H of the head shards. Packed inputs (`cu_seqlens`) lay sequences along
T, which cannot be split by rows: they run unsharded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
from jax.sharding import PartitionSpec as P

ARRAY_ARGS = ("initial_state", "A_log", "dt_bias", "segment_ids")


def spec_axes(names: Sequence[str]):
    """Mesh axis names -> one PartitionSpec entry (None when there are none)."""
    names = tuple(names)
    return None if not names else (names[0] if len(names) == 1 else names)


def shard_map_kernel(kernel_fn: Callable, mesh, arrays: dict, specs: dict, out_specs, **static_kwargs):
    """kernel_fn(q, k, v, g, beta, **the other arrays, **static_kwargs) under `jax.shard_map`: `arrays` (name ->
    global array; q, k, v, g, beta included) split by `specs` (name -> PartitionSpec), the results by `out_specs`."""
    names = tuple(arrays)

    def local(*values):
        local_args = dict(zip(names, values))
        inputs = [local_args.pop(n) for n in ("q", "k", "v", "g", "beta")]
        return kernel_fn(*inputs, **local_args, **static_kwargs)

    return jax.shard_map(local, mesh=mesh, in_specs=tuple(specs[n] for n in names), out_specs=out_specs,
                         check_vma=False)(*arrays.values())


def shard_map_over_rows_and_heads(kernel_fn: Callable, mesh, row_axes: Sequence[str], head_axes: Sequence[str]
                                  ) -> Callable:
    """`kernel_fn` (the fla-style KDA signature) run per shard of rows (over `row_axes`) and heads (`head_axes`)."""
    rows, heads = spec_axes(row_axes), spec_axes(head_axes)
    specs = {
        "q": P(rows, None, heads, None), "k": P(rows, None, heads, None), "v": P(rows, None, heads, None),
        "g": P(rows, None, heads, None), "beta": P(rows, None, heads), "initial_state": P(rows, heads, None, None),
        "A_log": P(heads), "dt_bias": P(heads), "segment_ids": P(rows, None),
    }

    def sharded(q, k, v, g, beta, *, output_final_state: bool = False, **kwargs):
        if kwargs.get("cu_seqlens") is not None:
            return kernel_fn(q, k, v, g, beta, output_final_state=output_final_state, **kwargs)
        arrays = {"q": q, "k": k, "v": v, "g": g, "beta": beta}
        arrays.update({name: kwargs.pop(name) for name in ARRAY_ARGS if kwargs.get(name) is not None})
        for name in ARRAY_ARGS:
            kwargs.pop(name, None)
        if output_final_state:
            return shard_map_kernel(kernel_fn, mesh, arrays, specs, (specs["q"], specs["initial_state"]),
                                    output_final_state=True, **kwargs)
        output_only = lambda *a, **kw: kernel_fn(*a, **kw)[0]  # noqa: E731
        return shard_map_kernel(output_only, mesh, arrays, specs, specs["q"], output_final_state=False,
                                **kwargs), None

    return sharded
