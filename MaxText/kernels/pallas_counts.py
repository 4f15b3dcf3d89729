"""Program counting inside the Pallas (Triton lowering) kernels: a launch whose programs each write a part of an
item's result lets the item's last program finish it (the KDA decode's output norm over a head's value blocks, the
MoE router's routing after its product's K blocks), with no second launch.

Each program counts itself done for its item with one atomic add on an int32 counter (acquire and release at GPU
scope, after a CTA barrier over the program's stores); the program that sees the last count runs the finish and
takes the launch's counts back, so the counters are zero again when the launch ends. A counters buffer kept between
launches (a decode cache entry, aliased in and out of each launch) therefore serves every step with no zeros made
and copied before each launch: XLA makes one zeros buffer for the launches of a program that pass fresh zeros and
copies it before each (1.4 us on the 48B decode step's dependent chain per launch, benchmarks/RESULTS.md,
twenty-ninth session).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton


def counters(counts: jax.Array | None, shape: tuple[int, ...], name: str, meaning: str) -> jax.Array:
    """A launch's int32 counters of `shape`: the caller's (a buffer kept between launches, checked: an error naming
    `name`, the expected shape with its `meaning` and what was given) or, for None, zeros made for this launch."""
    if counts is None:
        return jnp.zeros(shape, jnp.int32)
    if counts.shape != tuple(shape) or counts.dtype != jnp.int32:
        raise ValueError(f"{name} must be int32 [{', '.join(map(str, shape))}] ({meaning}), got {counts.dtype} "
                         f"{counts.shape}")
    return counts


def count_then_finish(counts_ref, item, programs_per_item: int, finish, interpret: bool) -> None:
    """Counts this program done for `item` (counts_ref [items] int32, zero before the launch) and runs `finish()` in
    the item's last program to count, which then sees every part written; that program leaves the count zero."""
    if not interpret:  # every thread's stores before the count (one thread's atomic)
        pltriton.debug_barrier()
    done_before = pltriton.atomic_add(counts_ref, item, jnp.int32(1))

    @pl.when(done_before == programs_per_item - 1)
    def _last():
        finish()
        # the launch's counts taken back (an add: the interpreter has no atomic exchange)
        pltriton.atomic_add(counts_ref, item, jnp.int32(-programs_per_item))
