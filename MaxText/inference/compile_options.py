"""XLA compile options of the decode programs (config keys `decode_graph_scheduling`, `decode_loop_graphs`).

On a GPU, XLA runs a jitted program's kernels as CUDA graphs (command buffers). XLA's default records each graph's
kernels in one serial chain; `concurrent` records them as a DAG of their buffer dependencies, so that independent
kernels (a decode step has many: q / k / v and the gate projections, the router beside the shared expert) run side
by side. Measured on an H200 (Kimi-Linear-48B decode, one process, benchmarks/RESULTS.md): 3.03 instead of 3.54 ms
per token at batch 1, 6.77 instead of 6.93 at batch 8, with the same greedy tokens and a bit-identical cache after
16 steps (the schedule changes the order of independent kernels, not their arithmetic).

XLA's default command buffers leave out WHILE and CONDITIONAL: `Engine.generate`'s decode loop (a `while_loop`) then
returns to the host every iteration, which reads the loop's predicate from the device and launches the body's graphs
again. `decode_loop_graphs` adds both to the recorded command types of that program, so that its loop runs as one
CUDA graph with conditional nodes (48B batch 1 on an H200, one process: 2.582-2.589 vs 2.676 ms per step, the same
tokens). The speculative decoder's loop keeps XLA's default types (not yet timed on a GPU). Both options are XLA
debug options: other backends accept and ignore them.
"""

from __future__ import annotations

import ml_collections

GRAPH_SCHEDULING_CHOICES = ("serialize", "concurrent", "lhs")
GRAPH_SCHEDULING_OPTION = "xla_gpu_command_buffer_scheduling_mode"
COMMAND_TYPES_OPTION = "xla_gpu_enable_command_buffer"
# XLA's default command types (JAX 0.10-0.11) and the two that loops need. A compile option replaces the whole list
# (XLA_FLAGS' "+WHILE" form is refused there), so the defaults are named.
LOOP_COMMAND_TYPES = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE"


def decode_compiler_options(config: ml_collections.FrozenConfigDict,
                            decode_loop: bool = False) -> dict[str, str]:
    """`jax.jit(..., compiler_options=...)` for the decode programs: the CUDA-graph scheduling mode that
    `config.decode_graph_scheduling` names (serialize: XLA's default serial chain; concurrent: a DAG of buffer
    dependencies; lhs: the order of XLA's latency-hiding scheduler) and, for the Engine's decode loop (`decode_loop`)
    with `config.decode_loop_graphs`, its loop recorded into the graphs (LOOP_COMMAND_TYPES; otherwise XLA's own
    setting, e.g. from XLA_FLAGS)."""
    mode = config.decode_graph_scheduling
    if mode not in GRAPH_SCHEDULING_CHOICES:
        raise ValueError(f"decode_graph_scheduling={mode!r} is unknown; choose one of {GRAPH_SCHEDULING_CHOICES}")
    options = {GRAPH_SCHEDULING_OPTION: mode.upper()}
    if decode_loop and config.decode_loop_graphs:
        options[COMMAND_TYPES_OPTION] = LOOP_COMMAND_TYPES
    return options
