"""KDA for speculative verification: T draft tokens from one initial state, keeping every token's post-state.

    o, checkpoints = recurrent_kda_checkpoints(q, k, v, g, beta, initial_state=S0, checkpoint_dtype=jnp.float32, ...)

checkpoints[:, t] is the state after token t (t = 0..T-1), so committing the first `a` tokens of a row means taking
checkpoint `a - 1` as its recurrent state (sglang / fla `target_verify` with per-token state slots). T is small (the
number of draft tokens + 1), so this is the token-by-token fp32 recurrence of naive.py, with the same arguments as
the other kernels (fla convention; gate and l2norm optionally in the kernel). The Pallas kernel with the same
signature is `pallas_ops.recurrent_kda_checkpoints`; `shard_map_verify` runs such a kernel per (rows, heads) shard.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from MaxText.kernels.kda.common import prepare_inputs
from MaxText.kernels.kda.naive import kda_step


def recurrent_kda_checkpoints(q, k, v, g, beta, *, initial_state, checkpoint_dtype=jnp.float32, scale=None,
                              use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None):
    """q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]; initial_state: [B, H, K, V] float32.

    Returns (o [B, T, H, V] in q's dtype, checkpoints [B, T, H, K, V] in `checkpoint_dtype`: the state after each
    token; the recurrence itself runs in float32 whatever the checkpoint dtype).
    """
    x = prepare_inputs(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                       use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                       A_log=A_log, dt_bias=dt_bias)
    time_major = [jnp.moveaxis(t, 1, 0) for t in (x.q, x.k, x.v, x.g, x.beta)]  # [T, B, ...]

    def body(state, step_inputs):
        state, o_t = kda_step(state, *step_inputs)
        return state, (o_t, state.astype(checkpoint_dtype))

    _, (o, checkpoints) = jax.lax.scan(body, x.initial_state, time_major)
    return jnp.moveaxis(o, 0, 1).astype(q.dtype), jnp.moveaxis(checkpoints, 0, 1)  # [B, T, H, V], [B, T, H, K, V]


def shard_map_verify(kernel_fn: Callable, mesh, row_axes: Sequence[str], head_axes: Sequence[str]) -> Callable:
    """`kernel_fn` (the signature of `recurrent_kda_checkpoints`) run under `jax.shard_map`, each device on its own
    batch rows (over `row_axes`) and heads (over `head_axes`), with no communication. B must be a multiple of the
    row shards and H of the head shards. (sharded.py's wrapper returns a final state; this one the checkpoints.)
    """
    rows = tuple(row_axes) or None
    heads = tuple(head_axes) or None
    per_token = P(rows, None, heads, None)  # q, k, v, g, o: [B, T, H, K]
    specs = {"q": per_token, "k": per_token, "v": per_token, "g": per_token, "beta": P(rows, None, heads),
             "initial_state": P(rows, heads, None, None), "A_log": P(heads), "dt_bias": P(heads)}
    out_specs = (per_token, P(rows, None, heads, None, None))

    def sharded(q, k, v, g, beta, *, initial_state, A_log=None, dt_bias=None, **kwargs):
        arrays = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": initial_state, "A_log": A_log,
                  "dt_bias": dt_bias}
        arrays = {name: value for name, value in arrays.items() if value is not None}
        for name in ("A_log", "dt_bias"):  # H and H*K values, head-major: a split over heads keeps each head's own
            if name in arrays:
                arrays[name] = arrays[name].reshape(-1)
        names = tuple(arrays)

        def local(*values):
            local_args = dict(zip(names, values))
            inputs = [local_args.pop(n) for n in ("q", "k", "v", "g", "beta")]
            return kernel_fn(*inputs, **local_args, **kwargs)

        return jax.shard_map(local, mesh=mesh, in_specs=tuple(specs[n] for n in names), out_specs=out_specs,
                             check_vma=False)(*arrays.values())

    return sharded
