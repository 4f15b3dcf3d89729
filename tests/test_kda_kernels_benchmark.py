"""benchmarks/kda_kernels.py's CPU-checkable parts: the decode state-traffic probe and the sweep's one-step check
of each decode tile (Pallas interpret mode, small heads)."""

import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import kda_kernels
from benchmarks.kda_kernels import state_traffic_probe


@pytest.mark.parametrize("columns_fastest", [False, True])
def test_state_traffic_probe_halves_the_slots_rows_only(columns_fastest):
    """Every program rewrites its own [K, block_v] slice of its row's pool slot (all heads, all column blocks), and
    no other pool row: the probe moves exactly the decode kernel's state bytes, in either launch order (3 rows, 2
    column blocks: a swapped mapping would miss some)."""
    pool = np.random.default_rng(0).standard_normal((5, 2, 16, 32)).astype(np.float32)
    slots = np.array([3, 0, 4], np.int32)
    out = np.asarray(state_traffic_probe(jnp.asarray(pool), jnp.asarray(slots), block_v=16, num_warps=1,
                                         columns_fastest=columns_fastest, interpret=True))
    want = pool.copy()
    want[slots] *= 0.5
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("with_norm", [False, True])
def test_decode_step_error_checks_the_tile_against_the_reference(monkeypatch, with_norm):
    """--sweep's per-variant check: a tile's one-step o is near the reference's, with the output norm in the launch
    compared against the normed reference (an unnormed reference would differ by O(1)); a wrong scale is caught."""
    monkeypatch.setattr(kda_kernels, "H", 2)
    monkeypatch.setattr(kda_kernels, "K", 32)
    monkeypatch.setattr(kda_kernels, "V", 32)
    batch = 3
    options = dict(kda_kernels.tile_options(16, 1, False), interpret=True, out_dtype=jnp.float32)
    if with_norm:
        options.update(kda_kernels.decode_out_norm_inputs(batch))
    assert kda_kernels.decode_step_error(batch, options) < 1e-2
    assert kda_kernels.decode_step_error(batch, dict(options, scale=1.0)) > 1e-2


def test_decode_loop_takes_the_pools_in_turn():
    """--pools: the timed loop's step i updates pools[i % N] (7 steps over 3 pools: 3, 2 and 2 updates) and sums
    every step's o[0, 0, 0], so that N distinct pools are each read and written in the chain."""
    def step(mixed, a, b, A_log, dt_bias, pool, slots):  # o [B, H, V]: the pool's first value before the update
        return pool[:, :, 0, :], pool + 1.0

    pools = tuple(jnp.full((1, 1, 2, 2), 10.0 * i) for i in range(3))
    zeros = jnp.zeros(1)
    pools, acc = kda_kernels.decode_loop(step, steps=7)(pools, zeros, zeros, zeros, zeros, zeros, zeros)
    for pool, (start, updates) in zip(pools, ((0.0, 3), (10.0, 2), (20.0, 2))):
        np.testing.assert_array_equal(np.asarray(pool), start + updates)
    assert float(acc) == (0 + 1 + 2) + (10 + 11) + (20 + 21)


def test_counting_step_keeps_the_norm_counters_between_steps(monkeypatch):
    """The sweep's `_norm` variants run as the model does: the output norm's counters come back zero from each
    launch and feed the next (no zeros made per launch), with the o and pool of a launch given fresh zeros."""
    monkeypatch.setattr(kda_kernels, "H", 2)
    monkeypatch.setattr(kda_kernels, "K", 32)
    monkeypatch.setattr(kda_kernels, "V", 32)
    batch = 3
    options = dict(kda_kernels.tile_options(16, 1, False), interpret=True, out_dtype=jnp.float32,
                   **kda_kernels.decode_out_norm_inputs(batch))
    inputs, slots, initial_pool = kda_kernels.decode_problem(batch)
    step = kda_kernels.counting_step(options)
    counts = jnp.zeros((batch, 2), jnp.int32)
    pool, want_pool = initial_pool(), initial_pool()
    for _ in range(2):
        o, (pool, counts) = step(*inputs, (pool, counts), slots)
        want_o, want_pool = kda_kernels.pallas_ops.packed_decode_kda(*inputs, want_pool, slots, num_heads=2,
                                                                     head_dim=32, **options)
        np.testing.assert_array_equal(np.asarray(counts), 0)
        np.testing.assert_allclose(np.asarray(o), np.asarray(want_o), atol=1e-6)
        np.testing.assert_allclose(np.asarray(pool), np.asarray(want_pool), atol=1e-6)
