"""benchmarks/kda_kernels.py's CPU-checkable parts: the decode state-traffic probe (Pallas interpret mode)."""

import jax.numpy as jnp
import numpy as np
import pytest

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
