"""benchmarks/kda_kernels.py's CPU-checkable parts: the decode state-traffic probe (Pallas interpret mode)."""

import jax.numpy as jnp
import numpy as np

from benchmarks.kda_kernels import state_traffic_probe


def test_state_traffic_probe_halves_the_slots_rows_only():
    """Every program rewrites its own [K, block_v] slice of its row's pool slot (all heads, all column blocks), and
    no other pool row: the probe moves exactly the decode kernel's state bytes."""
    pool = np.random.default_rng(0).standard_normal((5, 2, 16, 32)).astype(np.float32)
    slots = np.array([3, 0], np.int32)
    out = np.asarray(state_traffic_probe(jnp.asarray(pool), jnp.asarray(slots), block_v=16, num_warps=1,
                                         interpret=True))
    want = pool.copy()
    want[slots] *= 0.5
    np.testing.assert_array_equal(out, want)
