"""The decode programs' XLA compile options from the config."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText import pyconfig
from MaxText.inference.compile_options import LOOP_COMMAND_TYPES, decode_compiler_options

TINY = "configs/kimi_linear_tiny.yml"


@pytest.mark.parametrize("mode, option", [("serialize", "SERIALIZE"), ("concurrent", "CONCURRENT"), ("lhs", "LHS")])
def test_graph_scheduling_maps_to_the_xla_option(mode, option):
    config = pyconfig.load_config(TINY, {"decode_graph_scheduling": mode, "decode_loop_graphs": False})
    assert decode_compiler_options(config) == {"xla_gpu_command_buffer_scheduling_mode": option}


def test_loop_graphs_record_while_and_conditional_and_xla_accepts_the_option():
    config = pyconfig.load_config(TINY)
    assert config.decode_loop_graphs
    options = decode_compiler_options(config, decode_loop=True)
    assert options["xla_gpu_enable_command_buffer"] == LOOP_COMMAND_TYPES
    # programs other than the Engine's decode loop (the step, the speculative loop) keep XLA's command types
    assert "xla_gpu_enable_command_buffer" not in decode_compiler_options(config)
    assert {"WHILE", "CONDITIONAL", "FUSION", "CUSTOM_CALL"} <= set(LOOP_COMMAND_TYPES.split(","))

    def count_to_five(x):  # a while_loop, as in the decode loops
        return jax.lax.while_loop(lambda c: c[0] < 5, lambda c: (c[0] + 1, c[1] * 2), (0, x))[1]

    out = jax.jit(count_to_five, compiler_options=options)(jnp.ones(3))
    np.testing.assert_array_equal(np.asarray(out), np.full(3, 32.0))


def test_concurrent_is_the_default_and_a_bad_value_is_named():
    assert pyconfig.load_config(TINY).decode_graph_scheduling == "concurrent"
    with pytest.raises(pyconfig.ConfigError, match="decode_graph_scheduling.*'parallel'.*serialize, concurrent, lhs"):
        pyconfig.load_config(TINY, {"decode_graph_scheduling": "parallel"})
