"""XLA compile options of the decode programs (config key `decode_graph_scheduling`).

On a GPU, XLA runs a jitted program's kernels as CUDA graphs (command buffers). XLA's default records each graph's
kernels in one serial chain; `concurrent` records them as a DAG of their buffer dependencies, so that independent
kernels (a decode step has many: q / k / v and the gate projections, the router beside the shared expert) run side
by side. Measured on an H200 (Kimi-Linear-48B decode, one process, benchmarks/RESULTS.md): 3.03 instead of 3.54 ms
per token at batch 1, 6.77 instead of 6.93 at batch 8, with the same greedy tokens and a bit-identical cache after
16 steps (the schedule changes the order of independent kernels, not their arithmetic). The option is an XLA debug
option: other backends accept and ignore it.
"""

from __future__ import annotations

import ml_collections

GRAPH_SCHEDULING_CHOICES = ("serialize", "concurrent", "lhs")
GRAPH_SCHEDULING_OPTION = "xla_gpu_command_buffer_scheduling_mode"


def decode_compiler_options(config: ml_collections.FrozenConfigDict) -> dict[str, str]:
    """`jax.jit(..., compiler_options=...)` for the decode programs: the CUDA-graph scheduling mode that
    `config.decode_graph_scheduling` names (serialize: XLA's default serial chain; concurrent: a DAG of buffer
    dependencies; lhs: the order of XLA's latency-hiding scheduler)."""
    mode = config.decode_graph_scheduling
    if mode not in GRAPH_SCHEDULING_CHOICES:
        raise ValueError(f"decode_graph_scheduling={mode!r} is unknown; choose one of {GRAPH_SCHEDULING_CHOICES}")
    return {GRAPH_SCHEDULING_OPTION: mode.upper()}
