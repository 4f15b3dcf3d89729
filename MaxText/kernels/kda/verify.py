"""KDA for speculative verification: T draft tokens from one initial state, keeping every token's post-state.

    o, checkpoints = recurrent_kda_checkpoints(q, k, v, g, beta, initial_state=S0, checkpoint_dtype=jnp.float32, ...)
    o, state_ring  = recurrent_kda_ring_checkpoints(q, k, v, g, beta, state_ring=R, state_slot=s, ...)

checkpoints[:, t] is the state after token t (t = 0..T-1), so committing the first `a` tokens of a row means taking
checkpoint `a - 1` as its recurrent state (sglang / fla `target_verify` with per-token state slots). T is small (the
number of draft tokens + 1), so this is the token-by-token fp32 recurrence of naive.py, with the same arguments as
the other kernels (fla convention; gate and l2norm optionally in the kernel).

The ring form is what the KDA block uses (copy-free commit): each row owns a ring of S >= T + 1 fp32 state slots
R[b] [S, H, K, V], its committed state in slot s[b]. The verify reads the initial state from slot s and writes token
t's post-state into slot (s + 1 + t) mod S (`ring_write_slots`), never into slot s, so accepting `a` tokens is just
s <- (s + a) mod S (a = 0 keeps the state) and no state is copied. The Pallas kernels with the same signatures are
`pallas_ops.recurrent_kda_checkpoints` / `pallas_ops.recurrent_kda_ring_checkpoints`; `shard_map_verify` runs either
kind per (rows, heads) shard.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from MaxText.kernels.kda.common import prepare_inputs
from MaxText.kernels.kda.naive import kda_step
from MaxText.kernels.kda.sharded import shard_map_kernel, spec_axes


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


def check_state_ring(state_ring, state_slot, batch: int, seq_len: int, num_heads: int, head_k: int,
                     head_v: int) -> None:
    """Raises ValueError naming the bad shape when the ring cannot take a verify of `seq_len` tokens."""
    expected = (batch, None, num_heads, head_k, head_v)
    if state_ring.ndim != 5 or any(e is not None and e != d for e, d in zip(expected, state_ring.shape)):
        raise ValueError(f"state_ring must be [B, S, H, K, V] = [{batch}, S, {num_heads}, {head_k}, {head_v}]; got "
                         f"{tuple(state_ring.shape)}")
    if state_ring.dtype != jnp.float32:
        raise ValueError(f"state_ring must be float32 (any slot may become the committed state); got "
                         f"{state_ring.dtype}")
    if state_ring.shape[1] < seq_len + 1:
        raise ValueError(f"the state ring has S={state_ring.shape[1]} slots per row; verifying T={seq_len} tokens "
                         f"needs S >= T + 1 = {seq_len + 1} (the committed slot plus one per token)")
    if tuple(state_slot.shape) != (batch,) or not jnp.issubdtype(state_slot.dtype, jnp.integer):
        raise ValueError(f"state_slot must be an int32 [B] = [{batch}] array; got {state_slot.dtype} "
                         f"{tuple(state_slot.shape)}")


def ring_write_slots(state_slot, seq_len: int, num_slots: int):
    """[B] committed slots -> [B, T] int32: the slot that token t's post-state goes to, (s + 1 + t) mod S."""
    return (state_slot.astype(jnp.int32)[:, None] + 1 + jnp.arange(seq_len, dtype=jnp.int32)[None]) % num_slots


def recurrent_kda_ring_checkpoints(q, k, v, g, beta, *, state_ring, state_slot, **kwargs):
    """The verify of `recurrent_kda_checkpoints` reading and writing a per-row state ring (module docstring).

    q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]; state_ring: [B, S, H, K, V] float32 with S >= T + 1;
    state_slot: [B] int32, each row's committed slot. kwargs: scale, use_qk_l2norm_in_kernel, use_gate_in_kernel,
    A_log, dt_bias. Returns (o [B, T, H, V] in q's dtype, the ring with slots (s + 1 + t) mod S replaced by the fp32
    state after token t; slot s and the rest unchanged). Plain XLA: a gather of slot s, the scan, one scatter.
    """
    batch, seq_len, num_heads, head_k = q.shape
    check_state_ring(state_ring, state_slot, batch, seq_len, num_heads, head_k, v.shape[-1])
    initial_state = jax.vmap(lambda ring, slot: jax.lax.dynamic_index_in_dim(ring, slot, keepdims=False))(
        state_ring, state_slot)  # [B, H, K, V]
    o, checkpoints = recurrent_kda_checkpoints(q, k, v, g, beta, initial_state=initial_state,
                                               checkpoint_dtype=jnp.float32, **kwargs)
    targets = ring_write_slots(state_slot, seq_len, state_ring.shape[1])  # [B, T]
    return o, jax.vmap(lambda ring, rows, states: ring.at[rows].set(states))(state_ring, targets, checkpoints)


def shard_map_verify(kernel_fn: Callable, mesh, row_axes: Sequence[str], head_axes: Sequence[str]) -> Callable:
    """`kernel_fn` (the signature of `recurrent_kda_checkpoints` or of `recurrent_kda_ring_checkpoints`) run under
    `jax.shard_map`, each device on its own batch rows (over `row_axes`) and heads (over `head_axes`), with no
    communication. B must be a multiple of the row shards and H of the head shards. A ring's slots are per row, so
    each shard's rows keep their whole rings and slot numbers. (sharded.py's wrapper returns a final state; this one
    the checkpoints or the ring.)
    """
    rows, heads = spec_axes(row_axes), spec_axes(head_axes)
    per_token = P(rows, None, heads, None)  # q, k, v, g, o: [B, T, H, K]
    per_slot = P(rows, None, heads, None, None)  # checkpoints [B, T, H, K, V], state_ring [B, S, H, K, V]
    specs = {"q": per_token, "k": per_token, "v": per_token, "g": per_token, "beta": P(rows, None, heads),
             "initial_state": P(rows, heads, None, None), "state_ring": per_slot, "state_slot": P(rows),
             "A_log": P(heads), "dt_bias": P(heads)}

    def sharded(q, k, v, g, beta, *, initial_state=None, state_ring=None, state_slot=None, A_log=None, dt_bias=None,
                **kwargs):
        arrays = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": initial_state,
                  "state_ring": state_ring, "state_slot": state_slot, "A_log": A_log, "dt_bias": dt_bias}
        arrays = {name: value for name, value in arrays.items() if value is not None}
        for name in ("A_log", "dt_bias"):  # H and H*K values, head-major: a split over heads keeps each head's own
            if name in arrays:
                arrays[name] = arrays[name].reshape(-1)
        return shard_map_kernel(kernel_fn, mesh, arrays, specs, (per_token, per_slot), **kwargs)

    return sharded
