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
