"""XLA flags this project sets by default (in the process environment, before JAX starts its backend).

    --xla_gpu_command_buffer_scheduling_mode=CONCURRENT
        XLA runs a jitted program's kernels as CUDA graphs; by default each graph chains its kernels in the order of
        XLA's single-stream schedule. CONCURRENT makes each kernel depend only on the kernels whose buffers it reads
        or writes, so independent small kernels (the MoE router beside the shared expert, the low-rank gate
        projections beside q/k/v) run side by side. Measured on an H200: Kimi-Linear-48B decode at batch 1, TPOT
        3.364 ms vs 3.831 (benchmarks/RESULTS.md). Ignored without a GPU.

A flag the user already set in XLA_FLAGS (with any value, e.g. `...=SERIALIZE` to opt out) is left as it is.
`set_defaults()` must run before the first JAX computation: train_or_decode.py and benchmarks/model_decode.py call
it first thing; a program that imports MaxText as a library calls it itself (or sets XLA_FLAGS).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

DEFAULT_FLAGS = ("--xla_gpu_command_buffer_scheduling_mode=CONCURRENT",)


def with_defaults(xla_flags: str) -> str:
    """`xla_flags` (an XLA_FLAGS value) plus every DEFAULT_FLAGS entry whose flag name it does not set."""
    given = {token.split("=", 1)[0] for token in xla_flags.split()}
    missing = [flag for flag in DEFAULT_FLAGS if flag.split("=", 1)[0] not in given]
    return " ".join([xla_flags.strip(), *missing]).strip()


def set_defaults(environ: MutableMapping[str, str] = os.environ) -> str:
    """Adds the missing DEFAULT_FLAGS to environ["XLA_FLAGS"]; returns the new value."""
    environ["XLA_FLAGS"] = with_defaults(environ.get("XLA_FLAGS", ""))
    return environ["XLA_FLAGS"]
